"""The replica check after a cell, from the kernel's side: ask every rank (one call), warn if they differ.

The ranks decide whether the cell trained through taco and compare their fingerprints in one collective
(:mod:`taco_notebook.comm.replicas`); every rank returns the same report, or None when there was nothing to check.
"""

from __future__ import annotations

import logging
from typing import Any

from . import engine

__all__ = ["check_replicas"]

log = logging.getLogger("taco_notebook")


def check_replicas(view: Any, sink: Any) -> dict[str, Any] | None:
    """Run the check on the ranks of ``view``; a warning under the cell when they differ. The report, or None."""
    try:
        reports = view.apply_sync(engine.check_replicas)
    except Exception as exc:  # noqa: BLE001 - the cell succeeded: a failed check is a warning, not its failure
        sink.warn(f"the replica check after this cell failed: {type(exc).__name__}: {exc}")
        return None
    report: dict[str, Any] | None = next((r for r in reports if r is not None), None)
    if report is not None and not report["ok"]:
        sink.warn(report["text"])
    return report
