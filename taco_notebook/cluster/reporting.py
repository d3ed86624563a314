"""Tell the cluster registry (and so the JupyterLab sidebar) what cell runs on a cluster, and how far it got."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import registry

if TYPE_CHECKING:
    from ..server.models import RunModel
    from .session import TacoCluster

__all__ = ["RegistryRun", "cell_snippet"]

SNIPPET_CHARS = 120
WRITE_EVERY_S = 1.0  # the sidebar polls every ~2 s: writing the entry more often would only cost the kernel


def cell_snippet(code: str) -> str:
    """The first non-blank line of a cell, shortened: what the sidebar shows as the current run."""
    line = next((line.strip() for line in code.splitlines() if line.strip()), "")
    return line if len(line) <= SNIPPET_CHARS else line[: SNIPPET_CHARS - 1] + "…"


class RegistryRun:
    """A cell monitor: writes ``run`` (cell, step, total, samples/s) into the cluster's registry entry at most
    once a second, and clears it when the cell ends. It reads what the ranks publish but does not ask them to
    publish: with ``--no-dashboard`` the sidebar shows the cell and its start time only."""

    wants_metrics = False

    def __init__(self, cluster: TacoCluster, code: str) -> None:
        self.cluster = cluster
        self.run: RunModel = {"cell": cell_snippet(code), "started_at": time.time(), "step": 0, "total": None,
                         "samples_per_s": None}  # fmt: skip
        self.written = time.monotonic()
        registry.set_run(cluster, self.run)

    def update(self, payloads: Mapping[int, Mapping[str, Any]], running: Sequence[int]) -> None:
        now = time.monotonic()
        if now - self.written < WRITE_EVERY_S:
            return
        snapshots = [p["metrics"] for p in payloads.values() if p.get("metrics")]
        progress = [p["progress"] for p in payloads.values() if p.get("progress")]
        totals = [p["total"] for p in progress if p.get("total") is not None]
        rate = sum(s["samples"] / s["elapsed_seconds"] for s in snapshots if s.get("elapsed_seconds"))
        self.run = {"cell": self.run["cell"], "started_at": self.run["started_at"],
                    "step": max([s.get("steps", 0) for s in snapshots] + [p["n"] for p in progress], default=0),
                    "total": max(totals) if totals else None,
                    "samples_per_s": rate if rate > 0 else None}  # fmt: skip
        self.written = now
        registry.set_run(self.cluster, self.run)

    def finish(self, outcome: str) -> None:
        registry.set_run(self.cluster, None)
