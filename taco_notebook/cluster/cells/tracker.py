"""Which ranks of a running cell have news, without reading every rank's state on every poll.

The cell's wait loop (:mod:`.run`) wakes every few tens of milliseconds. Reading every rank's metadata and asking
every rank's AsyncResult whether it is done on each wake costs the notebook O(ranks) per wake, even for a cell
that does nothing. Instead the client's own IO thread tells us, as messages arrive:

* ipyparallel calls each request's ``MessageFuture.iopub_callbacks`` for every IOPub message of that request
  (output, a dashboard payload, the idle status), after the message is in the request's metadata; ours appends
  the rank to a queue (the one read of ipyparallel's internals in the package, as its own ``stream_output``
  does it; without it every rank is read on every look);
* each rank's request has its own ``MessageFuture`` (a ``concurrent.futures.Future``, the AsyncResult's
  children, resolved with the rank's value or the exception it raised when its reply arrives): its done
  callback appends the rank to another queue. ``ar.split()``, which would wrap each in an AsyncResult of its own
  (six more futures and events per rank per cell), is the fallback where the children are not there.

The wait loop then reads only the ranks that were queued since it last looked. Every rank is queued once at the
start, for what arrived before the callbacks were in. ``collections.deque.append`` and ``popleft`` are
thread-safe, so the IO thread and the wait loop need no lock.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import InvalidStateError
from typing import Any

from ...engine.wire import CellReply

__all__ = ["RankTracker"]


class RankTracker:
    """Per-rank state of one submitted request on ``targets`` (ranks, in the order of ``ar.msg_ids``)."""

    def __init__(self, client: Any, ar: Any, targets: Sequence[int]) -> None:
        self.ar = ar
        children = list(getattr(ar, "_children", ()))
        # rank -> its request's MessageFuture (or, failing that, its own AsyncResult): done when its reply is in
        self.light = len(children) == len(targets) and all(_told_of(child) for child in children)
        self.parts: dict[int, Any] = dict(zip(targets, children if self.light else ar.split(), strict=True))
        self.metadata: dict[int, Any] = {rank: client.metadata[msg_id]
                                         for rank, msg_id in zip(targets, ar.msg_ids, strict=True)}
        self.finished: dict[int, None] = {}  # ranks whose request ended, in the order they did
        self._outcomes: dict[int, Any] = {}
        self._news: deque[int] = deque(targets)
        self._done: deque[int] = deque()
        self._order: list[int] = []
        self._cursor = 0
        self._ended = 0  # ranks whose done callback ran (counted under _lock)
        self._lock = threading.Lock()
        self._all_ended = threading.Event()
        # ipyparallel has no public way to be told of a request's IOPub messages: its own stream_output() appends
        # to the request's MessageFuture.iopub_callbacks, reached through the AsyncResult's children. Where that
        # is not there (another ipyparallel), every rank counts as having news on every look: slower, not wrong.
        told = {rank: part if self.light else (getattr(part, "_children", None) or [None])[0]
                for rank, part in self.parts.items()}  # rank -> the MessageFuture its IOPub callbacks hang on
        self.told = all(_told_of(future) for future in told.values())
        for rank, part in self.parts.items():
            if self.told:
                told[rank].iopub_callbacks.append(lambda _msg, rank=rank: self._news.append(rank))
            part.add_done_callback(lambda _future, rank=rank: self._ended_one(rank))

    def _ended_one(self, rank: int) -> None:
        """A rank's done callback (the client's IO thread, or this one when it was done already)."""
        if self.light:
            _end_silent_output(self.parts[rank])
        self._done.append(rank)
        with self._lock:
            self._ended += 1
            if self._ended == len(self.parts):
                self._all_ended.set()

    def done(self) -> bool:
        """Whether every rank's request ended: O(1) (``AsyncResult.ready()`` asks every rank's output future)."""
        return self._all_ended.is_set()

    def wait(self, timeout: float) -> bool:
        """Until every rank's request ended or ``timeout`` seconds passed; whether they all did."""
        return self._all_ended.wait(timeout)

    def news(self) -> set[int]:
        """The ranks that received IOPub messages since the last call (every rank when we are not told)."""
        if not self.told:
            self._news.clear()
            return set(self.parts)
        found = set()
        while self._news:
            found.add(self._news.popleft())
        return found

    def update(self) -> None:
        """Take in the ranks whose request ended since the last look: those seen in one look in rank order (the
        first of several failures named is then the lowest rank seen, as when every rank fails at once)."""
        batch = set()
        while self._done:
            batch.add(self._done.popleft())
        for rank in sorted(batch - self.finished.keys()):
            self.finished[rank] = None
            self._order.append(rank)

    def settle(self) -> None:
        """Once, when the request as a whole is done: every rank read again and every finished rank taken in,
        without waiting for the callbacks, which the IO thread may still be running (a Future wakes its waiters
        before it calls its callbacks)."""
        self._news.extend(self.parts)
        self.refresh()

    def refresh(self) -> None:
        """Every rank's AsyncResult asked whether it is done (O(ranks): where the answer must be exact now)."""
        for rank, part in self.parts.items():
            if rank not in self.finished and part.done():
                self._done.append(rank)

    def newly_finished(self) -> list[int]:
        """The ranks whose request ended since the last call of this method, in the order they did."""
        self.update()
        found, self._cursor = self._order[self._cursor:], len(self._order)
        return found

    def running(self) -> list[int]:
        self.update()
        return [rank for rank in self.parts if rank not in self.finished]

    def outcome(self, rank: int) -> Any:
        """What the finished rank's request returned: its value, or the RemoteError it raised (read once).

        Read from the rank's own future (the client's ``results`` cache is purged as soon as a message and its
        output are in, so it cannot be polled): ipyparallel resolves a request's MessageFuture with the value, or
        with the exception (a RemoteError, an EngineError) as its result. ``split()`` hands a one-rank request
        its own AsyncResult, whose result is a list of one."""
        if rank not in self._outcomes:
            part = self.parts[rank]
            if self.light:
                try:
                    value = part.result(0)
                except Exception as exc:  # noqa: BLE001 - a future failed rather than resolved: the rank's outcome
                    value = exc
            else:
                value = part.get(0, return_exceptions=True)
                value = value[0] if part is self.ar else value
            self._outcomes[rank] = value
        return self._outcomes[rank]

    def outcomes(self) -> dict[int, Any]:
        self.update()
        return {rank: self.outcome(rank) for rank in self.finished}


def _end_silent_output(future: Any) -> None:
    """A runner whose request sent nothing on IOPub says so in its reply (``"silent"``, ``quiet_kernel.end_silently``)
    and its engine sends no idle status: the reply is then the end of the request's output, so resolve the
    output future ipyparallel would have resolved at the idle status (``MessageFuture.output``), which lets
    ``wait_for_output`` return and ipyparallel drop the request's bookkeeping."""
    if future.cancelled() or future.exception() is not None:
        return
    reply, output = future.result(), getattr(future, "output", None)
    if isinstance(reply, CellReply) and reply.silent and output is not None and not output.done():
        try:
            output.set_result(None)
        except InvalidStateError:  # an idle status resolved it meanwhile (quiet_kernel.end_silently: sent after all)
            pass


def _told_of(future: Any) -> bool:
    """Whether ``future`` is an ipyparallel MessageFuture whose IOPub callbacks we can hang on."""
    return hasattr(future, "done") and isinstance(getattr(future, "iopub_callbacks", None), list)
