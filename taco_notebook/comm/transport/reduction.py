"""What a compressor's reduction returns and what it sends: the pieces every reduction shares.

A compressor reduces its own payload (:meth:`.base.Compressor.reduce`): a dense payload is summed by
an allreduce, a sparse one gathered and merged. Each returns a :class:`Reduced`, the raw and wire bytes of
the part compression applies to and the bytes this rank sent to each peer, which :mod:`.metrics` records.
The send counts follow the schedule of the collective (ring neighbour for an allreduce, every peer for an
allgather), so they are the same whatever the backend.

Collectives run on whatever stream is current (the comm stream for CUDA tensors, see :mod:`.streams`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["Reduced", "ring_sends", "ring_accounted", "spread", "merge_sends", "reduce_scatter", "all_gather", "pack",
           "unpack"]

reduce_scatter: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Reduced(NamedTuple):
    """One reduction's accounting: raw bytes, wire bytes (after compression), bytes sent to each peer."""

    raw: int
    wire: int
    sends: dict[int, int]


def ring_sends(group_ranks: tuple[int, ...], me: int, nbytes: float) -> dict[int, int]:
    """What a ring allreduce over ``group_ranks`` sends to the next rank: 2(g-1)/g of the payload."""
    g = len(group_ranks)
    if g == 1:
        return {}
    nxt = group_ranks[(group_ranks.index(me) + 1) % g]
    return {nxt: int(2 * (g - 1) / g * nbytes)}


def ring_accounted(raw: int, wire: int, group_ranks: tuple[int, ...], me: int) -> Reduced:
    """A ring allreduce of a ``wire``-byte payload (``raw`` bytes before compression) as :class:`Reduced`: what
    it sends to the next rank, and the raw bytes scaled by the same 2(g-1)/g."""
    sends = ring_sends(group_ranks, me, wire)
    factor = sum(sends.values()) / wire if wire else 0.0
    return Reduced(int(factor * raw), sum(sends.values()), sends)


def spread(peers: tuple[int, ...], me: int, nbytes: float) -> dict[int, int]:
    """What an allgather sends: ``nbytes`` to every other peer."""
    return {p: int(nbytes) for p in peers if p != me}


def merge_sends(*sends: dict[int, int]) -> dict[int, int]:
    """Sum several per-peer send counts."""
    total: dict[int, int] = {}
    for sent in sends:
        for peer, nbytes in sent.items():
            total[peer] = total.get(peer, 0) + nbytes
    return total


def pack(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``values`` then ``indices`` as one byte tensor, each part padded to 8 bytes so that both read back as
    aligned views from any rank's row of an allgather (:func:`unpack`)."""
    at = _padded8(values.numel() * values.element_size())
    packed = torch.empty(at + _padded8(indices.numel() * indices.element_size()), dtype=torch.uint8,
                         device=values.device)
    packed[: values.numel() * values.element_size()].copy_(values.view(torch.uint8))
    packed[at: at + indices.numel() * indices.element_size()].copy_(indices.view(torch.uint8))
    return packed


def unpack(part: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, values) of one rank's row of packed bytes, shaped and typed as this rank's own."""
    nv, ni = values.numel() * values.element_size(), indices.numel() * indices.element_size()
    at = _padded8(nv)
    return part[at: at + ni].view(indices.dtype), part[:nv].view(values.dtype)


def _padded8(nbytes: int) -> int:
    return -(-nbytes // 8) * 8
