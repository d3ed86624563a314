"""What ``--gpus auto`` did on a cluster's nodes, said once when the cluster starts.

Each rank places itself (:func:`taco_notebook.comm.group.placement.decide`); a node with fewer GPUs than ranks shares
them, which works but is slower (CUDA tensors over gloo). The ranks cannot tell the user, so the plan layer reads
what each rank reported at start (its node and the GPUs it sees) and hands one line to its output: the notebook
and ``taco-notebook launch`` show the same text, and the magics compose none of it.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..cluster.describe import RankInfo
from ..comm.group.placement import shares_gpus, sharing_notice

__all__ = ["sharing_line"]


def sharing_line(mode: str, ranks: Iterable[RankInfo]) -> str | None:
    """The notice for a cluster whose ``ranks`` were placed with ``mode``, or None when no node shares GPUs
    (a GPU per rank, a CPU-only node, or another mode than ``auto``: ``shared`` was asked for, so it says nothing).
    ``ranks`` are what each rank reported at start: its node and the GPUs it sees.

    >>> sharing_line("auto", [RankInfo(r, "vm", 100 + r, r, 0, gpus=1) for r in range(4)])[:40]
    '--gpus auto: node vm has 1 GPU for 4 ran'
    """
    per_node: dict[int, tuple[str, int, int]] = {}  # node -> (host, GPUs, ranks)
    for rank in ranks:
        host, gpus, count = per_node.get(rank.node, (rank.host, 0, 0))
        per_node[rank.node] = (host, max(gpus, rank.gpus), count + 1)
    sharing = [per_node[node] for node in sorted(per_node) if shares_gpus(mode, *per_node[node][1:])]
    if not sharing:
        return None
    host, gpus, count = sharing[0]
    fewest = min(gpus for _, gpus, _ in sharing)  # "at most N ranks per node" must fit every node named
    return sharing_notice(host, fewest, count, nodes=len(sharing), cluster_nodes=len(per_node))
