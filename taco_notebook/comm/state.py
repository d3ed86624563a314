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
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .group.topology import Topology, intra_size_from_env, node_name

__all__ = ["CommThread", "Deferred", "ProcessState", "state"]

T = TypeVar("T")
_log = logging.getLogger(__name__)


class Deferred(Exception):  # noqa: N818 - a signal between agreement.agree and the thread, not an error
    """Raised by :func:`.agreement.agree` on the communication thread: the running work is an operation matched
    by name (Horovod's ``*_async`` with a ``name``) that the other ranks do not run now; the thread parks it and
    goes on with the next, and runs it when the others reach it (:mod:`.byname`)."""

    def __init__(self, sig: Any, group: Any) -> None:
        super().__init__(sig)
        self.sig, self.group = sig, group


@dataclass(eq=False)
class _Item:
    fn: Callable[[], Any]
    future: Future[Any]
    by_name: bool = False  # may be parked until the other ranks reach it (Horovod's named *_async)
    started: bool = False
    sig: Any = None  # once parked: its agreement signature, and the torch group it runs over
    group: Any = None


class CommThread:
    """One daemon worker thread per process that runs every collective of comm/, in submission order.

    :meth:`abandon` (the process group is going away) hands later work to a fresh thread: a collective of the
    old group can stay blocked forever after a peer failed or was interrupted, and nothing queued behind it
    would ever run. The abandoned thread is a daemon, so it cannot hold the process at exit either.
    :meth:`take_pending` (the stall watchdog) also hands over the futures of the work that will now never run,
    so their waiters can be failed instead of waiting forever.

    Work submitted inside :meth:`by_name` (the Horovod face's named ``*_async`` calls) may be *parked* when the
    ranks disagree on what runs next (:mod:`.byname`): Horovod matches such operations by name, not by order.
    A parked operation runs when the other ranks reach it, or is queued again, in order, once someone waits for
    it (:meth:`unpark`, called by ``hvd.synchronize``).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Item | None] | None = None
        self._ident: int | None = None
        self._running: dict[int, Future[Any]] = {}  # thread id -> the future of the work it runs (old ones too)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._current: _Item | None = None  # the work the thread runs now (the agreement asks about it)
        self._parked: list[_Item] = []
        self._awaited: set[int] = set()  # id() of futures someone waits for: never parked

    def _work(self, work: queue.SimpleQueue[_Item | None]) -> None:
        me = self._ident = threading.get_ident()
        while (item := work.get()) is not None:
            if not item.started and not item.future.set_running_or_notify_cancel():
                continue
            item.started = True
            self._run(me, item)
            del item  # the finished work must not keep its tensors or groups alive

    def _run(self, me: int, item: _Item) -> None:
        previous, self._current = self._current, item
        self._running[me], result = item.future, None
        try:
            result = item.fn()
        except Deferred as deferred:
            item.sig, item.group = deferred.sig, deferred.group
            with self._lock:
                self._parked.append(item)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            _settle(item.future, exc)
        else:
            _settle(item.future, None, result)
        finally:
            self._current = previous
            if previous is not None:
                self._running[me] = previous.future
            else:
                self._running.pop(me, None)
            del result

    @contextmanager
    def by_name(self, on: bool = True) -> Iterator[None]:
        """Work submitted from this thread inside the block is matched by name (Horovod's rule) when ``on``."""
        before = getattr(self._local, "by_name", False)
        self._local.by_name = on
        try:
            yield
        finally:
            self._local.by_name = before

    def submit(self, fn: Callable[[], T], future: Future[T] | None = None) -> Future[T]:
        """Queue ``fn``; its result (or exception) goes to ``future`` (a new one by default)."""
        future = Future() if future is None else future
        with self._lock:
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                threading.Thread(target=self._work, args=(self._queue,), name="taco-comm", daemon=True).start()
            self._queue.put(_Item(fn, future, getattr(self._local, "by_name", False)))
        return future

    def run(self, fn: Callable[[], T], future: Future[T] | None = None) -> T:
        """Run ``fn`` on the thread and wait for it (directly when already on the thread)."""
        if threading.get_ident() == self._ident:
            return fn()
        return self.submit(fn, future).result()

    # ---------------------------------------------------------------- operations matched by name
    def may_park(self) -> bool:
        """Whether the work running now may be parked (on the thread: the agreement asks)."""
        item = self._current
        with self._lock:
            return item is not None and item.by_name and id(item.future) not in self._awaited

    def parked(self, group: Any) -> tuple[Any, ...]:
        """The signatures of the operations parked over ``group``, oldest first."""
        with self._lock:
            return tuple(item.sig for item in self._parked if item.group is group)

    def run_parked(self, sig: Any, group: Any) -> None:
        """Run the oldest operation parked over ``group`` with signature ``sig`` now (on the thread: the other
        ranks run it too)."""
        with self._lock:
            item = next(i for i in self._parked if i.group is group and i.sig == sig)
            self._parked.remove(item)
            item.by_name = False  # the others are at it: it must not be parked again
        self._run(threading.get_ident(), item)

    def unpark(self, future: Future[Any]) -> None:
        """Someone waits for ``future`` (any thread): it is never parked from now on, and if it is parked it goes
        to the end of the queue, to run in order. Call :meth:`awaited_done` when the wait ends."""
        with self._lock:
            self._awaited.add(id(future))
            item = next((i for i in self._parked if i.future is future), None)
            if item is None or self._queue is None:
                return
            self._parked.remove(item)
            item.by_name = False
            self._queue.put(item)

    def awaited_done(self, future: Future[Any]) -> None:
        with self._lock:
            self._awaited.discard(id(future))

    def _drop_parked(self) -> list[Future[Any]]:
        """Forget the parked work (the group is going away; call with the lock held): its futures."""
        futures = [item.future for item in self._parked]
        self._parked.clear()
        return futures

    def abandon(self) -> None:
        """Later collectives run on a new thread; the current one ends once its queue is done (if ever).
        Operations still parked fail: their group is going away."""
        with self._lock:
            if self._queue is not None:
                self._queue.put(None)
            self._queue = None
            parked = self._drop_parked()
        for future in parked:
            _settle(future, RuntimeError("the process group was torn down before the other ranks ran this "
                                         "operation (it waited for them by name)"))

    def take_pending(self) -> list[Future[Any]]:
        """Abandon the thread (it is stuck in a collective that will never complete) and return the futures of
        its running work, of everything queued behind it and of the parked work, which will now never run:
        the caller fails them."""
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
                        pending.append(item.future)
                self._queue.put(None)
            self._queue = None
            pending += self._drop_parked()
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

    from .group.mpicheck import check_world

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
