"""``%taco_cluster undo``, the notebook's side: every rank that ran the last cell is asked whether it can go back
(:func:`taco_notebook.engine.undo.undo_check`), and only when all can are they restored, so that no rank is put
back while another stays where it is. The kernel is idle while a magic runs, so no cell runs meanwhile.
"""

from __future__ import annotations

from typing import Any

from ...engine import undo as rank_side
from ..session import TacoCluster
from .autopsy import rank_span

__all__ = ["UndoRefused", "undo"]


class UndoRefused(Exception):
    """Some rank has nothing to undo; the message names the ranks and why, and no rank was changed."""


def undo(cluster: TacoCluster, ranks: list[int] | None = None) -> str:
    """Put ``ranks`` (default: all; the ranks the last cell ran on) back to their state before that cell; the line
    that says what was restored. :class:`UndoRefused` when any of them cannot."""
    members = sorted(r.rank for r in cluster.ranks)
    chosen = members if ranks is None else sorted(r for r in ranks if r in members) or members
    view = cluster.client[cluster.engine_ids(chosen)]
    with cluster.busy:
        reasons: list[str | None] = view.apply_sync(rank_side.undo_check)
        refused = [(rank, why) for rank, why in zip(chosen, reasons, strict=True) if why is not None]
        if refused:
            raise UndoRefused(_refusal(refused))
        reports: list[dict[str, int]] = view.apply_sync(rank_side.undo_restore)
    return _summary(chosen, reports)


def _refusal(refused: list[tuple[int, str]]) -> str:
    by_reason: dict[str, list[int]] = {}
    for rank, why in refused:
        by_reason.setdefault(why, []).append(rank)
    parts = [f"{rank_span(ranks)}: {why}" for why, ranks in by_reason.items()]
    return "%taco_cluster undo: nothing to undo, no rank was changed; " + "; ".join(parts)


def _counted(count: int, what: str) -> str:
    return f"{count} {what}{'s' if count != 1 else ''}"


def _summary(ranks: list[int], reports: list[dict[str, Any]]) -> str:
    first, most = reports[0], max(report["bytes"] for report in reports)
    parts = [_counted(first["tensors"], "tensor"), _counted(first["optimizers"], "optimizer")]
    if first["states"]:
        parts.append(_counted(first["states"], "elastic State"))
    same = all(report["bytes"] == most for report in reports)
    line = (f"undo: {rank_span(ranks)} back to before the last cell ({' + '.join(parts)}, "
            f"{'' if same else 'up to '}{_megabytes(most)} each)")
    dropped, new = max(r["dropped"] for r in reports), max(r["new"] for r in reports)
    if dropped:
        line += f"; {_counted(dropped, 'object')} dropped since the copy, not restored"
    if new:
        line += (f"; {_counted(new, 'object')} registered by that cell left as {'it is' if new == 1 else 'they are'} "
                 "(undo had no copy)")
    if all(r["unchanged"] for r in reports):
        line += ("; that cell had changed none of it, so nothing moved: undo takes back the last cell only, run it "
                 "right after the cell to take back")
    return line


def _megabytes(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.1f} kB"
