"""Exceptions raised by taco_notebook.

A user's mistake in an option or a setting raises :class:`OptionError`, which the magics show as IPython's
``UsageError`` (no traceback) and the command line as a usage error (exit 2); everything that goes wrong on the
cluster raises a :class:`TacoError` subclass whose message names the rank, the host and what to do next.
"""

from __future__ import annotations

import re

__all__ = [
    "TacoError",
    "OptionError",
    "ClusterStartError",
    "RankFailedError",
    "RankDiedError",
    "CellTimeoutError",
    "MPINotFoundError",
    "StallError",
    "CellInterrupted",
]


class TacoError(RuntimeError):
    """Base class of taco_notebook's errors."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a local traceback: the local frames (the magic's wait loop)
        # say nothing useful about a failure that happened on the cluster.
        return [f"{type(self).__name__}: {self}"]


class OptionError(TacoError):
    """A bad option, setting or command line, caught before anything starts; the message names it and the fix."""


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


class CellInterrupted(KeyboardInterrupt):
    """Ctrl-C (the kernel's interrupt) stopped a cell running on the ranks. A KeyboardInterrupt, so Run All stops
    as for any interrupted cell; IPython shows ``tracebacks`` (rank -> where that rank's own code was when
    SIGINT reached it) instead of the local frames, which are only the magic's wait loop."""

    def __init__(self, message: str, tracebacks: dict[int, str]) -> None:
        super().__init__(message)
        self.tracebacks = tracebacks

    def _render_traceback_(self) -> list[str]:
        first = next(iter(self.tracebacks), None)
        shown = [] if first is None else [f"[rank {first}] " + self.tracebacks[first]]
        return [*shown, f"KeyboardInterrupt: {self}"]


class StallError(TacoError):
    """A collective waited longer than the stall timeout (``taco.configure(stall_timeout=…)``,
    ``--stall-timeout``, ``TACO_STALL_TIMEOUT``); the process group was torn down.

    Raised on the ranks that waited, with ``missing`` the ranks that had not entered the collective (the ranks
    to treat as lost), and on a late rank that entered it after its peers gave up, with ``missing`` empty and
    ``gave_up`` the ranks that stopped waiting for it. ``collective`` is its label (``allreduce #57
    ('ddp-bucket', 3)``), ``seq`` its number in the group, ``hosts`` the host of each rank named.
    """

    def __init__(self, message: str, *, collective: str = "", seq: int = 0, waited_s: float = 0.0,
                 missing: tuple[int, ...] = (), gave_up: tuple[int, ...] = (),
                 hosts: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.collective = collective
        self.seq = seq
        self.waited_s = waited_s
        self.missing = tuple(missing)
        self.gave_up = tuple(gave_up)
        self.hosts = dict(hosts or {})

    def __reduce__(self) -> tuple[object, ...]:  # keyword fields survive pickling (to the kernel, elastic driver)
        return (_rebuild_stall, (str(self), self.__dict__.copy()))

    @staticmethod
    def missing_in(message: str) -> list[int]:
        """The ranks a StallError's message names as not arrived (``[]`` if none): how the kernel, which gets
        the rank's error as text, says which ranks stalled.

        >>> StallError.missing_in("allreduce #3 stalled 3 s: ranks 2, 3 (host n1) have not arrived")
        [2, 3]
        """
        found = re.search(r"stalled [^:]*: ranks? ([\d, ]+) \(host", message)
        return [int(rank) for rank in found.group(1).split(",")] if found else []


def _rebuild_stall(message: str, fields: dict[str, object]) -> StallError:
    error = StallError(message)
    error.__dict__.update(fields)
    return error
