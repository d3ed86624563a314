"""The replica check after a cell, from the kernel's side: ask every rank (one call), warn if they differ.

Every rank says whether the cell trained through taco (no collective); only when all say so do they compare
their fingerprints in one collective (:mod:`taco_notebook.comm.diagnostics.replicas`) and return the same report.
Not after a cell of an elastic cluster, whose members may change under the cell (:mod:`.run`).
"""

from __future__ import annotations

import logging
from typing import Any

from ...engine import calls

__all__ = ["check_replicas"]

log = logging.getLogger("taco_notebook")


def check_replicas(view: Any, sink: Any) -> dict[str, Any] | None:
    """Run the check on the ranks of ``view`` if every one has something to check (two calls: the collective
    runs only where no rank would be left out of it); a warning under the cell when they differ. The report,
    or None."""
    try:
        wanted = view.apply_sync(calls.check_replicas, False)
        if not wanted or not all(wanted):
            return None
        reports = view.apply_sync(calls.check_replicas, True)
    except Exception as exc:  # noqa: BLE001 - the cell succeeded: a failed check is a warning, not its failure
        sink.warn(f"the replica check after this cell failed: {type(exc).__name__}: {exc}")
        return None
    report: dict[str, Any] | None = next((r for r in reports if r is not None), None)
    if report is not None and not report["ok"]:
        sink.warn(report["text"])
    return report
