"""TacoCluster: an ipyparallel cluster whose engines are MPI ranks, and the one home of that cluster's state.

It wraps ``ipyparallel.Cluster(engines="mpi")`` and adds engine ids checked against MPI ranks, each rank's host
and pid, a torch process group on start, and which rank died and how. Lifecycle events go to subscribers.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

from ..engine import calls
from ..errors import ClusterStartError, RankDiedError
from ..model import ClusterModel, MembershipModel, OwnerKind, PendingModel, RunModel, State
from .describe import RankInfo, hugepages_of, new_cluster_id, nodes_of, owner_of
from .launch import engineset, ippfiles
from .launch.ipplog import IPP_LOG
from .launch.mpi import MPIInfo
from .launch.profiles import LOCAL, Profile, mpi_for
from .processes.deaths import death_report, died_error, engine_output
from .processes.teardown import stop_processes
from .processes.tree import descendants, kill, marked_processes, process_tree, shared_memory_files

__all__ = ["RankInfo", "Event", "Subscriber", "HeldMembership", "TacoCluster", "clusters", "kept", "stop_all",
           "exiting"]

log = logging.getLogger("taco_notebook")

Event = Literal["starting", "running", "stopping", "stopped", "broken", "run"]
Subscriber = Callable[["TacoCluster", Event], None]
EXIT_WAIT_S = 30.0  # at exit, how long a stop/scale that the registry's watcher is carrying out may go on
NO_ENGINES = "the engines' mpiexec exited; scale or delete the cluster"


class HeldMembership(Protocol):
    """What a cluster asks of the elastic membership it holds (a protocol: elastic/ imports this module)."""

    owns_membership: bool  # True once ranks were renumbered: the group is no longer MPI's world

    def model(self) -> MembershipModel: ...
    def rebuild(self, cluster: TacoCluster, members: list[RankInfo]) -> None: ...
    def expect_engines(self, count: int, known: set[int]) -> None: ...
    def grow(self, cluster: TacoCluster, size: int) -> None: ...


class TacoCluster:
    """One named cluster of ``size`` MPI ranks.

    >>> c = TacoCluster("default", 4).start()
    >>> c.view.apply_sync(lambda: 1)
    [1, 1, 1, 1]
    >>> c.stop()

    ``busy`` is held while a cell runs (by the cell runner) and while the cluster restarts: the registry's
    watcher carries out the sidebar's stop/scale requests only when it can take it. ``cluster_id`` is set by
    the first start and kept by later ones (:meth:`scale`), so the registry entry keeps its id.

    Only this class writes its fields; other modules change them through its verbs: :meth:`request`,
    :meth:`take_request` and :meth:`fail` (the server's manager), :meth:`set_run` (the cell runner), the
    methods under "membership" (an elastic membership) and :meth:`kill_engines`."""

    owner_kind: OwnerKind = "kernel"  # "server" for the clusters a Jupyter server owns
    cluster_id: str | None = None

    def __init__(self, name: str = "default", size: int = 4, mpiexec: str | None = None,
                 start_timeout: float | None = None, env: dict[str, str] | None = None,
                 profile: Profile | None = None, *, cluster_id: str | None = None,
                 owner_kind: OwnerKind | None = None, mpi: MPIInfo | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        if size <= 0:
            raise ValueError(f"size must be a positive integer, got {size}")
        self.profile = profile or LOCAL  # where the engines run (cluster/launch/profiles.py)
        self._engines: Any = "mpi"  # ipp.Cluster's engines: "mpi", or the slurm profile's launcher class
        self.profile.check_size(size)
        self.name = name
        self.size = size
        self.mpiexec = mpiexec
        self.start_timeout = start_timeout  # None: by the size (engineset.start_timeout)
        if cluster_id is not None:
            self.cluster_id = cluster_id
        if owner_kind is not None:
            self.owner_kind = owner_kind
        self.env = dict(env or {})
        self.mpi = mpi
        self.ipp_cluster: Any = None
        self.client: Any = None
        self.ranks: list[RankInfo] = []
        self.started_at: float | None = None
        self.error: str | None = None
        self.pending: PendingModel | None = None
        self.run: RunModel | None = None
        self.needs_reinit = False
        self.processes: list[Any] = []  # psutil.Process
        self._phase: Literal["starting", "stopping"] | None = None
        self._subscribers: list[Subscriber] = []
        self.shared_memory: set[str] = set()  # MPI's /dev/shm segments: a killed rank leaves them behind
        self._sets = engineset.StartedSets()
        self.busy = threading.RLock()
        self.progress = progress  # engines registered so far, and the slurm profile's queue-state lines
        self.elastic: HeldMembership | None = None  # a Membership once an --elastic cell ran here

    # ---------------------------------------------------------------- state
    @property
    def state(self) -> State:
        """The one place a cluster's state is decided: starting/stopping while :meth:`start`/:meth:`stop` run;
        broken when it has an ``error`` or the engines it started are gone; else running or stopped."""
        if self._phase is not None:
            return self._phase
        if self.error is not None or (self.processes and self.ipp_cluster is not None and not self.engines_alive()):
            return "broken"
        return "running" if self.ipp_cluster is not None else "stopped"

    @property
    def running(self) -> bool:
        """Whether a cell may run on it: started, and not known to be broken (engines are checked by the cell)."""
        return self.ipp_cluster is not None and self.error is None

    def model(self) -> ClusterModel:
        """The cluster as the registry, the REST API and the sidebar show it (safe from any thread); the server
        sets ``this_server`` when it serves it."""
        state = self.state
        up = state in ("running", "broken")
        nodes = nodes_of(self.ranks) if state != "starting" else []
        return {
            "id": self.cluster_id or "", "name": self.name, "profile": self.profile.name,
            "owner": owner_of(self.owner_kind), "this_server": False, "state": state, "size": self.size,
            "engines_up": len(self.ranks) if up else 0,
            "mpi": self.mpi.description if self.mpi else "", "nodes": nodes, "gpus": sum(n["gpus"] for n in nodes),
            "hugepages": hugepages_of(self.ranks) if state != "starting" else None,
            "started_at": self.started_at if state != "starting" else None, "updated_at": time.time(),
            "run": self.run, "pending": self.pending,
            "error": self.error or (NO_ENGINES if state == "broken" else None),
            "membership": self.elastic.model() if self.elastic is not None else None,
        }

    def subscribe(self, subscriber: Subscriber) -> None:
        """Call ``subscriber(cluster, event)`` on each lifecycle event, in the thread that caused it:
        ``starting``, ``running``, ``stopping``, ``stopped`` (final; not between the two halves of a
        :meth:`scale`), ``broken`` (:meth:`kill_engines`) and ``run`` (:meth:`set_run`)."""
        self._subscribers.append(subscriber)

    def _emit(self, event: Event) -> None:
        for subscriber in list(self._subscribers):
            try:
                subscriber(self, event)
            except Exception:  # a subscriber (the sidebar's registry) must not break the cluster's lifecycle
                log.exception("cluster %r: a subscriber failed on %r", self.name, event)

    def set_run(self, run: RunModel | None) -> None:
        """Record the cell running on the cluster (None when it ends); the caller throttles (say, once a second)."""
        self.run = run
        self._emit("run")

    def request(self, action: Literal["stop", "scale"], size: int | None = None) -> None:
        """Show a stop or scale as ``pending`` until whoever carries it out calls :meth:`take_request`."""
        self.pending = {"action": action, "size": size, "requested_at": time.time()}

    def take_request(self) -> None:
        """The pending action begins: it is no longer pending, and the last action's error is forgotten."""
        self.pending = None
        self.error = None

    def fail(self, why: str) -> None:
        """Record why the last action on the cluster failed: it shows broken, with ``why``, until it starts."""
        self.error = why

    # ---------------------------------------------------------------- lifecycle
    def announce_start(self) -> None:
        """Show it ``starting`` now, for a :meth:`start` queued to another thread (the server's manager)."""
        self._phase = "starting"
        self._emit("starting")

    def start(self) -> TacoCluster:
        """Start controller and ``size`` engines, check them, and bring up the process group on every rank.
        Emits ``starting``, then ``running`` (failing: ``stopping``/``stopped``, and raises)."""
        from ..ipp import upstream as ipp
        from ..ipp.client import connect

        self.mpi = mpi_for(self.profile, self.mpi, self.mpiexec)
        cluster_id = self.cluster_id = self.cluster_id or new_cluster_id(self.name)
        self.error = None
        self._phase = "starting"
        _live[cluster_id] = self
        self._emit("starting")
        try:
            profile_dir = ippfiles.prepare(cluster_id)  # private, dead owners' files swept, this one's recorded
            per_host = self.profile.ranks_per_node(self.size)  # the busiest host's engines: the start's load
            config, self._engines = engineset.ipp_config(self.name, self.size, self.profile, self.mpi, self.env,
                                                         cluster_id, self.progress)
            self.ipp_cluster = ipp.Cluster(engines=self._engines, n=self.size, profile_dir=str(profile_dir),
                                           config=config, controller_ip=self.profile.controller_ip, log=IPP_LOG,
                                           cluster_id=cluster_id,
                                           controller_args=engineset.controller_args(self.size, per_host),
                                           shutdown_atexit=False)
            self.ipp_cluster.start_cluster_sync()
            self._sets.refresh(self.ipp_cluster)
            self.client = connect(self.ipp_cluster)  # ipyparallel's client, lighter per request
            timeout = self.start_timeout or engineset.start_timeout(self.size, per_host)
            engineset.wait_for_engines(self.client, self.size, timeout, self._start_failure, self.profile,
                                       self._sets.launchers, self.progress)
            self.check_ranks()
            self.view.apply_sync(calls.setup_namespace)  # `taco`, the process group, the metrics flush
        except BaseException as exc:
            output = self.engine_output()
            self._phase = None
            self.stop()
            if isinstance(exc, ClusterStartError) or not isinstance(exc, Exception):  # Ctrl-C, SystemExit: as is
                raise
            raise ClusterStartError(self._failed(exc, output)) from exc
        self.started_at = time.time()
        self.needs_reinit = False
        self.processes = process_tree(self.ipp_cluster)  # killed at stop even if orphaned by then
        self.shared_memory = shared_memory_files(self.ranks)
        self._phase = None
        self._emit("running")
        return self

    def _start_failure(self) -> str | None:
        """Once mpiexec exited: why the start failed, with the engines' last lines; None while it runs."""
        if self.ipp_cluster is None or self.engines_alive():
            return None
        return self._failed(death_report(self.engine_output)[0], self.engine_output())

    def _failed(self, why: object, output: str) -> str:
        return f"cluster {self.name!r} failed to start: {why}\n" + "\n".join(output.strip().splitlines()[-15:])

    def check_ranks(self) -> None:
        """Read every engine's :class:`RankInfo` into :attr:`ranks`; fails unless engine ids are MPI ranks."""
        self.ranks = engineset.read_ranks(self.client, self.name)

    def stop(self, fast: bool = False) -> None:
        """Stop engines and controller; leaves nothing running. Safe to call twice. Emits ``stopping`` (if it
        ran) and ``stopped``. ``fast`` (at exit) terminates the processes instead of asking them to exit."""
        self._stop(fast, final=True)

    def _stop(self, fast: bool = False, final: bool = True) -> None:
        """:meth:`stop`; ``final`` False (a restart under the same id: :meth:`scale`) emits no ``stopped``."""
        if self.ipp_cluster is not None:
            self._phase = "stopping"
            self._emit("stopping")
        try:
            self._stop_processes(fast)
        finally:
            self._phase = None if final else "starting"  # a restart follows: never shown stopped in between
            if final:
                _live.pop(self.cluster_id or "", None)
                if self.cluster_id:
                    ippfiles.remove_cluster_files(self.cluster_id)
                self._emit("stopped")

    def scale(self, size: int) -> TacoCluster:
        """Restart with ``size`` ranks under the same name and registry id (an elastic cluster grows instead):
        MPI fixes a job's world size at launch, so what the engines held is lost. Holds :attr:`busy` meanwhile."""
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"size must be a positive integer, got {size!r}")
        if self.elastic is not None and self.running and size > len(self.ranks):
            self.elastic.grow(self, size)  # the new engines join at the next commit, the survivors untouched
            return self
        with self.busy:
            self._stop(final=False)
            self.size = size
            return self.start()

    def _stop_processes(self, fast: bool = False) -> None:
        cluster, client = self.ipp_cluster, self.client
        self.ipp_cluster = self.client = None
        self.ranks = []
        self.elastic = None
        if cluster is None:
            return
        tree = process_tree(cluster) + self.processes
        shared_memory = self.shared_memory  # teardown adds the segments the processes still map
        self.processes = []
        self.shared_memory = set()
        stop_processes(cluster, client, tree, shared_memory, fast)
        kill(marked_processes(self.cluster_id or ""))  # orphans the tree missed (a controller stopped mid-fork)

    # ---------------------------------------------------------------- membership
    def reinit(self) -> None:
        """Rebuild the process group on every rank (after a failed or interrupted cell): over MPI's world, or
        over the members chosen once an elastic change happened."""
        if self.elastic is not None and self.elastic.owns_membership:
            self.elastic.rebuild(self, list(self.ranks))
        else:
            self.view.apply_sync(calls.reinit)
        self.needs_reinit = False

    def launch_engines(self, count: int) -> None:
        """Start ``count`` more engines (a second ``mpiexec`` to the same controller) for an elastic cluster: they
        join at the next commit of an ``--elastic`` cell, the running ones untouched."""
        if self.ipp_cluster is None or self.elastic is None:
            raise RuntimeError(f"cluster {self.name!r} runs no elastic cell: engines can only be added to an "
                               "elastic cluster (run a %%taco_run --elastic cell first)")
        self.elastic.expect_engines(count, set(self.client.ids) if self.client is not None else set())
        self.ipp_cluster.start_engines_sync(n=count)
        self._sets.refresh(self.ipp_cluster)
        self.processes = list({p.pid: p for p in self.processes + process_tree(self.ipp_cluster)}.values())

    def kill_ranks(self, ranks: list[int]) -> None:
        """SIGKILL the engines of ``ranks`` (hung members): a local one only when it is in this cluster's engine
        sets' process tree (proven ours), any other through ipyparallel's signal request to that engine."""
        ours = {p.pid: p for p in engineset.set_processes(engineset.engine_sets(self.ipp_cluster))}
        kill([ours[r.pid] for r in self.ranks if r.rank in ranks and r.pid in ours], wait=False)
        remote = [r.rank for r in self.ranks if r.rank in ranks and r.pid not in ours]
        if remote:
            self.client.send_signal(signal.SIGKILL, targets=self.engine_ids(remote), block=False)

    def hold_membership(self, membership: HeldMembership) -> None:
        """Keep ``membership`` (an --elastic cell's) until the cluster stops: :meth:`model` shows it."""
        self.elastic = membership

    def adopt_ranks(self, ranks: list[RankInfo], rebuilt: bool = True) -> None:
        """``ranks`` (engine ids included) are the members now: a group was just ``rebuilt`` over them (the size
        follows), or members died and the rest wait for a rebuild (the size stays)."""
        self.ranks = list(ranks)
        if rebuilt:
            self.size = len(ranks)
            self.needs_reinit = False

    def mark_group_broken(self) -> None:
        """The ranks' process group cannot be trusted (a failed cell, a lost member): the next cell rebuilds it."""
        self.needs_reinit = True

    # ---------------------------------------------------------------- engines
    @property
    def view(self) -> Any:
        if self.client is None:
            raise RuntimeError(f"cluster {self.name!r} is not running")
        return self.client[self.engine_ids()] if self.elastic is not None else self.client[:]

    def engine_log_paths(self) -> list[str]:
        """The engine sets' logs, where mpiexec gathers what the ranks and their wrappers print."""
        return self._sets.log_paths(self.ipp_cluster)

    def engine_ids(self, ranks: list[int] | None = None) -> list[int]:
        """The ipyparallel engine ids of ``ranks`` (default: every rank), in that order."""
        by_rank = {r.rank: (r.engine_id if r.engine_id >= 0 else r.rank) for r in self.ranks}
        return [by_rank[r] for r in (sorted(by_rank) if ranks is None else ranks)]

    def kill_engines(self, reason: str) -> None:
        """Kill the engines now (after a hung interrupt); the next run starts a fresh cluster."""
        if self.ipp_cluster is not None:
            controller = getattr(self.ipp_cluster.controller, "process", None)
            # No waiting: SIGKILL is certain, and Ctrl-C must return now; stop() reaps them later.
            kill(engineset.set_processes(engineset.engine_sets(self.ipp_cluster))
                 + [p for p in self.processes if p not in descendants(controller)], wait=False)
        self.error = reason
        self._emit("broken")

    def engines_alive(self) -> bool:
        """Whether every engine set this cluster started still runs."""
        return engineset.sets_alive(engineset.engine_sets(self.ipp_cluster), self.profile.slurm is not None)

    def engine_output(self) -> str:
        """What mpiexec and the engines printed (the engine set's log)."""
        return engine_output(self.engine_log_paths(), self._sets.launchers)

    def died_error(self, ended: Mapping[int, str]) -> RankDiedError:
        """The error of a cell whose rank died: which, where, how, and every other rank's fate (``ended``: how the
        cells that had ended did, by rank; the rest MPI stopped)."""
        return died_error(self.name, [r.rank for r in self.ranks], ended, self.engine_output)


clusters: dict[str, TacoCluster] = {}
_live: dict[str, TacoCluster] = {}  # every cluster this process started and has not stopped, by id
kept: set[str] = set()  # ids of clusters kept for another process to adopt (registry/keep.py): not stopped at exit
exiting = threading.Event()  # set first thing at exit: the registry's watcher takes no more requests


def stop_all(fast: bool = False) -> None:
    """Stop every cluster this kernel started and named in :data:`clusters`."""
    for name in list(clusters):
        clusters.pop(name).stop(fast=fast)


def _stop_at_exit() -> None:
    """The process's one exit hook: stop every cluster it started but the :data:`kept`, fast. ipyparallel's own
    hook is off for them (``shutdown_atexit=False``): its slower stop would outlast a kernel's grace at shutdown.
    Each stops under its ``busy`` lock, so a stop or scale in progress finishes first (up to :data:`EXIT_WAIT_S`)."""
    exiting.set()
    owned = {id(c): c for c in [*clusters.values(), *_live.values()] if c.cluster_id not in kept}
    clusters.clear()
    for cluster in owned.values():
        taken = cluster.busy.acquire(timeout=EXIT_WAIT_S)
        try:
            cluster.stop(fast=True)
        except Exception:  # at exit there is no caller: log, and stop the others
            log.exception("stopping cluster %r at exit failed", cluster.name)
        finally:
            if taken:
                cluster.busy.release()


atexit.register(_stop_at_exit)
