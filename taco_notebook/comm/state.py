"""comm/'s process state in one object, with explicit teardown, so the process group can be rebuilt.

A rank's communication state is one :class:`ProcessState` (``state``): the MPI communicator and topology,
the torch backend and device, the group *generation* (bumped by every ``init()``), the rendezvous, the
communication thread that runs every collective, and the 2D algorithm's groups for the current generation.
Whatever is made from a process group registers how to undo it with :meth:`ProcessState.on_teardown`;
``bootstrap.shutdown()`` destroys the group and then runs those callbacks, so the modules that build on the
group (algorithms) never have to be imported by the one that tears it down (bootstrap): no import loop, and
an elastic rebuild is ``shutdown()`` + ``init()`` in the same process.

Settings (:mod:`.config`) and counters (:mod:`.metrics`) are not here: they outlive a group on purpose.
Imports only the standard library and :mod:`.topology` (MPI and torch are imported when first needed).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .topology import Topology, intra_size_from_env, node_name

__all__ = ["CommThread", "ProcessState", "state"]

T = TypeVar("T")
_log = logging.getLogger(__name__)


class CommThread:
    """One daemon worker thread per process that runs every collective of comm/, in submission order.

    :meth:`abandon` (the process group is going away) hands later work to a fresh thread: a collective of the
    old group can stay blocked forever after a peer failed or was interrupted, and nothing queued behind it
    would ever run. The abandoned thread is a daemon, so it cannot hold the process at exit either.
    :meth:`take_pending` (the stall watchdog) also hands over the futures of the work that will now never run,
    so their waiters can be failed instead of waiting forever.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] | None = None
        self._ident: int | None = None
        self._running: dict[int, Future[Any]] = {}  # thread id -> the future of the work it runs (old ones too)
        self._lock = threading.Lock()

    def _work(self, work: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None]) -> None:
        me = self._ident = threading.get_ident()
        while (item := work.get()) is not None:
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            self._running[me], result = future, None
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                _settle(future, exc)
            else:
                _settle(future, None, result)
            finally:
                self._running.pop(me, None)
            del item, fn, future, result  # the finished work must not keep its tensors or groups alive

    def submit(self, fn: Callable[[], T], future: Future[T] | None = None) -> Future[T]:
        """Queue ``fn``; its result (or exception) goes to ``future`` (a new one by default)."""
        future = Future() if future is None else future
        with self._lock:
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                threading.Thread(target=self._work, args=(self._queue,), name="taco-comm", daemon=True).start()
            self._queue.put((fn, future))
        return future

    def run(self, fn: Callable[[], T], future: Future[T] | None = None) -> T:
        """Run ``fn`` on the thread and wait for it (directly when already on the thread)."""
        if threading.get_ident() == self._ident:
            return fn()
        return self.submit(fn, future).result()

    def abandon(self) -> None:
        """Later collectives run on a new thread; the current one ends once its queue is done (if ever)."""
        with self._lock:
            if self._queue is not None:
                self._queue.put(None)
            self._queue = None

    def take_pending(self) -> list[Future[Any]]:
        """Abandon the thread (it is stuck in a collective that will never complete) and return the futures of
        its running work and of everything queued behind it, which will now never run: the caller fails them."""
        pending: list[Future[Any]] = []
        with self._lock:
            running = self._running.get(self._ident) if self._ident is not None else None
            if running is not None and self._ident != threading.get_ident():
                pending.append(running)
            if self._queue is not None:
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        pending.append(item[1])
                self._queue.put(None)
            self._queue = None
        return pending


def _settle(future: Future[Any], error: BaseException | None, result: Any = None) -> None:
    """Complete ``future``, unless the stall watchdog already failed it (the collective came back after all)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def _mpi_world() -> Any:
    """MPI's world, checked against the launcher's rank count (a wrong MPI library fails here, at once)."""
    from mpi4py import MPI

    from .mpicheck import check_world

    check_world(MPI.COMM_WORLD)
    return MPI.COMM_WORLD


@dataclass
class ProcessState:
    """Everything this process knows about the job, and how to undo what was built on its process group."""

    mpi: Any = None  # MPI.COMM_WORLD, once asked for
    topology: Topology | None = None
    backend: str | None = None  # the process group's backend string while it is up
    device: Any = None  # this rank's torch.device while the group is up
    generation: int = 0  # bumped by every init(): caches keyed by it die with the group
    store: Any = field(default=None, repr=False)
    rendezvous: Any = field(default=None, repr=False)  # rendezvous.Rendezvous while the group is up
    comm_thread: CommThread = field(default_factory=CommThread, repr=False)
    hierarchy: dict[int, Any] = field(default_factory=dict, repr=False)  # generation -> 2D groups (or None)
    board: Any = field(default=None, repr=False)  # progress.Board of the group: who entered which collective
    stalled: Any = field(default=None, repr=False)  # the StallError that broke the group; init() clears it
    # Every member's node name once the notebook chose the group's members (elastic, :mod:`.membership`):
    # MPI's world then no longer describes the group, and init() must not build one over it.
    membership: tuple[str, ...] | None = None
    _teardown: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _on_start: list[Callable[[], Any]] = field(default_factory=list, repr=False)

    def on_group_start(self, callback: Callable[[], Any]) -> Callable[[], Any]:
        """Run ``callback`` on every rank as soon as a process group is up (collective: every rank runs it, in
        the same order; once per registration; usable as decorator)."""
        if callback not in self._on_start:
            self._on_start.append(callback)
        return callback

    def group_started(self) -> None:
        for callback in self._on_start:
            callback()

    def ensure_topology(self, intra_size: int | None = None) -> Topology:
        """This rank's topology from MPI (collective the first time, or when ``intra_size`` is given)."""
        if self.topology is None or intra_size is not None:
            self.mpi = self.mpi or _mpi_world()
            names = self.mpi.allgather(node_name())
            chosen = intra_size if intra_size is not None else intra_size_from_env()
            self.topology = Topology.from_hostnames(self.mpi.Get_rank(), names, chosen)
        return self.topology

    def on_teardown(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run ``callback`` whenever the process group goes away (once per registration; usable as decorator).

        Callbacks must be safe to run when they have nothing to undo: ``shutdown()`` runs them even when no
        group was ever made.
        """
        if callback not in self._teardown:
            self._teardown.append(callback)
        return callback

    def teardown(self, rendezvous_wait_s: float = 0.0) -> None:
        """Run every teardown callback (last registered first), then forget the group's store and backend.

        A failing callback does not stop the others; the first error is raised once all have run.
        ``rendezvous_wait_s``: how long the rendezvous' creator waits for its peers to let go of the store
        before removing its directory (:meth:`.rendezvous.Rendezvous.close`).
        """
        errors: list[BaseException] = []
        for callback in reversed(self._teardown):
            try:
                callback()
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the other callbacks ran
                _log.debug("teardown callback %r failed", callback, exc_info=True)
                errors.append(exc)
        self.store = None
        if self.board is not None:
            self.board.close()
            self.board = None
        if self.rendezvous is not None:
            self.rendezvous.close(rendezvous_wait_s)  # its private directory goes with the group
            self.rendezvous = None
        self.backend = None
        if errors:
            raise errors[0]


state = ProcessState()
