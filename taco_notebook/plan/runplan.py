"""From ``%%taco_run``'s parsed options to a cluster and the options of one run: the one path shared by the cell
magic, its line form (``%taco_run -np 4 train.py``) and ``taco-notebook launch`` (:mod:`taco_notebook.cli.launch`).

Every option is checked before anything starts (an ``OptionError`` naming it); then the cluster is reused,
repaired, resized or started (:func:`~.clusters.ensure_cluster`) and its huge pages checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, cast

from ..cluster.cells.run import CellOptions
from ..cluster.session import TacoCluster, clusters
from ..engine.script import Script, load_script
from ..engine.wire import Output
from ..errors import OptionError
from .clusters import check_hugepages, chosen_profile, ensure_cluster, shared_size
from .options import OUTPUT_ALL_UP_TO
from .output import RankOutput
from .resolve import (
    DEFAULT_NP,
    cluster_settings,
    cluster_size,
    comm_settings,
    elastic_spec,
    option_errors,
    parse_targets,
    required_hugepages,
)
from .settings import TacoSettings, setting_from_env

__all__ = ["RunPlan", "plan_run", "script_of", "new_size", "dashboard_mode", "link_capacity"]


@dataclass
class RunPlan:
    """The cluster a run goes to, the run's options, and whether planning it started that cluster."""

    cluster: TacoCluster
    options: CellOptions
    started: bool


def new_size(config: TacoSettings) -> int:
    """Ranks of a cluster started without ``-np``: ``TacoMagics.np`` when set, else 4."""
    return config.np or DEFAULT_NP


def dashboard_mode(config: TacoSettings, option: str | None) -> str:
    """``--dashboard``/``--no-dashboard``, else ``TacoMagics.dashboard``, else ``TACO_DASHBOARD``/auto."""
    if option == "off":  # --no-dashboard: no need to import the widgets (and bokeh) to check it
        return "off"
    with option_errors():
        chosen = config.chosen("dashboard", option, "--dashboard")
        if chosen == "off":
            return "off"
        from ..widgets.dashboard import dashboard_mode as mode_here

        return mode_here(chosen)


def link_capacity(config: TacoSettings, option: str | None) -> float | None:
    """Bytes/s of a node's network link (``--link-gbits``, ``TacoMagics.link_gbits``, ``TACO_LINK_GBITS``), for
    the heatmaps' scale; None when unknown."""
    with option_errors():
        gbits = config.chosen("link_gbits", option, "--link-gbits")
        if gbits is None:
            gbits = setting_from_env("link_gbits")
    return None if gbits is None else gbits * 1e9 / 8


_told_output: set[str] = set()  # the clusters (ids) told once that auto shows rank 0's output only


def output_mode(config: TacoSettings, option: str | None, ranks: int, cluster_id: str, say: RankOutput) -> Output:
    """Whose output the cell shows (``--output``, ``TacoMagics.output``, ``TACO_OUTPUT``, else auto): all up to
    :data:`~.options.OUTPUT_ALL_UP_TO` ranks, rank0 beyond, which is said once per cluster."""
    with option_errors():
        mode = config.chosen("output", option, "--output") or setting_from_env("output") or "auto"
    if mode != "auto":
        return cast(Output, str(mode))  # one of the option's choices
    if ranks <= OUTPUT_ALL_UP_TO:
        return "all"
    if cluster_id not in _told_output:
        _told_output.add(cluster_id)
        say.notice(f"{ranks} ranks: showing rank 0's output, and what any rank writes to stderr or prints before "
                   f"it fails (--output all shows every rank's; --output errors only those)")
    return "rank0"


def script_of(args: Any, shown_as: str) -> Script:
    """The script named by the parsed line (``SCRIPT ARGS…`` after the options), read now: a OptionError before
    anything starts when there is none or it cannot be run. ``shown_as`` is how the user calls it."""
    if not args.script:
        raise OptionError(f"{shown_as} needs a script to run: {shown_as} -np 4 train.py --epochs 1 runs "
                         f"train.py on every rank ({shown_as} --help lists the options)")
    with option_errors():
        return load_script(args.script, args.script_args, horovod=bool(getattr(args, "horovod", False)))


def _cell_dashboard(cluster: TacoCluster, targets: list[int] | None, mode: str, capacity: float | None) -> Any:
    from ..widgets.dashboard import CellDashboard

    node_of_rank = {r.rank: r.node for r in cluster.ranks if targets is None or r.rank in targets}
    return CellDashboard(node_of_rank, mode, title=f"cluster {cluster.name!r}", capacity_bps=capacity)


def plan_run(config: TacoSettings, args: Any, say: RankOutput) -> RunPlan:
    """Check every option of ``args`` (``run_args``), then find or start the cluster; the run's options."""
    size = cluster_size(args.np, "-np", config.max_ranks)
    elastic = elastic_spec(args.elastic, args.targets)
    with option_errors():
        timeout = config.chosen("timeout", args.timeout, "--timeout")
        launcher = config.chosen("mpi_launcher", args.mpi_launcher, "--mpi-launcher")
        intra_size = config.chosen("intra_size", args.intra_size, "--intra-size")
    settings = comm_settings(config, args)
    running = clusters.get(args.cluster)
    planned = size or (running.size if running is not None else shared_size(args.cluster, say)
                       or (elastic.max if elastic else new_size(config)))
    targets = parse_targets(args.targets, planned)
    if intra_size is not None and planned % intra_size:
        raise OptionError(f"--intra-size {intra_size} must divide -np {planned}")
    mode = dashboard_mode(config, args.dashboard)
    capacity = link_capacity(config, args.link_gbits)  # checked before anything starts
    env = cluster_settings(config, args, planned)
    if intra_size:
        env["LIGHT_INTRA_SIZE"] = str(intra_size)
    need = required_hugepages(config, args)
    profile = chosen_profile(config, args, planned)
    cluster = ensure_cluster(args.cluster, planned, args.mpiexec, say, env, launcher, config.max_ranks,
                             profile=profile)
    started = cluster is not running
    check_hugepages(cluster, need, started=started)
    monitors = [] if mode == "off" else [_cell_dashboard(cluster, targets, mode, capacity)]
    runner = None
    if elastic is not None:  # the elastic wait loop, which survives a rank's death (cluster/elastic/recovery.py)
        from ..cluster.elastic.recovery import run_elastic

        runner = partial(run_elastic, spec=elastic)
    output = output_mode(config, args.output, cluster.size if targets is None else len(targets),
                         cluster.cluster_id or cluster.name, say)
    options = CellOptions(targets=targets, timeout=timeout, gather=args.gather, settings=settings,
                          monitors=monitors, runner=runner, check_replicas=args.check_replicas,
                          output=output)  # fmt: skip
    return RunPlan(cluster, options, started)
