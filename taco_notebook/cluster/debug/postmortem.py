"""``%taco_debug``: pdb in a failed rank's frames, from the notebook.

Each rank keeps its failed cell's exception until its next cell (:mod:`taco_notebook.engine.postmortem`); here
the notebook finds the ranks that hold one, picks the first that failed (or the one asked for), and runs a
session on it: each command read from the kernel's stdin (``input()``, as ``%debug`` reads it) or taken from
``-c``, sent to that rank alone, and its output shown. The other ranks are not involved and stay idle.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from ...engine import postmortem as rank_side
from ...errors import RankFailedError
from ..cells.reporting import ranks_phrase

__all__ = ["DebugError", "split_commands", "failures", "pick_rank", "run_session"]


class DebugError(RuntimeError):
    """Nothing to debug, or not that rank: the message says why and what to do."""


def split_commands(text: str) -> list[str]:
    """``-c "p x; up; p y"`` as pdb commands: split at ``;`` outside quotes and brackets (pdb's own ``;;`` too).

    >>> split_commands("p x; up; p (a, 'b;c')")
    ['p x', 'up', "p (a, 'b;c')"]
    """
    commands, word, depth, quote = [], "", 0, ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(0, depth - 1)
        elif char == ";" and depth == 0:
            commands.append(word)
            word = ""
            continue
        word += char
    commands.append(word)
    return [command.strip() for command in commands if command.strip()]


def failures(cluster: Any) -> dict[int, dict[str, Any]]:
    """The ranks of ``cluster`` that hold a failed cell, each ``{type, message, at}``."""
    ranks = [info.rank for info in sorted(cluster.ranks, key=lambda r: r.rank)]
    held = cluster.client[cluster.engine_ids(ranks)].apply_sync(rank_side.failure)
    return {rank: failure for rank, failure in zip(ranks, held, strict=True) if failure is not None}


def pick_rank(held: dict[int, dict[str, Any]], wanted: int | None, name: str) -> int:
    """``wanted`` when it holds a failure; by default the first rank that failed: the one the notebook's last
    error named first, else the one that kept its failure earliest."""
    if not held:
        raise DebugError(f"no rank of cluster {name!r} holds a failed cell: %taco_debug opens pdb where a "
                         "%%taco_run cell raised, until the next cell runs")
    if wanted is not None:
        if wanted not in held:
            raise DebugError(f"rank {wanted} holds no failed cell; {ranks_phrase(sorted(held))} "
                             f"{'does' if len(held) == 1 else 'do'}: %taco_debug --rank {min(held)}")
        return wanted
    last = getattr(sys, "last_value", None)
    if isinstance(last, RankFailedError) and last.first_rank in held:
        return last.first_rank
    return min(held, key=lambda rank: (held[rank]["at"], rank))


def run_session(cluster: Any, rank: int, commands: Sequence[str] | None, read: Callable[[str], str],
                show: Callable[[str], None]) -> None:
    """pdb on ``rank``: ``commands`` one after another (each echoed after its prompt), else each line ``read``
    until pdb ends the session (``q``, ``c``), end of input or Ctrl-C."""
    view = cluster.client[cluster.engine_ids([rank])[0]]
    prompt = f"(Pdb rank {rank}) "
    show(view.apply_sync(rank_side.start))
    try:
        for line in _lines(commands, read, prompt, show):
            output, ended = view.apply_sync(rank_side.command, line)
            show(output)
            if ended:
                return
    finally:
        view.apply_sync(rank_side.end)


def _lines(commands: Sequence[str] | None, read: Callable[[str], str], prompt: str,
           show: Callable[[str], None]) -> Any:
    if commands is not None:
        for command in commands:
            show(f"{prompt}{command}\n")
            yield command
        return
    while True:
        try:
            yield read(prompt)
        except (EOFError, KeyboardInterrupt):
            show("\n")
            return
