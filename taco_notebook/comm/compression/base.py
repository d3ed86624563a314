"""The compressor interface: ``compress`` / ``decompress`` / ``reduce``, and the byte counts every compressor keeps.

A module of its own so that compressors in other modules (:mod:`.powersgd`) can subclass :class:`Compressor`
while :mod:`.compressors` maps every spec to its class without an import loop. Imports only torch and the
standard library: this module runs on every rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..transport.reduction import Reduced, ring_accounted

__all__ = ["Compressor", "CompressionStats", "Payload", "payload_nbytes", "alone", "NOTHING_SENT"]


Payload = list[torch.Tensor] | torch.Tensor

# What a reduction over a group of one returns: nothing crossed any wire.
NOTHING_SENT = Reduced(0, 0, {})


def alone(peers: tuple[int, ...]) -> bool:
    """Whether a group of ``peers`` is this rank alone: its sum is the shard itself, exactly, so every
    compressor's :meth:`Compressor.reduce` returns at once (on one rank the step is plain torch)."""
    return len(peers) == 1


def payload_nbytes(payload: Payload) -> int:
    """Bytes a payload (one tensor or several) occupies."""
    tensors = [payload] if isinstance(payload, torch.Tensor) else payload
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class CompressionStats:
    """Bytes before and after compression, accumulated over every ``compress()`` call.

    ``ratio`` is raw / wire (100.0 means the wire carries 1% of the bytes); it is 1.0 before any bytes passed.
    Read by the metrics layer once per step; ``reset()`` starts a new window.
    """

    tensors: int = 0
    raw_bytes: int = 0
    wire_bytes: int = 0

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0

    def add(self, raw_bytes: int, wire_bytes: int) -> None:
        self.tensors += 1
        self.raw_bytes += raw_bytes
        self.wire_bytes += wire_bytes

    def reset(self) -> None:
        self.tensors = self.raw_bytes = self.wire_bytes = 0

    def as_dict(self) -> dict[str, float]:
        return {"tensors": self.tensors, "raw_bytes": self.raw_bytes, "wire_bytes": self.wire_bytes,
                "ratio": self.ratio}


class Compressor(ABC):
    """Turns a tensor into a wire payload and back.

    Subclasses implement ``_compress`` and ``decompress``; :meth:`compress` checks the input, runs without
    autograd and records :attr:`stats`. ``decompress`` may return the payload itself (no copy) when nothing
    was changed, as Horovod's compressors do.
    """

    name: str = "abstract"
    # Whether the pipelined 2D allreduce may hand this compressor a large shard in chunks, each reduced on its
    # own (its state keyed per chunk). True for dense payloads, whose network time the chunks hide; TopK and
    # PowerSGD say False (little network time to hide; a chunk's selection or factorisation costs more).
    pipelines: bool = True

    def __init__(self) -> None:
        self.stats = CompressionStats()

    def compress(self, tensor: torch.Tensor, key: Hashable | None = None) -> tuple[Payload, Any]:
        """Compress ``tensor``; ``key`` names it across steps (needed by stateful compressors)."""
        if not isinstance(tensor, torch.Tensor):
            got = type(tensor).__name__
            raise TypeError(f"{type(self).__name__}.compress needs a torch.Tensor, got {got}")
        with torch.no_grad():
            payload, ctx = self._compress(tensor, key)
        self.stats.add(tensor.numel() * tensor.element_size(), self.wire_bytes(payload))
        return payload, ctx

    @abstractmethod
    def _compress(self, tensor: torch.Tensor, key: Hashable | None) -> tuple[Payload, Any]: ...

    @abstractmethod
    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """Rebuild a dense tensor with the shape and dtype ``compress`` saw."""

    def reduce(self, shard: torch.Tensor, key: Hashable, group: Any, peers: tuple[int, ...],
               me: int) -> Reduced:
        """Sum ``shard`` over ``group`` (ranks ``peers``, this one ``me``) in place, sending it compressed.

        The default suits dense payloads (none, fp16, bf16): an allreduce of the payload, then decompress.
        A compressor whose payloads cannot be summed on the wire (TopK's values and indices, a low-rank
        factorisation) overrides it; the allreduce algorithm only ever calls this method. A group of one
        (:func:`alone`) leaves ``shard`` as it is: no cast, copy or collective, nothing recorded.
        """
        if alone(peers):
            return NOTHING_SENT
        payload, ctx = self.compress(shard, key)
        if not isinstance(payload, torch.Tensor):
            raise TypeError(f"{type(self).__name__} makes multi-tensor payloads; it must override reduce()")
        return self._reduce_dense(shard, payload, ctx, group, peers, me)

    def _reduce_dense(self, shard: torch.Tensor, payload: torch.Tensor, ctx: Any, group: Any,
                      peers: tuple[int, ...], me: int) -> Reduced:
        """Allreduce a dense ``payload`` of ``shard`` and write the decompressed sum back into ``shard``."""
        raw = shard.numel() * shard.element_size()
        dist.all_reduce(payload, group=group)
        reduced = self.decompress(payload, ctx)
        if reduced.data_ptr() != shard.data_ptr():  # uncompressed: the payload was the shard itself
            shard.copy_(reduced.view_as(shard))
        return ring_accounted(raw, payload.numel() * payload.element_size(), peers, me)

    def fused_wire_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """The dtype of this compressor's payload for a ``dtype`` tensor when that payload is the tensor cast
        (none: ``dtype`` itself; fp16/bf16: theirs), else None (TopK, PowerSGD).

        A pass that produces the shard anyway (the 2D algorithm's shared-memory sum) then writes it straight in
        this dtype and calls :meth:`start_reduce_wire`: no full-size cast before and after the network.
        """
        return None

    def start_reduce_wire(self, payload: torch.Tensor, raw_bytes: int, group: Any, peers: tuple[int, ...],
                          me: int) -> tuple[Reduced, Any]:
        """Start summing over ``group`` a ``payload`` already in :meth:`fused_wire_dtype` (a shard of
        ``raw_bytes`` before the cast), in place: the dense reduction without the casts, with the same
        accounting. Returns that accounting and the collective's work (None when nothing is sent), which the
        caller waits on before reading ``payload``: the pipeline keeps two in flight, so that one chunk's
        collective starts while the previous one finishes."""
        wire = payload.numel() * payload.element_size()
        self.stats.add(raw_bytes, wire)
        work = dist.all_reduce(payload, group=group, async_op=True) if len(peers) > 1 else None
        return ring_accounted(raw_bytes, wire, peers, me), work

    def describe_buffer(self, name: Hashable, shapes: Sequence[Sequence[int]]) -> None:
        """The buffers allreduced under ``name`` pack tensors of ``shapes``, in order (DistributedOptimizer
        says so for each bucket). Compressors that see only flat buffers ignore it; PowerSGD compresses each
        tensor as its own matrix."""
        return None

    def shard_cuts(self, name: Hashable, numel: int, parts: int) -> list[int] | None:
        """Where the 2D algorithm should cut the buffer allreduced under ``name`` into ``parts`` node shards
        (``parts + 1`` element offsets from 0 to ``numel``), or None for equal shards.

        PowerSGD asks for cuts on row boundaries of the tensors the buffer packs, so that each shard is made
        of whole rows and each piece still compresses as a matrix of its own weight (see
        :func:`.layout.row_cuts`). Only consulted for a shard that goes in one chunk."""
        return None

    def forget(self, name: Hashable) -> None:
        """Drop what was kept for the allreduce named ``name`` (residuals, warm starts), so that a new model
        reusing the name does not inherit an old one's. The algorithms key their shards ``(name, where)``."""
        state = getattr(self, "state", None)
        if state is not None:
            for key in [k for k in state.keys() if isinstance(k, tuple) and k and k[0] == name]:
                state.reset(key)

    def wire_bytes(self, payload: Payload) -> int:
        """Bytes ``payload`` occupies on the wire."""
        return payload_nbytes(payload)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
