"""``taco.progress(iterable)``: a tqdm-like loop wrapper whose bar is drawn by the notebook, not by the rank.

Each rank counts its own iterations; under ``%%taco_run`` the count travels to the notebook with the metric
snapshots (at most every send interval, and once more when the loop ends) and the dashboard draws one bar for
all ranks (the slowest rank's count: a synchronous job is as far as its slowest rank). Under plain ``mpiexec``
rank 0 prints a line every ``print_every`` seconds and at the end.

Example::

    for batch in taco.progress(loader, desc="epoch 1"):
        ...
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

from . import metrics

__all__ = ["progress"]

T = TypeVar("T")


class progress(Generic[T]):  # noqa: N801 - named like tqdm, used like a function
    """Iterate over ``iterable`` reporting progress; ``total`` defaults to ``len(iterable)`` when it has one.

    ``print_every`` (seconds) only matters where no notebook receives the progress (plain ``mpiexec``).
    """

    def __init__(
        self, iterable: Iterable[T], total: int | None = None, desc: str = "", print_every: float = 10.0
    ) -> None:
        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        if total is not None and (not isinstance(total, int) or total < 0):
            raise ValueError(f"total must be a non-negative integer, got {total!r}")
        self.iterable = iterable
        self.total = total
        self.desc = desc
        self.print_every = print_every
        self.n = 0

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this progress has no total: pass total=N")
        return self.total

    def _state(self, started: float, now: float) -> dict[str, object]:
        return {"n": self.n, "total": self.total, "desc": self.desc, "elapsed_seconds": now - started}

    def __iter__(self) -> Iterator[T]:
        started = last_print = time.perf_counter()
        metrics.mark(started)  # the loop's work counts from here in the dashboard's series
        metrics.set_progress(self._state(started, started))
        printing = metrics.sender() is None and _is_rank_zero()
        try:
            for item in self.iterable:
                yield item
                self.n += 1
                now = time.perf_counter()
                state = metrics.progress_state()
                if state is not None:  # a plain dict update: the sender reads it when it next sends
                    state["n"] = self.n
                    state["elapsed_seconds"] = now - started
                metrics.iteration(now)  # counts the turn, records the series, sends at the interval
                if printing and now - last_print >= self.print_every:
                    last_print = now
                    self._print(now - started)
        finally:
            now = time.perf_counter()
            metrics.set_progress(self._state(started, now))
            metrics.send()
            if printing:
                self._print(now - started)

    def _print(self, elapsed: float) -> None:
        rate = self.n / elapsed if elapsed > 0 else 0.0
        of = f"/{self.total}" if self.total is not None else ""
        label = f"{self.desc}: " if self.desc else ""
        sys.stderr.write(f"{label}{self.n}{of} [{elapsed:.1f} s, {rate:.2f} it/s]\n")
        sys.stderr.flush()


def _is_rank_zero() -> bool:
    from ..state import state

    return state.topology is None or state.topology.rank == 0
