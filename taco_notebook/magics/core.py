"""``%%taco_run`` runs a cell on every MPI rank; ``%taco_cluster`` starts, stops and inspects clusters."""

from __future__ import annotations

import os
import time
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..cluster.mpi import find_mpi
from ..cluster.registry_writer import track
from ..cluster.run import CellOptions, run_cell
from ..cluster.session import TacoCluster, clusters
from ..errors import MPINotFoundError
from .args import (
    DEFAULT_NP,
    cluster_args,
    cluster_size,
    comm_settings,
    gpu_option,
    parse_targets,
    positive_float,
    positive_int,
    run_args,
    usage,
    wants_help,
)
from .output import RankOutput

__all__ = ["TacoMagics", "ensure_cluster", "format_status"]

LOST = "the engines' variables are lost"  # said whenever a cluster is restarted under the user's feet


def _start(name: str, size: int, mpiexec: str | None, say: RankOutput, intra_size: int | None = None,
           gpus: str | None = None) -> TacoCluster:
    cluster_size(str(size), "-np")  # the limit, once more where every start goes through
    env = {"LIGHT_INTRA_SIZE": str(intra_size)} if intra_size else {}
    if gpus is not None:
        env["TACO_GPUS"] = gpus  # the ranks place themselves (comm/placement.py) before CUDA starts
    cluster = track(TacoCluster(name, size, mpiexec=mpiexec, env=env))  # the sidebar lists it
    try:
        mpi = cluster.mpi = find_mpi(mpiexec, single_host=True)
    except MPINotFoundError as exc:
        raise UsageError(str(exc)) from None
    say.notice(f"starting cluster {name!r}: {size} ranks with {mpi.description}…")
    began = time.monotonic()
    cluster.start()
    clusters[name] = cluster
    hosts = ", ".join(sorted({r.host for r in cluster.ranks}))
    say.notice(f"cluster {name!r} ready in {time.monotonic() - began:.1f} s: {size} ranks on {hosts}")
    return cluster


def ensure_cluster(name: str, size: int | None, mpiexec: str | None, say: RankOutput,
                   intra_size: int | None = None, gpus: str | None = None) -> TacoCluster:
    """The running cluster ``name`` with ``size`` ranks, reusing, repairing or resizing as needed."""
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
    wanted = str(intra_size) if intra_size else None
    if cluster is not None and intra_size is not None and cluster.env.get("LIGHT_INTRA_SIZE") != wanted:
        say.warn(f"cluster {name!r} has another node layout; restarting it with --intra-size {intra_size}: {LOST}")
        clusters.pop(name).stop()
        cluster = None
    if cluster is not None and gpus is not None and cluster.env.get("TACO_GPUS", "auto") != gpus:
        say.warn(f"cluster {name!r} places GPUs otherwise; restarting it with --gpus {gpus}: {LOST}")
        clusters.pop(name).stop()
        cluster = None
    if cluster is None:
        return _attach(name, size, say) or _start(name, size or DEFAULT_NP, mpiexec, say, intra_size, gpus)
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


def _dashboard_mode(wanted: bool) -> str:
    if not wanted:
        return "off"
    from ..widgets.dashboard import dashboard_mode

    try:
        return dashboard_mode()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _link_capacity() -> float | None:
    """Bytes/s of a node's network link from ``TACO_LINK_GBITS`` (e.g. ``25``), for the heatmaps' scale."""
    value = os.environ.get("TACO_LINK_GBITS")
    if not value:
        return None
    try:
        gbits = float(value)
    except ValueError:
        gbits = float("nan")
    if not 0 < gbits < float("inf"):
        raise UsageError(f"TACO_LINK_GBITS must be a positive number of Gbit/s, got {value!r}")
    return gbits * 1e9 / 8


def _cell_dashboard(cluster: TacoCluster, targets: list[int] | None, mode: str, capacity: float | None) -> Any:
    from ..widgets.dashboard import CellDashboard

    node_of_rank = {r.rank: r.node for r in cluster.ranks if targets is None or r.rank in targets}
    return CellDashboard(node_of_rank, mode, title=f"cluster {cluster.name!r}", capacity_bps=capacity)


@magics_class
class TacoMagics(Magics):
    """Registered by ``%load_ext taco_notebook``."""

    @magic_arguments()
    @run_args
    @line_cell_magic
    def taco_run(self, line: str, cell: str | None = None) -> Any:
        """Run the cell on every MPI rank of a cluster (started on first use); ``taco`` is the rank's API.

        Example::

            %%taco_run -np 4
            t = torch.full((3,), float(taco.rank())); taco.allreduce(t); print(t)
        """
        if wants_help(line):
            print(usage(self.taco_run, "%%taco_run"))
            return None
        if cell is None:  # a line magic only so that `%taco_run?` and `%taco_run --help` show this help
            raise UsageError("%taco_run runs a whole cell: put %%taco_run (two %) and its options on the cell's "
                             "first line and the code below it; %%taco_run --help lists the options")
        args = parse_argstring(self.taco_run, line)
        size = cluster_size(args.np, "-np")
        timeout = positive_float(args.timeout, "--timeout")
        intra_size = positive_int(args.intra_size, "--intra-size")
        settings = comm_settings(args.algorithm, args.compression, args.fusion_mb)
        running = clusters.get(args.cluster)
        planned = size or (running.size if running is not None else _shared_size(args.cluster) or DEFAULT_NP)
        targets = parse_targets(args.targets, planned)
        say = RankOutput(live=args.stream, quiet=args.quiet)
        if intra_size is not None and planned % intra_size:
            raise UsageError(f"--intra-size {intra_size} must divide -np {planned}")
        mode = _dashboard_mode(args.dashboard)
        gpus = gpu_option(args.gpus, planned)
        capacity = _link_capacity()  # checked before anything starts
        cluster = ensure_cluster(args.cluster, planned, args.mpiexec, say, intra_size, gpus)
        monitors = [] if mode == "off" else [_cell_dashboard(cluster, targets, mode, capacity)]
        options = CellOptions(targets=targets, timeout=timeout, gather=args.gather, settings=settings,
                              monitors=monitors)  # fmt: skip
        return run_cell(cluster, cell, options, say)

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
        size = cluster_size(args.np, "-n")
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
        gpus = gpu_option(args.gpus, size or (running.size if running else DEFAULT_NP))
        if (running is not None and running.running and size in (None, running.size)
                and gpus in (None, running.env.get("TACO_GPUS", "auto"))):
            RankOutput().notice(f"cluster {name!r} is already running with {running.size} ranks")
        else:
            ensure_cluster(name, size, args.mpiexec, RankOutput(), gpus=gpus)

    def _cluster_restart(self, name: str, size: int | None, args: Any) -> None:
        previous = clusters.get(name)
        ranks = size or (previous.size if previous else DEFAULT_NP)
        gpus = gpu_option(args.gpus, ranks)  # checked before the running cluster is stopped
        previous = clusters.pop(name, None)
        if previous is not None:
            RankOutput().warn(f"restarting cluster {name!r}: {LOST}")
            previous.stop()
        _start(name, ranks, args.mpiexec, RankOutput(), gpus=gpus)
