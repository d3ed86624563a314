"""``%taco_doctor`` and ``--require-hugepages``: the node report read through a cluster's engines.

The cluster is a running one (``--cluster``), or, for nodes where nothing runs yet (``--hosts``, ``--hostfile``,
``--profile``), a temporary one that :func:`examine_nodes` starts with one engine per node through the normal
start path (:func:`~taco_notebook.magics.clusters.start_cluster`) and always stops. One engine per node runs
:func:`taco_notebook.cluster.nodefacts.node_facts` (``view.apply``), and each node in turn receives a one-second
stream from the previous one (:func:`taco_notebook.comm.linkspeed.start_receiver` on the receiver's engine,
:func:`~taco_notebook.comm.linkspeed.send` on the sender's), as :mod:`taco_notebook.cluster.doctor` describes.
With neither, the report is this machine's alone.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

from IPython.core.error import UsageError

from ..cluster.describe import RankInfo
from ..cluster.doctor import DoctorReport, NodeReport, local_report, report_from_facts
from ..cluster.profiles import Profile
from ..cluster.session import TacoCluster, clusters
from ..errors import ClusterStartError
from .output import RankOutput

__all__ = ["node_engines", "cluster_report", "doctor_report", "hugepage_nodes", "show_report", "examine_nodes",
           "one_engine_per_node", "chosen_report"]


def _route_address(target: str) -> str:
    """Runs on an engine: the address of this node on the route to ``target`` (the controller's address)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((target, 9))  # UDP: chooses the route, sends nothing
        return str(probe.getsockname()[0])


def node_engines(cluster: TacoCluster) -> dict[str, RankInfo]:
    """The lowest rank of each node, by a name for the node: its host, or ``host/nodeN`` where nodes share one
    host (``--intra-size`` emulation)."""
    first: dict[int, RankInfo] = {}
    for rank in sorted(cluster.ranks, key=lambda r: r.rank):
        first.setdefault(rank.node, rank)
    shared = len({r.host for r in first.values()}) < len(first)
    return {(f"{r.host}/node{node}" if shared else r.host): r for node, r in sorted(first.items())}


def _node_facts_on(cluster: TacoCluster, name: str, rank: RankInfo) -> dict[str, Any]:
    from ..cluster.nodefacts import node_facts

    try:
        facts: dict[str, Any] = cluster.client[rank.rank].apply_sync(node_facts)
    except Exception as exc:  # noqa: BLE001 - a node that cannot be read is a row of the report, not a crash
        return {"node": name, "error": f"rank {rank.rank} could not read its node: {exc}"}
    facts["node"] = name
    return facts


def _measure(cluster: TacoCluster, sender: RankInfo, receiver: RankInfo, address: str,
             seconds: float) -> dict[str, Any]:
    from ..comm.linkspeed import send, start_receiver

    listening = cluster.client[receiver.rank].apply_sync(start_receiver, address)
    return dict(cluster.client[sender.rank].apply_sync(send, address, listening["port"], listening["token"],
                                                       seconds))


def _links(cluster: TacoCluster, nodes: dict[str, RankInfo], seconds: float) -> list[dict[str, Any]]:
    """A ring of one-at-a-time measurements (n0→n1, n1→n2, …, back to n0 for three or more nodes), each with
    the receiver's ``address`` it was measured to.

    The receiver listens on its address on the route to the controller (which every engine reaches): a NIC's
    address across hosts, loopback for nodes emulated on one host (``--intra-size``).
    """
    names = list(nodes)
    if len(names) < 2:
        return []
    controller = getattr(cluster.ipp_cluster, "controller_ip", None) or "127.0.0.1"
    receivers = names[1:] + names[:1]
    pairs = list(zip(names, receivers, strict=True)) if len(names) > 2 else [(names[0], names[1])]
    links = []
    for sender, receiver in pairs:
        try:
            address = cluster.client[nodes[receiver].rank].apply_sync(_route_address, controller)
            if address.startswith("127.") and nodes[sender].host != nodes[receiver].host:
                raise RuntimeError(f"{receiver} reaches the controller over loopback ({controller}): no address "
                                   f"of it that {sender} can reach is known")
            result = _measure(cluster, nodes[sender], nodes[receiver], address, seconds)
            links.append({"from": sender, "to": receiver, "address": address, "gbit_per_s": result["gbit_per_s"],
                          "bytes": result["bytes"], "seconds": result["seconds"]})
        except Exception as exc:  # noqa: BLE001 - a failed measurement is reported, with its reason
            links.append({"from": sender, "to": receiver, "gbit_per_s": None, "error": str(exc)})
    return links


def cluster_report(cluster: TacoCluster, seconds: float = 1.0) -> DoctorReport:
    """Every node of the running ``cluster``, read by one of its engines, and the links between them."""
    nodes = node_engines(cluster)
    facts = [_node_facts_on(cluster, name, rank) for name, rank in nodes.items()]
    return report_from_facts(facts, _links(cluster, nodes, seconds))


def doctor_report(cluster: TacoCluster | None) -> DoctorReport:
    """The running ``cluster``'s nodes, else (None) this machine's."""
    return cluster_report(cluster) if cluster is not None else local_report()


def hugepage_nodes(cluster: TacoCluster) -> list[NodeReport]:
    """Each node's huge pages as the engines found them at start (``RankInfo.hugepages``, /proc/meminfo's
    default-size pool), as reports :func:`taco_notebook.cluster.doctor.require_hugepages` reads."""
    reports = []
    for name, rank in node_engines(cluster).items():
        pages = rank.hugepages
        pools = {str(pages["page_kb"]): {"total": pages["total"], "free": pages["free"], "reserved": 0}} \
            if pages else {}
        reports.append(NodeReport({"node": name, "hugepages": {"pools": pools,
                                                               "default_kb": pages["page_kb"] if pages else None}}))
    return reports


def show_report(report: DoctorReport) -> None:
    """The report as HTML (with the text table beside it) in a notebook's kernel, else the text table on stdout."""
    from IPython import get_ipython
    from IPython.display import display

    if getattr(get_ipython(), "kernel", None) is None:  # a terminal: its display shows text/plain only
        print(report)
        return
    display({"text/html": report._repr_html_(), "text/plain": str(report)}, raw=True)


def one_engine_per_node(profile: Profile) -> tuple[Profile, int]:
    """``profile`` with one slot per host, and how many engines that makes: one per listed host; for a Slurm
    job the allocation's node count inside one (``SLURM_JOB_NUM_NODES``), else its ``--nodes`` or 1."""
    if profile.hosts:
        return dataclasses.replace(profile, hosts=tuple((host, 1) for host, _ in profile.hosts)), len(profile.hosts)
    if profile.slurm is not None:
        inside = os.environ.get("SLURM_JOB_NUM_NODES", "") if os.environ.get("SLURM_JOB_ID") else ""
        return profile, int(inside) if inside.isdigit() and int(inside) > 0 else profile.slurm.nodes or 1
    return profile, 1


def _check_reachable(profile: Profile) -> None:
    """A ClusterStartError naming the hosts of ``profile`` that ssh cannot reach, before anything starts: hydra
    names only an address, and the ranks it already started on the other hosts die without cleaning up."""
    from ..cluster.sshcheck import unreachable_hosts

    failed = unreachable_hosts(profile) if profile.hosts and profile.slurm is None else {}
    if failed:
        named = "; ".join(f"host {host}: {why}" for host, why in failed.items())
        raise ClusterStartError(f"cannot reach {', '.join(failed)} over ssh ({named}): check that the host is up "
                                f"and that `ssh {next(iter(failed))} true` works without a prompt; nothing was "
                                f"started")


def examine_nodes(profile: Profile, say: RankOutput, mpiexec: str | None = None,
                  limit: int | None = None, seconds: float = 1.0) -> DoctorReport:
    """The report of every node of ``profile``, read through a temporary cluster of one engine per node that is
    stopped before this returns, also on an error or Ctrl-C (no engines, controller or registry entry left).
    Hosts that ssh cannot reach are named in a :class:`ClusterStartError` before anything starts."""
    from .clusters import start_cluster

    profile, nodes = one_engine_per_node(profile)
    name = f"doctor-{uuid.uuid4().hex[:6]}"
    where = f" ({', '.join(host for host, _ in profile.hosts)})" if profile.hosts else ""
    _check_reachable(profile)
    say.notice(f"starting one engine on each of {nodes} node{'s' if nodes != 1 else ''}{where}…")
    try:
        try:
            cluster = start_cluster(name, nodes, mpiexec, RankOutput(quiet=True), limit=limit, profile=profile)
        except ClusterStartError as exc:
            raise ClusterStartError(f"the nodes could not be examined: {exc}") from None
        say.notice(f"reading the {nodes} nodes and the links between them…" if nodes > 1 else "reading the node…")
        return cluster_report(cluster, seconds)
    finally:
        started = clusters.pop(name, None)
        if started is not None:
            started.stop()


def chosen_report(config: Any, args: Any, say: RankOutput) -> DoctorReport:
    """``%taco_doctor``'s report: a running cluster's (``--cluster``, else ``default`` when it runs), the nodes
    of ``--hosts/--hostfile/--profile`` through a temporary cluster, else this machine's alone."""
    elsewhere = args.hosts is not None or args.hostfile is not None or args.profile is not None
    if elsewhere:
        if args.cluster is not None:
            raise UsageError("--cluster reads a running cluster's nodes; --hosts/--hostfile/--profile start a "
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
        raise UsageError(f"no cluster named {args.cluster!r} is running (running: {running}): start it with "
                         "%taco_cluster start, or leave --cluster out to examine this machine alone")
    if cluster is not None:
        say.notice(f"reading the nodes of cluster {cluster.name!r} through its engines…")
    return doctor_report(cluster)
