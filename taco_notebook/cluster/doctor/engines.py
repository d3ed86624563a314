"""``%taco_doctor`` and ``--require-hugepages``: the node report read through a cluster's engines.

The cluster is a running one (``--cluster``), or, for nodes where nothing runs yet (``--hosts``, ``--hostfile``,
``--profile``), a temporary one (:mod:`taco_notebook.plan.doctor`). One engine per node runs
:func:`taco_notebook.cluster.doctor.nodefacts.node_facts` (``view.apply``), and each node in turn receives a
one-second stream from the previous one (:func:`taco_notebook.comm.diagnostics.linkspeed.start_receiver` on the
receiver's engine, :func:`~taco_notebook.comm.diagnostics.linkspeed.send` on the sender's), as
:mod:`taco_notebook.cluster.doctor.collect` describes. With neither, the report is this machine's alone.
"""

from __future__ import annotations

from typing import Any

from ..describe import RankInfo
from ..session import TacoCluster
from .collect import local_report, report_from_facts
from .render import ShownReport
from .report import NodeReport

__all__ = ["node_engines", "cluster_report", "doctor_report", "hugepage_nodes"]


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
    from .nodefacts import node_facts

    try:
        facts: dict[str, Any] = cluster.client[rank.rank].apply_sync(node_facts)
    except Exception as exc:  # noqa: BLE001 - a node that cannot be read is a row of the report, not a crash
        return {"node": name, "error": f"rank {rank.rank} could not read its node: {exc}"}
    facts["node"] = name
    return facts


def _measure(cluster: TacoCluster, sender: RankInfo, receiver: RankInfo, address: str,
             seconds: float) -> dict[str, Any]:
    from ...comm.diagnostics.linkspeed import send, start_receiver

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


def cluster_report(cluster: TacoCluster, seconds: float = 1.0) -> ShownReport:
    """Every node of the running ``cluster``, read by one of its engines, and the links between them."""
    nodes = node_engines(cluster)
    facts = [_node_facts_on(cluster, name, rank) for name, rank in nodes.items()]
    return report_from_facts(facts, _links(cluster, nodes, seconds))


def doctor_report(cluster: TacoCluster | None) -> ShownReport:
    """The running ``cluster``'s nodes, else (None) this machine's."""
    return cluster_report(cluster) if cluster is not None else local_report()


def hugepage_nodes(cluster: TacoCluster) -> list[NodeReport]:
    """Each node's huge pages as the engines found them at start (``RankInfo.hugepages``, /proc/meminfo's
    default-size pool), as reports :func:`taco_notebook.cluster.doctor.report.require_hugepages` reads."""
    reports = []
    for name, rank in node_engines(cluster).items():
        pages = rank.hugepages
        pools = {str(pages["page_kb"]): {"total": pages["total"], "free": pages["free"], "reserved": 0}} \
            if pages else {}
        reports.append(NodeReport({"node": name, "hugepages": {"pools": pools,
                                                               "default_kb": pages["page_kb"] if pages else None}}))
    return reports
