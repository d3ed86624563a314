"""Every rank's two int64 values without a round over the whole group: what the ranks' agreement on each
collective exchanges (:mod:`.agreement`).

An allgather of 16 bytes over gloo among N ranks is N-1 loopback or network steps, each needing its two ranks on
a core at once: milliseconds a collective on a loaded machine (benchmarks/README.md). A one-node job
exchanges through the node's shared segment instead (futex waits, no socket). A 2D job (several nodes of equal
size) does that on each node, then every local rank allgathers its node's values over its cross-node group,
one step between nodes; the local ranks' cross groups run side by side. A node without room for its segment
says so in that step, and every rank then falls back to the allgather over the group together.
"""

from __future__ import annotations

import torch

from ..state import state
from ..transport.reduction import all_gather
from . import algorithms

__all__ = ["exchange"]


def exchange(values: tuple[int, int]) -> tuple[list[int], list[int]] | None:
    """Every rank's two ``values``, in rank order, through shared memory (and the cross-node groups of a 2D job
    whose groups are built), or None on every rank (the caller exchanges over the group). Collective, on the
    comm thread."""
    if algorithms.one_node():
        return algorithms.node_segment().exchange(values)
    tiers = algorithms.built_hierarchy()
    if tiers is None or tiers.segment is None:
        return None
    topo = state.topology
    assert topo is not None
    local = tiers.segment.exchange(values)
    size = len(tiers.local_peers)
    mine = torch.zeros(1 + 2 * size, dtype=torch.int64)  # [the node has them, L first values, L second values]
    if local is not None:
        mine[0] = 1
        mine[1: 1 + size] = torch.tensor(local[0])
        mine[1 + size:] = torch.tensor(local[1])
    every = torch.empty(len(tiers.cross_peers) * mine.numel(), dtype=torch.int64)
    all_gather(every, mine, group=tiers.cross)
    rows = every.view(len(tiers.cross_peers), -1).tolist()
    if not all(row[0] for row in rows):  # a node had no room: the same rows reach every cross group
        return None
    first, second = [0] * topo.size, [0] * topo.size
    for node, row in enumerate(rows):  # the cross group holds one rank of each node, in node order
        for local_rank, rank in enumerate(topo.node_ranks[node]):
            first[rank], second[rank] = row[1 + local_rank], row[1 + size + local_rank]
    return first, second
