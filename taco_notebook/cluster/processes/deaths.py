"""How a cluster's ranks died, in words: read from what mpiexec and the engines printed.

Each rank runs under :mod:`~taco_notebook.engine.rankwrap`, which prints a marker line with its rank, host,
pid and how it ended; :func:`death_report` finds it in the engine set's log (:func:`engine_output`).
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...engine.rankwrap import MARKER
from ...errors import RankDiedError

__all__ = ["MARKER_LINE", "STOPPED_BY_MPI", "engine_output", "death_report", "died_error", "signal_name",
           "ranks_text"]

# rankwrap's line: rank, host, pid, then signal=N or exitcode=N; " elastic" when an elastic cell survived it
MARKER_LINE = re.compile(MARKER + r" rank=(\S+) host=(\S+) pid=(\d+) (signal|exitcode)=(-?\d+)( elastic)?")


def _job_ending(output: str) -> re.Match[str] | None:
    """The first marker of a death that ended the job (one an elastic cell survived did not)."""
    return next((m for m in MARKER_LINE.finditer(output) if m.group(6) is None), None)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def ranks_text(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks)) if ranks else "none"


def engine_output(paths: Sequence[str], launchers: Sequence[Any]) -> str:
    """The text of the engine sets' logs ``paths``; a log ipyparallel already removed is asked of its launcher
    (``launchers``), which read it on stop."""
    chunks = []
    by_path = {getattr(es, "output_file", None): es for es in launchers}
    for path in paths:
        try:
            with open(path, errors="replace") as f:
                chunks.append(f.read())
        except OSError:
            if path in by_path:
                chunks.append(by_path[path].get_output())
    return "".join(chunks)


def death_report(read_output: Callable[[], str],
                 wait: float = 3.0) -> tuple[str, int | None, str | None, str | None]:
    """(sentence, rank, host, signal name) of the first rank death in ``read_output()``.

    Waits up to ``wait`` s for the marker: mpiexec flushes the wrapper's line into the log late on a busy machine.
    """
    deadline = time.monotonic() + wait
    while (match := _job_ending(read_output())) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if match is None:
        return ("the engines' mpiexec exited unexpectedly", None, None, None)
    rank_text, host, pid, kind, value, _ = match.groups()
    rank = int(rank_text) if rank_text.isdigit() else None
    how = f"killed by {signal_name(int(value))}" if kind == "signal" else f"exited with code {value}"
    if kind == "signal" and int(value) == signal.SIGKILL:
        how += " (killed from outside, or out of memory)"
    return (f"rank {rank_text} (host {host}, pid {pid}) {how}", rank, host,
            signal_name(int(value)) if kind == "signal" else None)


STOPPED_BY_MPI = "stopped by MPI with it"  # the fate of a rank whose cell had not ended when the job ended


def died_error(cluster: str, ranks: Sequence[int], ended: Mapping[int, str],
               read_output: Callable[[], str]) -> RankDiedError:
    """The error of a cell on ``cluster`` whose rank died (:func:`death_report`), with the fate of every other of
    ``ranks``: how its cell had ended (``ended``: ``"finished"``, ``"raised ValueError: bad shard"``), else
    stopped by MPI with the job. Ranks of one fate are named together.

    ``rank 2 (host vm, pid 41) killed by SIGKILL; rank 1 finished; ranks 0, 3 stopped by MPI with it. …``
    """
    sentence, rank, host, sig = death_report(read_output)
    by_fate: dict[str, list[int]] = {}
    for other in sorted(ranks):
        if other != rank:
            by_fate.setdefault(ended.get(other, STOPPED_BY_MPI), []).append(other)
    fates = "".join(f"; {'rank' if len(rs) == 1 else 'ranks'} {ranks_text(rs)} {fate}" for fate, rs in by_fate.items())
    return RankDiedError(
        f"{sentence}{fates}. Cluster {cluster!r} was shut down; the next %%taco_run starts a fresh one.",
        rank, host, sig)
