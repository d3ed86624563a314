"""TacoCluster: an ipyparallel cluster whose engines are MPI ranks, and the one home of that cluster's state.

Wraps ``ipyparallel.Cluster(engines="mpi")`` (process management is ipyparallel's), and adds what a training
user needs on top: engine id checked against MPI rank, each rank's host and pid, the MPI implementation, a
torch process group brought up on start, and a liveness check that says which rank died and how.

All the sidebar shows lives on the :class:`TacoCluster`; :meth:`TacoCluster.model` builds the ClusterModel, and
lifecycle events go to subscribers (:meth:`TacoCluster.subscribe`), the registry writer among them
(:mod:`~taco_notebook.cluster.registry.writer`; this module imports no registry code). Clusters are kept by name
in :data:`clusters`; every cluster this process started is stopped by the one exit hook registered here.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from ..errors import ClusterStartError, RankDiedError
from ..model import ClusterModel, OwnerKind, PendingModel, RunModel, State
from .cells import engine
from .describe import RankInfo, hugepages_of, new_cluster_id, nodes_of, owner_of
from .elastic.members import ElasticMembers
from .launch.mpi import MPIInfo
from .launch.profiles import LOCAL, Profile, mpi_for
from .private import private_ipython_profile
from .processes.deaths import death_report, engine_output, ranks_text
from .processes.rankwrap import LAUNCHED_BY_ENV
from .processes.teardown import stop_processes
from .processes.tree import (
    CLUSTER_ID_ENV,
    alive,
    descendants,
    kill,
    marked_processes,
    process_tree,
    shared_memory_files,
)

__all__ = ["RankInfo", "Event", "Subscriber", "TacoCluster", "clusters", "stop_all", "exiting"]

log = logging.getLogger("taco_notebook")

PROFILE = "taco"  # the IPython profile (directory) ipyparallel keeps its files in; not the launch profile


Event = Literal["starting", "running", "stopping", "stopped", "broken", "run"]
Subscriber = Callable[["TacoCluster", Event], None]
EXIT_WAIT_S = 30.0  # at exit, how long a stop/scale that the registry's watcher is carrying out may go on
NO_ENGINES = "the engines' mpiexec exited; scale or delete the cluster"


class TacoCluster(ElasticMembers):
    """One named cluster of ``size`` MPI ranks.

    >>> c = TacoCluster("default", 4).start()
    >>> c.view.apply_sync(lambda: 1)
    [1, 1, 1, 1]
    >>> c.stop()

    ``busy`` is held while a cell runs (by the cell runner) and while the cluster restarts: the registry's
    watcher carries out the sidebar's stop/scale requests only when it can take it. ``cluster_id`` is set by
    the first start and kept by later ones (:meth:`scale`), so the registry entry keeps its id.

    Model state: ``error`` (why broken, or why its last action failed), ``pending`` (a stop or scale the server
    queued), ``run`` (:meth:`set_run`), ``processes`` (all it started: killed at stop even if orphaned by then)
    and ``shared_memory`` (the ranks' MPI segments in /dev/shm, removed at stop)."""

    owner_kind: OwnerKind = "kernel"  # the server extension sets "server" on its own clusters
    cluster_id: str | None = None

    def __init__(self, name: str = "default", size: int = 4, mpiexec: str | None = None,
                 start_timeout: float = 120.0, env: dict[str, str] | None = None,
                 profile: Profile | None = None) -> None:
        if size <= 0:
            raise ValueError(f"size must be a positive integer, got {size}")
        self.profile = profile or LOCAL  # where the engines run (cluster/launch/profiles.py)
        self._engines: Any = "mpi"  # ipp.Cluster's engines: "mpi", or the slurm profile's launcher class
        self.profile.check_size(size)
        self.name = name
        self.size = size
        self.mpiexec = mpiexec
        self.start_timeout = start_timeout
        self.env = dict(env or {})
        self.mpi: MPIInfo | None = None
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
        self._engine_logs: list[str] = []  # ipyparallel forgets a stopped engine set, and with it its log's path
        self._engine_launchers: list[Any] = []  # ...and deletes the log when mpiexec exits, keeping its text
        self.busy = threading.RLock()
        self.progress: Callable[[str], None] | None = None  # the slurm profile's queue-state lines go here
        self.elastic: Any = None  # cluster/elastic/membership.py's Membership once an --elastic cell ran here

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
        """The cluster as the registry, the REST API and the sidebar show it. Reads plain attributes only (and
        the engines' liveness): safe from any thread. ``this_server`` is False; the server sets it when serving."""
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

    # ---------------------------------------------------------------- lifecycle
    def announce_start(self) -> None:
        """Show it ``starting`` now, for a :meth:`start` queued to another thread (the server's manager)."""
        self._phase = "starting"
        self._emit("starting")

    def _engine_environment(self) -> dict[str, str]:
        env = {"TACO_CLUSTER_NAME": self.name, "PYTHONUNBUFFERED": "1"}
        if "OMP_NUM_THREADS" not in os.environ:
            # N ranks on one machine share its cores; torch would otherwise start cores-many threads per rank.
            per_node = self.profile.ranks_per_node(self.size)
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // per_node))
        env.update(self.profile.environment)  # hosts: the nodes' interface for gloo and UCX
        # every rank on this host (local profile): MPI stays off the network unless the user chose
        if self.mpi is not None and self.profile.single_host:
            from .launch.mpi import single_host_env

            env.update({k: v for k, v in single_host_env(self.mpi).items() if k not in os.environ})
            if self.mpi.launcher == "gforker":  # rankwrap gives the ranks what hydra would (see there)
                env[LAUNCHED_BY_ENV] = "gforker"
        env.update(self.env)
        if self.cluster_id:  # the proof that a process is this cluster's (processes.proven_process)
            env[CLUSTER_ID_ENV] = self.cluster_id
        return env

    def _ipp_config(self, mpi: MPIInfo) -> Any:
        from traitlets.config import Config

        config, self._engines = Config(), "mpi"
        launcher = config.MPIEngineSetLauncher
        launcher.mpi_cmd = [mpi.mpiexec]
        launcher.mpi_args = list(mpi.extra_args) + self.profile.mpiexec_args()
        launcher.engine_cmd = [sys.executable, "-m", "taco_notebook.cluster.processes.rankwrap",
                               sys.executable, "-m", "ipyparallel.engine"]
        launcher.environment = {**mpi.environment, **self._engine_environment()}  # mpi4py loads mpiexec's MPI
        if self.profile.slurm is not None:  # the engines as a Slurm job: slurm_launchers' class and section
            from .launch.slurm.engines import engine_config

            self._engines = engine_config(config, self.profile.slurm, launcher.engine_cmd, launcher.environment,
                                          self.progress)
        if self.cluster_id:
            config.LocalControllerLauncher.environment = {CLUSTER_ID_ENV: self.cluster_id}
        return config

    def start(self) -> TacoCluster:
        """Start controller and ``size`` engines, check them, and bring up the process group on every rank.

        Emits ``starting``, then ``running`` (failing: ``stopping``/``stopped``, and raises). ipyparallel's exit
        hook is off for it (``shutdown_atexit=False``): this module's one hook stops it fast, where ipyparallel's
        (registered at its first start, so run before ours) would first stop it slowly.
        """
        import ipyparallel as ipp

        self.mpi = mpi_for(self.profile, self.mpi, self.mpiexec)
        cluster_id = self.cluster_id = self.cluster_id or new_cluster_id(self.name)
        self.error, self._phase, _live[cluster_id] = None, "starting", self
        self._emit("starting")
        try:
            private_ipython_profile(PROFILE)  # 0700 before ipyparallel makes it (and its logs) under the umask
            config = self._ipp_config(self.mpi)
            self.ipp_cluster = ipp.Cluster(engines=self._engines, n=self.size, profile=PROFILE, config=config,
                                           controller_ip=self.profile.controller_ip, log_level=logging.ERROR,
                                           shutdown_atexit=False, cluster_id=cluster_id)
            self.ipp_cluster.start_cluster_sync()
            self.refresh_engine_sets()
            self.client = self.ipp_cluster.connect_client_sync()
            self._wait_for_engines()
            self.check_ranks()
            self.view.apply_sync(engine.setup_namespace)  # `taco`, the process group, the metrics flush
        except BaseException as exc:
            output = self.engine_output()
            self._phase = None
            self.stop()
            if isinstance(exc, ClusterStartError | KeyboardInterrupt):
                raise
            tail = "\n".join(output.strip().splitlines()[-15:])
            raise ClusterStartError(f"cluster {self.name!r} failed to start: {exc}\n{tail}") from exc
        self.started_at, self.needs_reinit = time.time(), False
        self.processes = process_tree(self.ipp_cluster)  # killed at stop even if orphaned by then
        self.shared_memory, self._phase = shared_memory_files(self.ranks), None
        self._emit("running")
        return self

    def _wait_for_engines(self) -> None:
        # interactive=False: ipyparallel's tqdm bar ("0%| | 0/4 [engine/s]") is updated from its IO thread and
        # stayed stuck in the notebook; the magic says "ready in … s" itself.
        if self.profile.slurm is not None:  # as long as the queue holds the job, then start_timeout
            from .launch.slurm.engines import wait

            return wait(self.client, self._engine_launchers[0], self.size, self.start_timeout)
        future = self.client.wait_for_engines(self.size, block=False, timeout=self.start_timeout, interactive=False)
        while not future.done() or future.exception() is not None:  # ipyparallel may see the engines go first
            death = self.death()
            if death is not None:
                raise ClusterStartError(f"cluster {self.name!r} failed to start: {death}\n"
                                        + "\n".join(self.engine_output().strip().splitlines()[-15:]))
            if future.done():
                break
            time.sleep(0.1)
        future.result()

    def check_ranks(self) -> None:
        """Read every engine's :class:`RankInfo` into :attr:`ranks`; fails unless engine ids are MPI ranks."""
        try:
            infos = self.client[:].apply_sync(engine.rank_info)
        except Exception as exc:  # the ranks' MPI check: say what it said, not "engine ids differ"
            from ..comm.mpicheck import mismatch_in

            if (mismatch := mismatch_in(exc)) is not None:
                raise ClusterStartError(f"cluster {self.name!r} failed to start: {mismatch}") from None
            raise
        self.ranks = sorted(map(RankInfo.of_engine, self.client.ids, infos), key=lambda r: r.rank)
        mismatched = [(eid, info["rank"]) for eid, info in zip(self.client.ids, infos, strict=True)
                      if eid != info["rank"]]
        if mismatched:
            raise ClusterStartError(f"engine ids differ from MPI ranks: {mismatched}")

    def stop(self, fast: bool = False) -> None:
        """Stop engines and controller; leaves nothing running. Safe to call twice.

        Emits ``stopping`` (if it ran) and ``stopped``. ``fast`` (at interpreter exit) terminates the processes
        at once instead of asking them to exit.
        """
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
                self._emit("stopped")

    def scale(self, size: int) -> TacoCluster:
        """Restart with ``size`` ranks under the same name and registry id (an elastic cluster grows instead).

        An MPI job's world size is fixed at launch, so scaling is a stop and a start of a new ``size``-rank MPI
        job: what the engines held (variables, the process group) is lost. Holds :attr:`busy` meanwhile.
        """
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"size must be a positive integer, got {size!r}")
        if self.grows_elastically(size):  # the new engines join at the next commit, the survivors untouched
            return self
        with self.busy:
            self._stop(final=False)
            self.size = size
            return self.start()

    def _stop_processes(self, fast: bool = False) -> None:
        cluster, client = self.ipp_cluster, self.client
        self.ipp_cluster = self.client = None
        self.ranks, self.elastic = [], None
        if cluster is None:
            return
        tree, shared_memory = process_tree(cluster) + self.processes, self.shared_memory  # teardown adds the mapped
        self.processes, self.shared_memory = [], set()
        stop_processes(cluster, client, tree, shared_memory, fast)
        kill(marked_processes(self.cluster_id or ""))  # orphans the tree missed (a controller stopped mid-fork)

    # ---------------------------------------------------------------- engines
    @property
    def view(self) -> Any:
        if self.client is None:
            raise RuntimeError(f"cluster {self.name!r} is not running")
        return self.client[self.engine_ids()] if self.elastic is not None else self.client[:]

    def _engine_sets(self, cluster: Any = None) -> list[Any]:
        cluster = cluster or self.ipp_cluster
        return list(cluster.engines.values()) if cluster is not None else []

    def kill_engines(self, reason: str) -> None:
        """Kill the engines now (after a hung interrupt); the next run starts a fresh cluster."""
        if self.ipp_cluster is not None:
            engine_sets = [p for es in self._engine_sets() for p in descendants(getattr(es, "process", None))]
            controller = getattr(self.ipp_cluster.controller, "process", None)
            # No waiting: SIGKILL is certain, and Ctrl-C must return now; stop() reaps them later.
            kill(engine_sets + [p for p in self.processes if p not in descendants(controller)], wait=False)
        self.error = reason
        self._emit("broken")

    def engines_alive(self) -> bool:
        engine_sets = self._engine_sets()
        if self.profile.slurm is not None:  # no local process: the job's watcher says whether it ended
            from .launch.slurm.engines import job_alive

            return bool(engine_sets) and all(job_alive(es) for es in engine_sets)
        return bool(engine_sets) and all(alive(getattr(es, "process", None)) for es in engine_sets)

    def engine_output(self) -> str:
        """What mpiexec and the engines printed (the engine set's log)."""
        return engine_output(self.engine_log_paths(), self._engine_launchers)

    def death(self) -> str | None:
        """None while the engines run; otherwise a sentence saying which rank died, where and how."""
        if self.ipp_cluster is None or self.engines_alive():
            return None
        return death_report(self.engine_output)[0]

    def died_error(self, finished: list[int]) -> RankDiedError:
        sentence, rank, host, sig = death_report(self.engine_output)
        others = [r.rank for r in self.ranks if r.rank != rank and r.rank not in finished]
        detail = f"; MPI stopped the other ranks ({ranks_text(others)})" if others else ""
        return RankDiedError(
            f"{sentence}{detail}. Cluster {self.name!r} was shut down; the next %%taco_run starts a fresh one.",
            rank, host, sig)


clusters: dict[str, TacoCluster] = {}


_live: dict[str, TacoCluster] = {}  # every cluster this process started and has not stopped, by id
exiting = threading.Event()  # set first thing at exit: the registry's watcher takes no more requests


def stop_all(fast: bool = False) -> None:
    """Stop every cluster this kernel started and named in :data:`clusters`."""
    for name in list(clusters):
        clusters.pop(name).stop(fast=fast)


def _stop_at_exit() -> None:
    """The process's one exit hook: stop every cluster it started (kernel's or server's), fast.

    Registered once, at import. ipyparallel's own hook is off for our clusters (``shutdown_atexit=False``): its
    stop (~5 s) would run first and outlast a kernel's grace at shutdown, leaving registry entries shown as stale.
    Each cluster stops under its ``busy`` lock, so a stop/scale the registry's watcher is carrying out finishes
    first (up to :data:`EXIT_WAIT_S`); ``exiting`` stops the watcher from taking another.
    """
    exiting.set()
    owned = {id(c): c for c in [*clusters.values(), *_live.values()]}
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
