"""Exceptions raised by taco_notebook.

User mistakes in magics raise IPython's ``UsageError`` (no traceback); everything that goes wrong on the
cluster raises a :class:`TacoError` subclass whose message names the rank, the host and what to do next.
"""

from __future__ import annotations

__all__ = [
    "TacoError",
    "ClusterStartError",
    "RankFailedError",
    "RankDiedError",
    "CellTimeoutError",
    "MPINotFoundError",
]


class TacoError(RuntimeError):
    """Base class of taco_notebook's errors."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a local traceback: the local frames (the magic's wait loop)
        # say nothing useful about a failure that happened on the cluster.
        return [f"{type(self).__name__}: {self}"]


class MPINotFoundError(TacoError):
    """No usable ``mpiexec`` (or mpi4py) was found."""


class ClusterStartError(TacoError):
    """The controller or the engines did not come up."""


class RankFailedError(TacoError):
    """The cell raised an exception on one or more ranks.

    ``tracebacks`` maps rank to the rendered remote traceback; the first failing rank's is shown in full,
    the others are summarised.
    """

    def __init__(self, message: str, tracebacks: dict[int, str], first_rank: int) -> None:
        super().__init__(message)
        self.tracebacks = tracebacks
        self.first_rank = first_rank

    def _render_traceback_(self) -> list[str]:
        return [f"[rank {self.first_rank}] " + self.tracebacks[self.first_rank],
                f"{type(self).__name__}: {self}"]


class RankDiedError(TacoError):
    """An engine process died (killed, segfault, out of memory) while a cell ran."""

    def __init__(self, message: str, rank: int | None, host: str | None, signal_name: str | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.host = host
        self.signal_name = signal_name


class CellTimeoutError(TacoError):
    """A cell ran past ``--timeout``; ``running`` lists the ranks that had not finished."""

    def __init__(self, message: str, running: list[int]) -> None:
        super().__init__(message)
        self.running = running
