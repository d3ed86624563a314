"""TacoCluster: an ipyparallel cluster whose engines are MPI ranks, owned by the notebook kernel.

Wraps ``ipyparallel.Cluster(engines="mpi")`` (process management is ipyparallel's), and adds what a training
user needs on top: engine id checked against MPI rank, each rank's host and pid, the MPI implementation, a
torch process group brought up on start, and a liveness check that says which rank died and how.

Clusters are kept by name in :data:`clusters`; the kernel owns membership (``-np``), not the engines.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..errors import ClusterStartError, RankDiedError
from . import engine
from .mpi import MPIInfo, find_mpi, for_one_host
from .private import private_ipython_profile
from .processes import CLUSTER_ID_ENV, alive, descendants, kill, process_tree, shared_memory_files, stop_at_exit
from .rankwrap import LAUNCHED_BY_ENV, MARKER

__all__ = ["RankInfo", "ClusterStatus", "TacoCluster", "clusters", "stop_all"]

log = logging.getLogger("taco_notebook")

PROFILE = "taco"


@dataclass(frozen=True)
class RankInfo:
    """One engine: its MPI rank (= engine id), where it runs, its placement, and what its host offers.

    ``gpus``: NVIDIA GPUs the rank can see (``CUDA_VISIBLE_DEVICES`` applied); ``hugepages``: its host's
    ``/proc/meminfo`` huge pages as ``{"total", "free", "page_kb"}``, or None where the kernel has none.
    """

    rank: int
    host: str
    pid: int
    local_rank: int
    node: int
    gpus: int = 0
    hugepages: dict[str, int] | None = field(default=None, compare=False)
    gpu_names: list[str] = field(default_factory=list, compare=False)  # models of those GPUs, from /proc


@dataclass
class ClusterStatus:
    """A snapshot of one cluster, the shape shown by ``%taco_cluster status`` and written to JSON."""

    name: str
    cluster_id: str
    state: str  # "stopped", "running", "broken"
    size: int
    engines_up: int
    mpi: str
    ranks: list[RankInfo] = field(default_factory=list)
    started_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def hosts(self) -> list[str]:
        return sorted({r.host for r in self.ranks})

    @property
    def gpus(self) -> int:
        """GPUs over all nodes (the ranks of a node see the same devices)."""
        per_node: dict[int, int] = {}
        for r in self.ranks:
            per_node[r.node] = max(per_node.get(r.node, 0), r.gpus)
        return sum(per_node.values())


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class TacoCluster:
    """One named cluster of ``size`` MPI ranks.

    >>> c = TacoCluster("default", 4).start()
    >>> c.view.apply_sync(lambda: 1)
    [1, 1, 1, 1]
    >>> c.stop()

    ``busy`` is held while a cell runs (by the cell runner) and while the cluster restarts: the registry's
    watcher carries out the sidebar's stop/scale requests only when it can take it. ``cluster_id`` is set by
    the first start and kept by later ones (:meth:`scale`), so the registry entry keeps its id.
    """

    owner_kind: Literal["kernel", "server"] = "kernel"  # the server extension sets "server" on its own clusters
    cluster_id: str | None = None

    def __init__(self, name: str = "default", size: int = 4, mpiexec: str | None = None,
                 start_timeout: float = 120.0, env: dict[str, str] | None = None) -> None:
        if size <= 0:
            raise ValueError(f"size must be a positive integer, got {size}")
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
        self.broken_reason: str | None = None
        self.needs_reinit = False
        self._started_processes: list[Any] = []
        self._shared_memory: set[str] = set()  # MPI's /dev/shm segments: a killed rank leaves them behind
        self._engine_logs: list[str] = []  # ipyparallel forgets a stopped engine set, and with it its log's path
        self._engine_launchers: list[Any] = []  # ...and deletes the log when mpiexec exits, keeping its text
        self.busy = threading.RLock()

    # ---------------------------------------------------------------- lifecycle
    @property
    def running(self) -> bool:
        return self.ipp_cluster is not None and self.broken_reason is None

    def _engine_environment(self) -> dict[str, str]:
        env = {"TACO_CLUSTER_NAME": self.name, "PYTHONUNBUFFERED": "1"}
        if "OMP_NUM_THREADS" not in os.environ:
            # N ranks on one machine share its cores; torch would otherwise start cores-many threads per rank.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.size))
        if self.mpi is not None:  # every rank on this host: MPI stays off the network unless the user chose
            from .mpi import single_host_env

            env.update({k: v for k, v in single_host_env(self.mpi).items() if k not in os.environ})
            if self.mpi.launcher == "gforker":  # rankwrap gives the ranks what hydra would (see there)
                env[LAUNCHED_BY_ENV] = "gforker"
        env.update(self.env)
        if self.cluster_id:  # the proof that a process is this cluster's (processes.proven_process)
            env[CLUSTER_ID_ENV] = self.cluster_id
        return env

    def _ipp_config(self, mpi: MPIInfo) -> Any:
        from traitlets.config import Config

        config = Config()
        launcher = config.MPIEngineSetLauncher
        launcher.mpi_cmd = [mpi.mpiexec]
        launcher.mpi_args = list(mpi.extra_args)
        launcher.engine_cmd = [sys.executable, "-m", "taco_notebook.cluster.rankwrap",
                               sys.executable, "-m", "ipyparallel.engine"]
        launcher.environment = {**mpi.environment, **self._engine_environment()}  # mpi4py loads mpiexec's MPI
        if self.cluster_id:
            config.LocalControllerLauncher.environment = {CLUSTER_ID_ENV: self.cluster_id}
        return config

    def start(self) -> TacoCluster:
        """Start controller and ``size`` engines, check them, and bring up the process group on every rank.

        Publishes the cluster to the registry (``starting``, then ``running``) for the Jupyter sidebar.
        """
        import ipyparallel as ipp

        from . import registry

        explicit = self.mpiexec is not None  # --mpiexec PATH: exactly that program
        self.mpi = for_one_host(self.mpi, explicit) if self.mpi else find_mpi(self.mpiexec, single_host=True)
        cluster_id = self.cluster_id = self.cluster_id or f"{self.name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.broken_reason = None
        registry.publish(self, "starting")
        private_ipython_profile(PROFILE)  # 0700 before ipyparallel makes it (and its logs) under the umask
        self.ipp_cluster = ipp.Cluster(engines="mpi", n=self.size, profile=PROFILE, cluster_id=cluster_id,
                                       controller_ip="127.0.0.1", log_level=logging.ERROR,
                                       config=self._ipp_config(self.mpi))
        try:
            self.ipp_cluster.start_cluster_sync()
            self._engine_launchers = self._engine_sets()
            self._engine_logs = [es.output_file for es in self._engine_launchers if getattr(es, "output_file", None)]
            self.client = self.ipp_cluster.connect_client_sync()
            self._wait_for_engines()
            self.check_ranks()
            self.view.apply_sync(engine.setup_namespace)  # `taco`, the process group, the metrics flush
        except BaseException as exc:
            output = self.engine_output()
            self.stop()
            if isinstance(exc, ClusterStartError | KeyboardInterrupt):
                raise
            tail = "\n".join(output.strip().splitlines()[-15:])
            raise ClusterStartError(f"cluster {self.name!r} failed to start: {exc}\n{tail}") from exc
        self.started_at = time.time()
        self.needs_reinit = False
        self._started_processes = process_tree(self.ipp_cluster)  # killed at stop even if orphaned by then
        self._shared_memory = shared_memory_files(self.ranks)
        registry.publish(self, "running")
        return self

    def _wait_for_engines(self) -> None:
        # interactive=False: ipyparallel's tqdm bar ("0%| | 0/4 [engine/s]") is updated from its IO thread and
        # stayed stuck in the notebook; the magic says "ready in … s" itself.
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
        self.ranks = sorted((RankInfo(**info) for info in infos), key=lambda r: r.rank)
        mismatched = [(eid, info["rank"]) for eid, info in zip(self.client.ids, infos, strict=True)
                      if eid != info["rank"]]
        if mismatched:
            raise ClusterStartError(f"engine ids differ from MPI ranks: {mismatched}")

    def stop(self, unpublish: bool = True, fast: bool = False) -> None:
        """Stop engines and controller; leaves nothing running. Safe to call twice.

        Removes the registry entry, unless ``unpublish`` is False (a restart under the same id: :meth:`scale`).
        ``fast`` (at interpreter exit) terminates the processes at once instead of asking them to exit.
        """
        from . import registry

        if self.ipp_cluster is not None and self.cluster_id and not fast:
            registry.publish(self, "stopping")
        try:
            self._stop_processes(fast)
        finally:
            if unpublish:
                registry.remove(self)

    def scale(self, size: int) -> TacoCluster:
        """Restart with ``size`` ranks under the same name and registry id.

        An MPI job's world size is fixed at launch, so scaling is a stop and a start of a new ``size``-rank MPI
        job: what the engines held (variables, the process group) is lost. Holds :attr:`busy` meanwhile.
        """
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"size must be a positive integer, got {size!r}")
        with self.busy:
            self.stop(unpublish=False)
            self.size = size
            return self.start()

    def _stop_processes(self, fast: bool = False) -> None:
        cluster, client = self.ipp_cluster, self.client
        self.ipp_cluster = self.client = None
        if cluster is not None:  # segments MPI made after start too: the ranks still map them now
            self._shared_memory |= shared_memory_files(self.ranks)
        self.ranks = []
        if cluster is None:
            return
        tree = process_tree(cluster) + self._started_processes
        self._started_processes = []
        try:
            if fast:
                self._unlink_shared_memory()  # first: the ranks keep their mappings, the names go now
                stop_at_exit(cluster, client, tree)
                return
            if client is not None:
                self._shutdown_engines(client, cluster)
                client.close()
            # Engines first, then the controller: stopped together (stop_cluster) they take ~5 s, not ~1.3 s.
            cluster.stop_engines_sync()  # graceful: mpiexec forwards SIGTERM to every rank
            cluster.stop_controller_sync()
        finally:
            kill(tree)  # whatever ignored it (a rank stuck in C code, an orphaned nanny)
            self._unlink_shared_memory()

    def _unlink_shared_memory(self) -> None:
        for path in self._shared_memory:
            try:
                os.unlink(path)
            except FileNotFoundError:  # MPI removed it on the way out
                pass
        self._shared_memory = set()

    @staticmethod
    def _shutdown_engines(client: Any, cluster: Any, grace: float = 3.0) -> None:
        """Ask idle engines to exit cleanly, so mpiexec ends by itself instead of being TERMed and KILLed."""
        try:
            client.shutdown(targets="all", block=False)
        except Exception:  # no engines registered any more: nothing to ask
            return
        deadline = time.monotonic() + grace
        launchers = list(cluster.engines.values())
        while time.monotonic() < deadline and any(alive(getattr(es, "process", None)) for es in launchers):
            time.sleep(0.05)

    # ---------------------------------------------------------------- engines
    @property
    def view(self) -> Any:
        if self.client is None:
            raise RuntimeError(f"cluster {self.name!r} is not running")
        return self.client[:]

    def _engine_sets(self, cluster: Any = None) -> list[Any]:
        cluster = cluster or self.ipp_cluster
        return list(cluster.engines.values()) if cluster is not None else []

    def kill_engines(self, reason: str) -> None:
        """Kill the engines now (after a hung interrupt); the next run starts a fresh cluster."""
        if self.ipp_cluster is not None:
            engine_sets = [p for es in self._engine_sets() for p in descendants(getattr(es, "process", None))]
            controller = getattr(self.ipp_cluster.controller, "process", None)
            # No waiting: SIGKILL is certain, and Ctrl-C must return now; stop() reaps them later.
            kill(engine_sets + [p for p in self._started_processes if p not in descendants(controller)],
                  wait=False)
        self.broken_reason = reason
        if self.cluster_id:
            from . import registry

            registry.publish(self)  # "broken", with the reason, for the sidebar

    def engines_alive(self) -> bool:
        engine_sets = self._engine_sets()
        return bool(engine_sets) and all(alive(getattr(es, "process", None)) for es in engine_sets)

    def engine_output(self) -> str:
        """What mpiexec and the engines printed (the engine set's log)."""
        chunks = []
        paths = self._engine_logs or [es.output_file for es in self._engine_sets() if getattr(es, "output_file", None)]
        launchers = {getattr(es, "output_file", None): es for es in self._engine_launchers}
        for path in paths:
            try:
                with open(path, errors="replace") as f:
                    chunks.append(f.read())
            except OSError:  # removed by ipyparallel's on-stop logging, which read it first: ask the launcher
                if path in launchers:
                    chunks.append(launchers[path].get_output())
        return "".join(chunks)

    def death(self) -> str | None:
        """None while the engines run; otherwise a sentence saying which rank died, where and how."""
        if self.ipp_cluster is None or self.engines_alive():
            return None
        report = self._death_report()
        return report[0]

    def _death_report(self) -> tuple[str, int | None, str | None, str | None]:
        pattern = re.compile(MARKER + r" rank=(\S+) host=(\S+) pid=(\d+) (signal|exitcode)=(-?\d+)")
        deadline = time.monotonic() + 3.0  # mpiexec flushes the wrapper's line into the log late on a busy machine
        while (match := pattern.search(self.engine_output())) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if match is None:
            return ("the engines' mpiexec exited unexpectedly", None, None, None)
        rank_text, host, pid, kind, value = match.groups()
        rank = int(rank_text) if rank_text.isdigit() else None
        how = f"killed by {_signal_name(int(value))}" if kind == "signal" else f"exited with code {value}"
        if kind == "signal" and int(value) == signal.SIGKILL:
            how += " (killed from outside, or out of memory)"
        return (f"rank {rank_text} (host {host}, pid {pid}) {how}", rank, host,
                _signal_name(int(value)) if kind == "signal" else None)

    def died_error(self, finished: list[int]) -> RankDiedError:
        sentence, rank, host, sig = self._death_report()
        others = [r.rank for r in self.ranks if r.rank != rank and r.rank not in finished]
        detail = f"; MPI stopped the other ranks ({_ranks_text(others)})" if others else ""
        return RankDiedError(
            f"{sentence}{detail}. Cluster {self.name!r} was shut down; the next %%taco_run starts a fresh one.",
            rank, host, sig)

    def status(self) -> ClusterStatus:
        up = len(self.client.ids) if self.client is not None else 0
        state = "broken" if self.broken_reason else ("running" if self.ipp_cluster is not None else "stopped")
        return ClusterStatus(
            name=self.name, cluster_id=self.ipp_cluster.cluster_id if self.ipp_cluster else "",
            state=state, size=self.size, engines_up=up,
            mpi=self.mpi.description if self.mpi else "", ranks=list(self.ranks), started_at=self.started_at)


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks)) if ranks else "none"


clusters: dict[str, TacoCluster] = {}


def stop_all(fast: bool = False) -> None:
    """Stop every cluster this kernel started (also run, ``fast``, at interpreter exit)."""
    for name in list(clusters):
        clusters.pop(name).stop(fast=fast)


atexit.register(stop_all, fast=True)
