"""``%taco_doctor --hosts/--hostfile/--profile`` and ``taco-notebook doctor --hosts``: the report of nodes where no
cluster runs, and which report the magic shows.

:func:`examine_nodes` starts a temporary cluster with one engine per node through the normal start path
(:func:`~taco_notebook.plan.clusters.start_cluster`: ssh, hydra and emulated hosts work as for ``%%taco_run``),
reads it with :func:`~taco_notebook.cluster.doctor.engines.cluster_report`, and always stops it. The doctor's
facts and report live in :mod:`taco_notebook.cluster.doctor`; this module is only its use of the plan's clusters.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

from ..cluster.doctor.collect import local_report
from ..cluster.doctor.engines import cluster_report, doctor_report
from ..cluster.doctor.render import ShownReport
from ..cluster.launch.profiles import Profile
from ..cluster.session import clusters
from ..errors import ClusterStartError, OptionError
from .output import RankOutput

__all__ = ["examine_nodes", "one_engine_per_node", "chosen_report"]


def one_engine_per_node(profile: Profile) -> tuple[Profile, int]:
    """``profile`` with one slot per host, and how many engines that makes: one per listed host; for a Slurm
    job the allocation's node count inside one (``SLURM_JOB_NUM_NODES``), else its ``--nodes`` or 1."""
    if profile.hosts:
        return dataclasses.replace(profile, hosts=tuple((host, 1) for host, _ in profile.hosts)), len(profile.hosts)
    if profile.slurm is not None:
        inside = os.environ.get("SLURM_JOB_NUM_NODES", "") if os.environ.get("SLURM_JOB_ID") else ""
        return profile, int(inside) if inside.isdigit() and int(inside) > 0 else profile.slurm.nodes or 1
    return profile, 1


def examine_nodes(profile: Profile, say: RankOutput, mpiexec: str | None = None,
                  limit: int | None = None, seconds: float = 1.0) -> ShownReport:
    """The report of every node of ``profile``, read through a temporary cluster of one engine per node that is
    stopped before this returns, also on an error or Ctrl-C (no engines, controller or registry entry left).
    Hosts that ssh cannot reach are named in a :class:`ClusterStartError` before anything starts
    (:func:`~taco_notebook.plan.clusters.start_cluster` asks them)."""
    from .clusters import start_cluster

    profile, nodes = one_engine_per_node(profile)
    name = f"doctor-{uuid.uuid4().hex[:6]}"
    where = f" ({', '.join(host for host, _ in profile.hosts)})" if profile.hosts else ""
    say.notice(f"starting one engine on each of {nodes} node{'s' if nodes != 1 else ''}{where}…")
    try:
        try:
            cluster = start_cluster(name, nodes, mpiexec, say, limit=limit, profile=profile)  # and Slurm's queue
        except ClusterStartError as exc:
            raise ClusterStartError(f"the nodes could not be examined: {exc}") from None
        say.notice(f"reading the {nodes} nodes and the links between them…" if nodes > 1 else "reading the node…")
        return cluster_report(cluster, seconds)
    finally:
        started = clusters.pop(name, None)
        if started is not None:
            started.stop()


def chosen_report(config: Any, args: Any, say: RankOutput) -> ShownReport:
    """``%taco_doctor``'s report: a running cluster's (``--cluster``, else ``default`` when it runs), the nodes
    of ``--hosts/--hostfile/--profile`` through a temporary cluster, else this machine's alone."""
    elsewhere = args.hosts is not None or args.hostfile is not None or args.profile is not None
    if elsewhere:
        if args.cluster is not None:
            raise OptionError("--cluster reads a running cluster's nodes; --hosts/--hostfile/--profile start a "
                             "temporary one: give one or the other")
        from .clusters import chosen_profile

        profile = chosen_profile(config, args, 1)
        if profile.single_host:
            return local_report()
        return examine_nodes(profile, say, limit=config.max_ranks)
    cluster = clusters.get(args.cluster or "default")
    if cluster is not None and not cluster.running:
        cluster = None
    if args.cluster is not None and cluster is None:
        running = sorted(n for n, c in clusters.items() if c.running) or "none"
        raise OptionError(f"no cluster named {args.cluster!r} is running (running: {running}): start it with "
                         "%taco_cluster start, or leave --cluster out to examine this machine alone")
    if cluster is not None:
        say.notice(f"reading the nodes of cluster {cluster.name!r} through its engines…")
    return doctor_report(cluster)
