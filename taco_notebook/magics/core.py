"""``%%taco_run`` runs a cell on every MPI rank; ``%taco_cluster`` starts, stops and inspects clusters.

Their defaults are :class:`TacoMagics`'s traits, then the environment (:mod:`.settings`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..cluster.mpi import LAUNCHER_ENV, MPIInfo, find_mpi, for_one_host
from ..cluster.profiles import LOCAL, Profile, profile_for
from ..cluster.registry_writer import track
from ..cluster.run import CellOptions, run_cell
from ..cluster.session import TacoCluster, clusters
from ..comm.specs import shm_from_env, timeout_from_env
from ..errors import MPINotFoundError
from .args import (
    DEFAULT_NP,
    cluster_args,
    cluster_settings,
    cluster_size,
    comm_settings,
    parse_targets,
    run_args,
    usage,
    usage_errors,
    wants_help,
)
from .output import RankOutput
from .settings import CLUSTER_ENV, TacoSettings, link_gbits_from_env

__all__ = ["TacoMagics", "ensure_cluster", "format_status"]

LOST = "the engines' variables are lost"  # said whenever a cluster is restarted under the user's feet


def _find_mpi(mpiexec: str | None, launcher: str | None) -> MPIInfo:
    """The MPI for a cluster on this host; ``launcher`` (``--mpi-launcher`` or its trait) in place of
    ``TACO_MPI_LAUNCHER`` when given."""
    if launcher is None:
        return find_mpi(mpiexec, single_host=True)
    return for_one_host(find_mpi(mpiexec), explicit=mpiexec is not None, environ={LAUNCHER_ENV: launcher})


def _profile(config: TacoSettings, args: Any, size: int) -> Profile:
    """``--profile/--hosts/--hostfile`` (else their traits) as a checked :class:`Profile` that fits ``size`` ranks.
    ``--hosts``/``--hostfile`` replace both traits; ``--profile local`` ignores the hosts traits."""
    with usage_errors():
        name = config.chosen("profile", args.profile, "--profile")
        if args.hosts is not None or args.hostfile is not None:
            hosts = config.chosen("hosts", args.hosts, "--hosts") if args.hosts is not None else None
            hostfile = args.hostfile
        elif args.profile == "local":
            hosts = hostfile = None
        else:
            hosts, hostfile = config.hosts, config.hostfile
        profile = profile_for(name, hosts, hostfile, controller_ip=config.controller_ip)
        profile.check_size(size)
    return profile


def _start(name: str, size: int, mpiexec: str | None, say: RankOutput, env: Mapping[str, str] | None = None,
           launcher: str | None = None, limit: int | None = None, profile: Profile = LOCAL) -> TacoCluster:
    cluster_size(str(size), "-np", limit)  # the limit, once more where every start goes through
    try:
        mpi = _find_mpi(mpiexec, launcher) if profile.single_host else find_mpi(mpiexec)
    except MPINotFoundError as exc:
        raise UsageError(str(exc)) from None
    # TacoCluster.start() picks the one-host launcher again from TACO_MPI_LAUNCHER unless its mpiexec was named:
    # a launcher chosen here names the program it resolved to (gforker is kept as it is)
    chosen = mpi.mpiexec if launcher is not None and mpi.launcher == "hydra" else mpiexec
    cluster = track(TacoCluster(name, size, mpiexec=chosen, env=dict(env or {}), profile=profile))  # sidebar lists it
    cluster.mpi = mpi
    cluster.progress = say.notice  # the slurm profile's job id and queue state
    say.notice(f"starting cluster {name!r}: {size} ranks with {mpi.description}…")
    began = time.monotonic()
    cluster.start()
    clusters[name] = cluster
    hosts = ", ".join(sorted({r.host for r in cluster.ranks}))
    say.notice(f"cluster {name!r} ready in {time.monotonic() - began:.1f} s: {size} ranks on {hosts}")
    return cluster


def _environment_default(key: str) -> str | None:
    """What the engines of a cluster started without ``key`` in its env read for it (the kernel's environment)."""
    if key == CLUSTER_ENV["gpus"]:
        return (os.environ.get(key) or "auto").strip().lower()
    if key == CLUSTER_ENV["shm"]:
        return "1" if shm_from_env() else "0"
    if key == CLUSTER_ENV["collective_timeout"]:
        return repr(timeout_from_env())
    return None


def _restart_reason(cluster: TacoCluster, env: Mapping[str, str]) -> str | None:
    """Why the running ``cluster`` cannot serve a cell that wants ``env`` in its engines' environment, if so."""
    for key, wanted in env.items():
        with usage_errors():
            current = cluster.env.get(key) or _environment_default(key)
        if current == wanted:
            continue
        if key == "LIGHT_INTRA_SIZE":
            return f"has another node layout; restarting it with --intra-size {wanted}"
        if key == CLUSTER_ENV["gpus"]:
            return f"places GPUs otherwise; restarting it with --gpus {wanted}"
        if key == CLUSTER_ENV["shm"]:
            return f"uses shared memory otherwise; restarting it with {'--shm' if wanted == '1' else '--no-shm'}"
        return f"has another collective timeout; restarting it with --collective-timeout {float(wanted):g}"
    return None


def ensure_cluster(name: str, size: int | None, mpiexec: str | None, say: RankOutput,
                   env: Mapping[str, str] | None = None, launcher: str | None = None, limit: int | None = None,
                   default_size: int = DEFAULT_NP, profile: Profile = LOCAL) -> TacoCluster:
    """The running cluster ``name`` with ``size`` ranks and ``env`` (``LIGHT_INTRA_SIZE``, ``TACO_GPUS``, …) in
    its engines' environment, reusing, repairing, resizing or restarting it as needed."""
    env = dict(env or {})
    cluster = clusters.get(name)
    if cluster is not None and cluster.error:
        say.warn(f"cluster {name!r} is unusable ({cluster.error}); starting a fresh one: {LOST}")
        clusters.pop(name).stop()
        cluster = None
    if cluster is not None and cluster.ipp_cluster is None:
        clusters.pop(name)
        cluster = None
    if cluster is not None and size is not None and size != cluster.size:
        say.warn(f"cluster {name!r} has {cluster.size} ranks; restarting it with -np {size}: {LOST}")
        clusters.pop(name).stop()
        cluster = None
    if cluster is not None and cluster.profile != profile:
        say.warn(f"cluster {name!r} runs elsewhere; restarting it with --profile {profile.name}: {LOST}")
        clusters.pop(name).stop()
        cluster = None
    reason = _restart_reason(cluster, env) if cluster is not None else None
    if reason is not None:
        say.warn(f"cluster {name!r} {reason}: {LOST}")
        clusters.pop(name).stop()
        cluster = None
    if cluster is None:
        shared = _attach(name, size, say) if profile.single_host else None  # the sidebar's clusters are local
        return shared or _start(name, size or default_size, mpiexec, say, env, launcher, limit, profile)
    return cluster


def _attach(name: str, size: int | None, say: RankOutput) -> TacoCluster | None:
    """The cluster ``name`` started from the sidebar (owned by the Jupyter server), if there is one."""
    from ..cluster.attach import attach, find_shared

    model = find_shared(name)
    if model is None:
        return None
    if size is not None and size != model["size"]:
        raise UsageError(f"cluster {name!r} was started from the sidebar with {model['size']} ranks: scale it "
                         f"there, or use -np {model['size']} or another --cluster name")
    cluster = clusters[name] = attach(model)
    say.notice(f"using cluster {name!r} started from the sidebar: {model['size']} ranks")
    return cluster


def format_status(cluster: TacoCluster) -> str:
    status = cluster.model()
    lines = [f"cluster {status['name']!r}: {status['state']}, {status['engines_up']}/{status['size']} engines up"]
    if status["mpi"]:
        lines.append(f"  MPI: {status['mpi']}")
    if status["started_at"]:
        hosts = ", ".join(sorted({n["host"] for n in status["nodes"]}))
        lines.append(f"  up for {time.time() - status['started_at']:.0f} s; hosts: {hosts}")
    if cluster.ranks:
        lines.append("  rank  node  local  host                 pid")
        lines += [f"  {r.rank:>4}  {r.node:>4}  {r.local_rank:>5}  {r.host:<20} {r.pid:>6}" for r in cluster.ranks]
    return "\n".join(lines)


def _shared_size(name: str) -> int | None:
    from ..cluster.attach import find_shared

    model = find_shared(name)
    return model["size"] if model is not None else None


def _cell_dashboard(cluster: TacoCluster, targets: list[int] | None, mode: str, capacity: float | None) -> Any:
    from ..widgets.dashboard import CellDashboard

    node_of_rank = {r.rank: r.node for r in cluster.ranks if targets is None or r.rank in targets}
    return CellDashboard(node_of_rank, mode, title=f"cluster {cluster.name!r}", capacity_bps=capacity)


@magics_class
class TacoMagics(Magics, TacoSettings):
    """Registered by ``%load_ext taco_notebook``. Its traits (``%config TacoMagics``) are the magics' defaults:
    see :mod:`taco_notebook.magics.settings`."""

    @magic_arguments()
    @run_args
    @line_cell_magic
    def taco_run(self, line: str, cell: str | None = None) -> Any:
        """Run the cell on every MPI rank of a cluster (started on first use); ``taco`` is the rank's API.

        Example::

            %%taco_run -np 4
            t = torch.full((3,), float(taco.rank())); taco.allreduce(t); print(t)

        Each option's default is its trait when set (``%config TacoMagics.compression = "fp16"``, or
        ``c.TacoMagics.compression`` in ipython_config.py; ``%config TacoMagics`` lists them), else the
        environment variable named with it.
        """
        if wants_help(line):
            print(usage(self.taco_run, "%%taco_run"))
            return None
        if cell is None:  # a line magic only so that `%taco_run?` and `%taco_run --help` show this help
            raise UsageError("%taco_run runs a whole cell: put %%taco_run (two %) and its options on the cell's "
                             "first line and the code below it; %%taco_run --help lists the options")
        args = parse_argstring(self.taco_run, line)
        size = cluster_size(args.np, "-np", self.max_ranks)
        with usage_errors():
            timeout = self.chosen("timeout", args.timeout, "--timeout")
            launcher = self.chosen("mpi_launcher", args.mpi_launcher, "--mpi-launcher")
            intra_size = self.chosen("intra_size", args.intra_size, "--intra-size")
        settings = comm_settings(self, args)
        running = clusters.get(args.cluster)
        planned = size or (running.size if running is not None else _shared_size(args.cluster) or self._new_size())
        targets = parse_targets(args.targets, planned)
        say = RankOutput(live=args.stream, quiet=args.quiet)
        if intra_size is not None and planned % intra_size:
            raise UsageError(f"--intra-size {intra_size} must divide -np {planned}")
        mode = self._dashboard_mode(args.dashboard)
        capacity = self._link_capacity(args.link_gbits)  # checked before anything starts
        env = cluster_settings(self, args, planned)
        if intra_size:
            env["LIGHT_INTRA_SIZE"] = str(intra_size)
        profile = _profile(self, args, planned)
        cluster = ensure_cluster(args.cluster, planned, args.mpiexec, say, env, launcher, self.max_ranks,
                                 profile=profile)
        monitors = [] if mode == "off" else [_cell_dashboard(cluster, targets, mode, capacity)]
        options = CellOptions(targets=targets, timeout=timeout, gather=args.gather, settings=settings,
                              monitors=monitors)  # fmt: skip
        return run_cell(cluster, cell, options, say)

    def _new_size(self) -> int:
        """Ranks of a cluster started without ``-np``: ``TacoMagics.np`` when set, else 4."""
        return self.np or DEFAULT_NP

    def _dashboard_mode(self, option: str | None) -> str:
        """``--dashboard``/``--no-dashboard``, else ``TacoMagics.dashboard``, else ``TACO_DASHBOARD``/auto."""
        if option == "off":  # --no-dashboard: no need to import the widgets (and bokeh) to check it
            return "off"
        with usage_errors():
            chosen = self.chosen("dashboard", option, "--dashboard")
            if chosen == "off":
                return "off"
            from ..widgets.dashboard import dashboard_mode

            return dashboard_mode(chosen)

    def _link_capacity(self, option: str | None) -> float | None:
        """Bytes/s of a node's network link (``--link-gbits``, ``TacoMagics.link_gbits``, ``TACO_LINK_GBITS``),
        for the heatmaps' scale; None when unknown."""
        with usage_errors():
            gbits = self.chosen("link_gbits", option, "--link-gbits")
            if gbits is None:
                gbits = link_gbits_from_env()
        return None if gbits is None else gbits * 1e9 / 8

    @magic_arguments()
    @argument("action", choices=["start", "stop", "restart", "status", "list"], help="what to do")
    @argument("-n", "-np", dest="np", default=None, metavar="N", help="ranks for start/restart")
    @argument("--all", action="store_true", help="with stop: stop every cluster of this kernel")
    @cluster_args
    @line_magic
    def taco_cluster(self, line: str) -> None:
        """Manage clusters: ``%taco_cluster start -n 4 | stop | restart | status | list [--cluster NAME]``."""
        if wants_help(line):
            print(usage(self.taco_cluster, "%taco_cluster"))
            return
        args = parse_argstring(self.taco_cluster, line)
        size = cluster_size(args.np, "-n", self.max_ranks)
        action = getattr(self, f"_cluster_{args.action}")
        action(args.cluster, size, args)

    def _cluster_list(self, name: str, size: int | None, args: Any) -> None:
        if not clusters:
            print("no clusters running in this kernel")
        for cluster in clusters.values():
            status = cluster.model()
            print(f"{status['name']}: {status['state']}, {status['engines_up']}/{status['size']} engines, "
                  f"{status['mpi']}")

    def _cluster_status(self, name: str, size: int | None, args: Any) -> None:
        cluster = clusters.get(name)
        if cluster is None:
            print(f"cluster {name!r}: stopped (start it with %taco_cluster start -n N)")
        else:
            print(format_status(cluster))

    def _cluster_stop(self, name: str, size: int | None, args: Any) -> None:
        names = list(clusters) if args.all else [name]
        for stopping in names:
            if stopping not in clusters:
                raise UsageError(f"no cluster named {stopping!r} is running; running: {sorted(clusters) or 'none'}")
            clusters.pop(stopping).stop()
            RankOutput().notice(f"cluster {stopping!r} stopped")

    def _cluster_start(self, name: str, size: int | None, args: Any) -> None:
        running = clusters.get(name)
        ranks = size or (running.size if running else self._new_size())
        env, launcher = self._cluster_options(args, ranks)
        profile = _profile(self, args, ranks)
        if (running is not None and running.running and size in (None, running.size)
                and running.profile == profile and _restart_reason(running, env) is None):
            RankOutput().notice(f"cluster {name!r} is already running with {running.size} ranks")
        else:
            ensure_cluster(name, size, args.mpiexec, RankOutput(), env, launcher, self.max_ranks, self._new_size(),
                           profile)

    def _cluster_restart(self, name: str, size: int | None, args: Any) -> None:
        previous = clusters.get(name)
        ranks = size or (previous.size if previous else self._new_size())
        env, launcher = self._cluster_options(args, ranks)  # checked before the running cluster is stopped
        profile = _profile(self, args, ranks)
        previous = clusters.pop(name, None)
        if previous is not None:
            RankOutput().warn(f"restarting cluster {name!r}: {LOST}")
            previous.stop()
        _start(name, ranks, args.mpiexec, RankOutput(), env, launcher, self.max_ranks, profile)

    def _cluster_options(self, args: Any, size: int) -> tuple[dict[str, str], str | None]:
        """The engines' environment (``--gpus``, ``--shm``, ``--collective-timeout``) and the MPI launcher."""
        env = cluster_settings(self, args, size)
        with usage_errors():
            return env, self.chosen("mpi_launcher", args.mpi_launcher, "--mpi-launcher")
