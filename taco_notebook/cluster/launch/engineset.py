"""How a :class:`~taco_notebook.cluster.session.TacoCluster` launches its engines and reads their sets: the
environment every rank gets, ipyparallel's config for the MPI engine set (or the slurm profile's launcher), the
wait for them to register, and the sets' logs, processes and liveness. Functions of what they are handed, so
session.py keeps only the cluster's state and lifecycle.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from ...engine import calls
from ...engine.rankwrap import LAUNCHED_BY_ENV
from ...errors import ClusterStartError
from ...ipp.signals import NO_NANNY
from ..describe import RankInfo
from ..processes.tree import CLUSTER_ID_ENV, alive, descendants
from .mpi import MPIInfo, single_host_env
from .profiles import Profile

__all__ = ["engine_environment", "ipp_config", "CONTROLLER_CMD", "controller_args", "check_open_files",
           "registration_timeout", "start_timeout", "wait_for_engines", "read_ranks", "engine_sets", "log_paths",
           "set_processes", "sets_alive"]

PROGRESS_EVERY_S = 30.0  # a start still waiting for engines says how many registered, this often


def engine_environment(name: str, size: int, profile: Profile, mpi: MPIInfo | None, env: Mapping[str, str],
                       cluster_id: str | None) -> dict[str, str]:
    """What every engine of cluster ``name`` finds in its environment, the user's ``env`` last (it wins)."""
    environment = {"TACO_CLUSTER_NAME": name, "PYTHONUNBUFFERED": "1"}
    if "OMP_NUM_THREADS" not in os.environ:
        # N ranks on one machine share its cores; torch would otherwise start cores-many threads per rank.
        per_node = profile.ranks_per_node(size)
        environment["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // per_node))
    environment.update(profile.environment)  # hosts: the nodes' interface for gloo and UCX
    # every rank on this host (local profile): MPI stays off the network unless the user chose
    if mpi is not None and profile.single_host:
        environment.update({k: v for k, v in single_host_env(mpi).items() if k not in os.environ})
        if mpi.launcher == "gforker":  # rankwrap gives the ranks what hydra would (see there)
            environment[LAUNCHED_BY_ENV] = "gforker"
    environment.update(env)
    if cluster_id:  # the proof that a process is this cluster's (processes.proven_process)
        environment[CLUSTER_ID_ENV] = cluster_id
    return environment


def ipp_config(name: str, size: int, profile: Profile, mpi: MPIInfo, env: Mapping[str, str], cluster_id: str | None,
               progress: Callable[[str], None] | None) -> tuple[Any, Any]:
    """``(config, engines)`` for ``ipp.Cluster`` to start cluster ``name``'s ``size`` engines with
    :func:`engine_environment`: engines is ``"mpi"``, or the slurm profile's launcher class. Raises
    :class:`ClusterStartError` first if this host cannot hold their connections (:func:`check_open_files`)."""
    from traitlets.config import Config

    check_open_files(size)
    config = Config()
    engines: Any = "mpi"
    launcher = config.MPIEngineSetLauncher
    launcher.mpi_cmd = [mpi.mpiexec]
    launcher.mpi_args = list(mpi.extra_args) + profile.mpiexec_args()
    launcher.engine_cmd = [sys.executable, "-m", "taco_notebook.engine.rankwrap",
                           sys.executable, "-m", "ipyparallel.engine"]
    environment = engine_environment(name, size, profile, mpi, env, cluster_id)
    launcher.environment = {**mpi.environment, **environment}  # mpi4py loads mpiexec's MPI
    per_host = profile.ranks_per_node(size)
    launcher.engine_args = [f"--IPEngine.timeout={registration_timeout(size, per_host):g}", NO_NANNY]
    if profile.slurm is not None:  # the engines as a Slurm job: slurm_launchers' class and section
        from .slurm.engines import engine_config

        engine_cmd = [*launcher.engine_cmd, *launcher.engine_args]  # its launcher reads no engine_args
        engines = engine_config(config, profile.slurm, engine_cmd, launcher.environment, progress)
    config.LocalControllerLauncher.controller_cmd = CONTROLLER_CMD
    if cluster_id:
        config.LocalControllerLauncher.environment = {CLUSTER_ID_ENV: cluster_id}
    return config, engines


# ipyparallel's controller with a hub that reads only what it acts on (ipp/hub.py); controller_args is its line
CONTROLLER_CMD = [sys.executable, "-m", "taco_notebook.controller"]


def registration_timeout(size: int, per_host: int | None = None, cores: int | None = None) -> float:
    """Seconds an engine waits for the controller to answer its registration (ipyparallel's default: 5 s).

    The controller answers the engines one after the other while the engines still starting on its host take
    their share of its cores, so the last of many waits for all the others, slowed by that load: 5 s plus 20 ms
    per engine, times the engines per core on the busiest host (``per_host``, default all of them, over this
    host's ``cores``; a factor of at least 1).

    >>> registration_timeout(4, cores=16), registration_timeout(1000, 125, 16), registration_timeout(256, cores=2)
    (5.08, 161.25, 660.36)
    """
    load = max(1.0, (per_host or size) / (cores or os.cpu_count() or 1))
    return round(5.0 + 0.02 * size * load, 2)


def start_timeout(size: int, per_host: int | None = None, cores: int | None = None) -> float:
    """Seconds a start waits for every engine to register: two minutes for the processes to start, plus as
    long as the last engine may wait for its answer (:func:`registration_timeout`), so that a start under load
    never gives up on engines that are still legitimately waiting.

    >>> start_timeout(4, cores=16), start_timeout(256, cores=2)
    (125.08, 780.36)
    """
    return round(120.0 + registration_timeout(size, per_host, cores), 2)


def controller_args(size: int, per_host: int | None = None) -> list[str]:
    """The controller's command line for ``size`` engines, ``per_host`` on the busiest host
    (``ipp.Cluster(controller_args=)``): the controller is a process of its own, which reads its settings from
    its command line and its profile, never from the ``Config`` handed to ``ipp.Cluster`` (a
    ``HeartMonitor.period`` put there leaves it beating every 3 s).

    * ``HeartMonitor.period``: :func:`heartbeat_ms`. The controller pings every engine each period; at
      hundreds of engines a longer one (a dead rank is seen by mpiexec and the wrapper, not by the heartbeat).
    * ``registration_timeout``: how long the hub keeps an answered registration waiting for the engine's first
      heartbeat before it drops it (ipyparallel's default: 30 s, or ten periods): the engine's
      :func:`registration_timeout`, at least that. With hundreds of engines starting on a few cores, the time
      between an engine's answer and its first beat can pass the default; a dropped engine, alive and sure it
      is registered, never joins.
    * ``db_class=NoDB``: ipyparallel 9's default ``DictDB`` keeps every request, reply (its result buffers)
      and output in the controller's memory, up to 1 GiB, and rebuilds a rank's stdout by string concatenation
      on every write; taco never reads it back (no ``db_query``, ``get_result`` or resubmission).
    * the controller's logger at ERROR: traitlets sets the application's logger to DEBUG and filters at the
      handler, so every message the hub forwards would build log records, and it would write a line per request
      and reply (INFO) and per dashboard payload (a WARNING: the hub does not know ipyparallel's own
      ``data_message``) to its log file, without end. Errors are still logged.

    >>> controller_args(16, 1)[:2]
    ['--HeartMonitor.period=3000', '--IPController.registration_timeout=30']
    >>> controller_args(1000, 1)[:2]
    ['--HeartMonitor.period=30000', '--IPController.registration_timeout=300']
    """
    quiet = {name: {"level": "ERROR"} for name in ("TacoController", "IPController")}  # the logger is the app's class
    period = heartbeat_ms(size)
    registration = max(30, period // 100, math.ceil(registration_timeout(size, per_host)))
    return [f"--HeartMonitor.period={period}", f"--IPController.registration_timeout={registration}",
            "--IPController.db_class=NoDB", f"--IPController.logging_config={json.dumps({'loggers': quiet})}"]


def check_open_files(size: int) -> None:
    """Refuse, before anything starts, a cluster of ``size`` engines that this host's hard limit of open files
    cannot hold in the controller: its busiest process holds about two descriptors per engine, and the
    controller raises its soft limit up to the hard one (:func:`taco_notebook.controller.raise_open_files_limit`)
    but no higher. Past the limit registration would stall with the engines waiting and the controller unable to
    accept them."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    need = 2 * size + 256
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ClusterStartError(
            f"{size} ranks need about {need} open files in the controller (two per rank), but this host's hard "
            f"limit is {hard}: raise it (`ulimit -Hn {need}` before starting Jupyter, or `nofile` in "
            "/etc/security/limits.conf) or start fewer ranks; nothing was started")


def heartbeat_ms(size: int) -> int:
    """The controller's heartbeat period (ipyparallel's default: 3,000 ms), longer past 100 engines so that the
    pings cost the controller about as much at 1,000 engines as at 100.

    >>> heartbeat_ms(16), heartbeat_ms(1000)
    (3000, 30000)
    """
    return max(3000, 30 * size)


def planned_hosts(profile: Profile, size: int) -> list[str]:
    """The host each rank is placed on, in rank order: the profile's hosts filled slot by slot (mpich's hydra
    with ``-hosts h:slots``); this host's name for the local profile.

    >>> from .profiles import Profile
    >>> planned_hosts(Profile("hosts", (("n0", 2), ("n1", 2))), 3)
    ['n0', 'n0', 'n1']
    """
    import socket

    if not profile.hosts:
        return [socket.gethostname()] * size
    order = [host for host, slots in profile.hosts for _ in range(slots)]
    return (order * (size // len(order) + 1))[:size]


def never_registered(client: Any, n: int, timeout: float, hosts: list[str] | None) -> str:
    """The sentence for a start whose engines did not all register in time: how many did, which ranks did not
    (an engine's id is its MPI rank) and on which hosts."""
    from ..cells.autopsy import rank_span

    missing = sorted(set(range(n)) - set(client.ids))
    where = ""
    if hosts:
        by_host: dict[str, list[int]] = {}
        for rank in missing:
            by_host.setdefault(hosts[rank] if rank < len(hosts) else "?", []).append(rank)
        where = " (" + "; ".join(f"{rank_span(ranks)} on {host}" for host, ranks in by_host.items()) + ")"
    return (f"{n - len(missing)} of {n} engines registered within {timeout:g} s; {rank_span(missing)} never "
            f"registered{where}")


def wait_for_engines(client: Any, n: int, timeout: float, failure: Callable[[], str | None], profile: Profile,
                     launchers: list[Any], progress: Callable[[str], None] | None = None) -> None:
    """Until ``n`` engines of ``profile`` (started by ``launchers``) registered, or a :class:`ClusterStartError`
    saying ``failure()`` (None while mpiexec runs) as soon as it says something, or a TimeoutError naming the
    ranks that never registered. A Slurm job's engines: as long as the queue holds the job, then timeout.
    Every :data:`PROGRESS_EVERY_S` of waiting, ``progress`` gets how many engines registered so far."""
    if profile.slurm is not None:
        from .slurm.engines import wait

        return wait(client, launchers[0], n, timeout)
    # interactive=False: ipyparallel's tqdm bar ("0%| | 0/4 [engine/s]") is updated from its IO thread and
    # would stay stuck in the notebook; the magic says "ready in … s" itself.
    began = time.monotonic()
    said = began
    future = client.wait_for_engines(n, block=False, timeout=timeout, interactive=False)
    while not future.done() or future.exception() is not None:  # ipyparallel may see the engines go first
        why = failure()
        if why is not None:
            raise ClusterStartError(why)
        if future.done():
            break
        now = time.monotonic()
        if progress is not None and now - said >= PROGRESS_EVERY_S:
            said = now
            progress(f"{len(client.ids)} of {n} engines registered after {now - began:.0f} s")
        time.sleep(0.1)
    try:
        future.result()
    except TimeoutError:  # the caller adds the engines' last lines (TacoCluster._failed)
        raise TimeoutError(never_registered(client, n, timeout, planned_hosts(profile, n))) from None


def read_ranks(client: Any, name: str) -> list[RankInfo]:
    """Every engine's :class:`RankInfo` in rank order, as cluster ``name`` starts: a ClusterStartError unless each
    engine id is its MPI rank, or when the ranks' MPI check failed (saying what it said)."""
    try:
        infos = client[:].apply_sync(calls.rank_info)
    except Exception as exc:  # the ranks' MPI check: say what it said, not "engine ids differ"
        from ...comm.group.mpicheck import mismatch_in

        if (mismatch := mismatch_in(exc)) is not None:
            raise ClusterStartError(f"cluster {name!r} failed to start: {mismatch}") from None
        raise
    mismatched = [(eid, info["rank"]) for eid, info in zip(client.ids, infos, strict=True) if eid != info["rank"]]
    if mismatched:
        raise ClusterStartError(f"engine ids differ from MPI ranks: {mismatched}")
    return sorted(map(RankInfo.of_engine, client.ids, infos), key=lambda r: r.rank)


def engine_sets(ipp_cluster: Any) -> list[Any]:
    """The engine set launchers of a started ``ipp.Cluster`` (none for None)."""
    return list(ipp_cluster.engines.values()) if ipp_cluster is not None else []


def log_paths(sets: list[Any]) -> list[str]:
    """The sets' logs, where mpiexec gathers what the ranks and their wrappers print."""
    return [es.output_file for es in sets if getattr(es, "output_file", None)]


def set_processes(sets: list[Any]) -> list[Any]:
    """The local processes of the sets (mpiexec, wrappers, engines): proven ours, as psutil.Process."""
    return [p for es in sets for p in descendants(getattr(es, "process", None))]


def sets_alive(sets: list[Any], slurm: bool) -> bool:
    """Whether every set still runs: its mpiexec lives, or (``slurm``: no local process) its job's watcher says so."""
    if slurm:
        from .slurm.engines import job_alive

        return bool(sets) and all(job_alive(es) for es in sets)
    return bool(sets) and all(alive(getattr(es, "process", None)) for es in sets)


class StartedSets:
    """The engine sets a cluster started, and their logs' paths, remembered: ipyparallel forgets a stopped set
    (and with it its log's path), and deletes the log when mpiexec exits, keeping its text on the launcher."""

    def __init__(self) -> None:
        self.launchers: list[Any] = []
        self.logs: list[str] = []

    def refresh(self, ipp_cluster: Any) -> None:
        """Read them again (at start, and when an elastic cluster grows)."""
        self.launchers = engine_sets(ipp_cluster)
        self.logs = log_paths(self.launchers)

    def log_paths(self, ipp_cluster: Any) -> list[str]:
        """The logs remembered, else those of ``ipp_cluster``'s engine sets now."""
        return self.logs or log_paths(engine_sets(ipp_cluster))
