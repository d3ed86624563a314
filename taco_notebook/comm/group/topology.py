"""Who is where: rank, local rank and node of every process, derived from MPI.

Ranks are grouped into nodes by hostname, in order of first appearance. One machine can stand in for several
nodes (emulated clusters, tests): ``TACO_NODE_NAME`` gives a process its own node name, and ``LIGHT_INTRA_SIZE``
(TACO-Training's flag) or an explicit ``intra_size`` groups consecutive ranks into nodes of that size.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ..specs import number_from_env

__all__ = ["Topology", "node_name", "intra_size_from_env"]


def node_name() -> str:
    """This process's node name: ``TACO_NODE_NAME`` if set, else the hostname."""
    return os.environ.get("TACO_NODE_NAME") or socket.gethostname()


def intra_size_from_env() -> int | None:
    """``LIGHT_INTRA_SIZE`` as a positive int, or None when unset or empty."""
    value = number_from_env(os.environ, "LIGHT_INTRA_SIZE", int, "a positive integer")
    if value is not None and value <= 0:
        raise ValueError(f"LIGHT_INTRA_SIZE must be a positive integer, got {os.environ['LIGHT_INTRA_SIZE'].strip()!r}")
    return value  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Topology:
    """Placement of one rank in the job, plus the ranks of every node."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    node: int
    hostnames: tuple[str, ...]
    node_ranks: tuple[tuple[int, ...], ...]

    @property
    def num_nodes(self) -> int:
        return len(self.node_ranks)

    @property
    def hostname(self) -> str:
        return self.hostnames[self.rank]

    @classmethod
    def from_hostnames(cls, rank: int, hostnames: list[str], intra_size: int | None = None) -> Topology:
        """Build the topology of ``rank`` given every rank's node name.

        >>> Topology.from_hostnames(3, ["a", "a", "b", "b"]).local_rank
        1
        """
        size = len(hostnames)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside 0..{size - 1}")
        if intra_size is not None:
            if intra_size <= 0 or size % intra_size:
                raise ValueError(
                    f"intra-node size {intra_size} must divide the number of ranks {size}; "
                    f"set LIGHT_INTRA_SIZE to a divisor of {size}"
                )
            groups = [tuple(range(start, start + intra_size)) for start in range(0, size, intra_size)]
        else:
            by_host: dict[str, list[int]] = {}
            for r, host in enumerate(hostnames):
                by_host.setdefault(host, []).append(r)
            groups = [tuple(ranks) for ranks in by_host.values()]
        node = next(i for i, ranks in enumerate(groups) if rank in ranks)
        return cls(
            rank=rank,
            size=size,
            local_rank=groups[node].index(rank),
            local_size=len(groups[node]),
            node=node,
            hostnames=tuple(hostnames),
            node_ranks=tuple(groups),
        )
