"""Gradient compression for communication: none, fp16, bf16, TopK and PowerSGD (both with error feedback).

The interface follows Horovod's ``horovod/torch/compression.py``: ``compress(tensor, key)`` returns
``(payload, ctx)``; the payload goes on the wire, ``ctx`` stays on this rank, and ``decompress(payload, ctx)``
rebuilds a dense tensor of the original shape and dtype. ``key`` names a gradient (or a fusion bucket) across
steps so that TopK can keep a residual per tensor (error feedback), in a slotted state object as PyTorch's
``PowerSGDState`` does. Every compressor counts raw and wire bytes in :class:`CompressionStats`.

Imports only torch and the standard library: this module runs on every rank. Specs (``topk:RATIO``,
``powersgd:RANK``, …) are values, :class:`.spec.CompressionSpec`; :func:`build` is the one place a spec becomes
a compressor. Each compressor also owns how its payload is reduced across ranks (:meth:`Compressor.reduce`).
The interface itself lives in :mod:`.base`.

>>> c = build(CompressionSpec.parse("topk:0.01:threshold=0"))
>>> payload, ctx = c.compress(grad, key="fc.weight")   # payload = [values, int32/int64 indices]
>>> grad_hat = c.decompress(payload, ctx)               # dense, zeros where nothing was sent
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..transport.reduction import Reduced, all_gather, pack, spread, unpack
from .base import NOTHING_SENT, CompressionStats, Compressor, Payload, alone
from .powersgd import PowerSGDCompressor
from .selection import top_indices
from .spec import DEFAULT_TOPK_RATIO, DEFAULT_TOPK_THRESHOLD, TOPK, CompressionSpec

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "TopKCompressor", "TopKState",
           "TopKContext", "PowerSGDCompressor", "CompressionStats", "Payload", "DEFAULT_TOPK_THRESHOLD",
           "DEFAULT_TOPK_RATIO", "parse_compression", "build"]

class NoneCompressor(Compressor):
    """No compression: the payload is the tensor itself, ``ctx`` is ``None``."""

    name = "none"

    def _compress(self, tensor: torch.Tensor, key: Hashable | None) -> tuple[Payload, Any]:
        return tensor, None

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        assert isinstance(payload, torch.Tensor)
        return payload

    def fused_wire_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        return dtype


class _CastCompressor(Compressor):
    """Casts floating tensors to ``wire_dtype``; ``ctx`` is the original dtype, or ``None`` if not cast."""

    wire_dtype: torch.dtype

    def _compress(self, tensor: torch.Tensor, key: Hashable | None) -> tuple[Payload, Any]:
        if not tensor.is_floating_point() or tensor.dtype == self.wire_dtype:
            return tensor, None
        return tensor.to(self.wire_dtype), tensor.dtype

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        assert isinstance(payload, torch.Tensor)
        return payload if ctx is None else payload.to(ctx)

    def fused_wire_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        return self.wire_dtype if dtype.is_floating_point else dtype


class FP16Compressor(_CastCompressor):
    """Half the bytes of float32; 10-bit mantissa, but overflows to inf above 65504."""

    name = "fp16"
    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Half the bytes of float32 with float32's range (no overflow), at a coarser 7-bit mantissa."""

    name = "bf16"
    wire_dtype = torch.bfloat16


@dataclass(frozen=True)
class TopKContext:
    """What a TopK receiver needs besides the payload: the original ``shape`` and ``dtype``.

    ``sparse`` is False when the tensor travelled dense (below threshold, empty, or not floating point);
    the payload is then the tensor itself.
    """

    shape: torch.Size
    dtype: torch.dtype
    sparse: bool


class TopKState:
    """Knobs and per-tensor residuals of :class:`TopKCompressor` (cf. PyTorch's ``PowerSGDState``)."""

    __slots__ = ("ratio", "threshold", "error_feedback", "residuals", "_magnitude", "_mask")

    def __init__(self, ratio: float, threshold: int, error_feedback: bool) -> None:
        # Fraction of entries sent per step. Lower saves bandwidth but delays the unsent mass by more steps;
        # 0.01 is what LightCC and the DGC paper use for large layers.
        self.ratio = ratio
        # Tensors with fewer elements go dense: sending (value, index) pairs and running topk on a small
        # tensor costs more than it saves, and small layers (biases, norms) are sensitive to staleness.
        self.threshold = threshold
        # Add back what was not sent last step before selecting. Without it the small coordinates are never
        # sent and training drifts; with it every coordinate is eventually applied (Stich et al., 2018).
        self.error_feedback = error_feedback
        # key -> flat tensor of (corrected gradient - what was sent), same dtype and device as the gradient.
        # Local to this rank; must be reset when the fusion buckets or the membership change.
        self.residuals: dict[Hashable, torch.Tensor] = {}
        # Scratch of the selection (|x| and |x| >= threshold), grown to the largest tensor seen and reused: a
        # fresh large tensor costs as much in page faults as the pass that fills it.
        self._magnitude: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    def buffers(self, like: torch.Tensor, mask: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A buffer of ``like``'s dtype and device with ``like.numel()`` elements, and (``mask``) a bool one
        rounded up to whole 8-byte words (the padding False, see :func:`_sparse_nonzero`), reused across calls
        (one compressor is driven by one thread: the communication thread). The GPU selection needs no mask."""
        n = like.numel()
        padded = -(-n // 8) * 8
        held = self._magnitude
        if held is None or held.numel() < n or held.dtype != like.dtype or held.device != like.device:
            self._magnitude = held = like.new_empty(n)
            self._mask = None
        if not mask:
            return held[:n], None
        if self._mask is None or self._mask.numel() < padded:
            self._mask = torch.empty(held.numel() + 8, dtype=torch.bool, device=like.device)
        bits = self._mask[:padded]
        bits[n:].zero_()
        return held[:n], bits

    def keys(self) -> list[Hashable]:
        return list(self.residuals)

    def reset(self, key: Hashable | None = None) -> None:
        """Forget every residual, or only ``key``'s (after a restore, a re-bucketing or an elastic change)."""
        if key is None:
            self.residuals.clear()
            self._magnitude = self._mask = None
        else:
            self.residuals.pop(key, None)


class TopKCompressor(Compressor):
    """Sends the ``k = max(1, ceil(ratio * numel))`` largest-magnitude entries, with error feedback.

    Payload: ``[values, indices]`` (values in the tensor's dtype; indices int32 when the tensor has fewer
    than 2**31 elements, else int64) and ``ctx`` a :class:`TopKContext`. Tensors below ``threshold``
    elements, empty tensors and non-floating tensors pass dense. Every rank sends the same ``k`` for a
    given tensor, so an allgather of fixed-size buffers followed by :meth:`merge` is a sparse allreduce.

    The selection is exact (a threshold estimated from a sample only narrows the candidates, see
    :func:`.selection._sampled_top`), and on the 2D algorithm it sees the whole shard: TopK does not pipeline in
    chunks (``pipelines = False``). Its wire is a small fraction of the dense bytes, so there is little network
    time to hide; chunks cost more than they overlap, and below 512K elements fall back to a full ``torch.topk``.

    >>> c = TopKCompressor(0.01, threshold=0)
    >>> payload, ctx = c.compress(grad, key="layer1.weight")
    >>> gathered = [payload_rank0, payload_rank1, ...]      # from an allgather
    >>> total = TopKCompressor.merge(gathered, ctx)          # dense sum over ranks
    """

    pipelines = False  # see the class docstring

    def __init__(self, ratio: float, threshold: int = DEFAULT_TOPK_THRESHOLD,
                 error_feedback: bool = True) -> None:
        super().__init__()
        ratio = TOPK.first.check(ratio, "topk ratio")
        threshold = TOPK.options[0].check(threshold, "topk threshold")
        self.state = TopKState(ratio, threshold, error_feedback)

    @property
    def name(self) -> str:  # type: ignore[override]
        """Its spec's canonical text (:attr:`.spec.CompressionSpec.name`), e.g. ``topk:0.01``."""
        return TOPK.format(self.state.ratio, threshold=self.state.threshold)

    def num_selected(self, numel: int) -> int:
        """How many entries a tensor of ``numel`` elements sends (the allgather buffer size)."""
        return min(numel, max(1, math.ceil(self.state.ratio * numel)))

    def _dense(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` travels dense: empty, not floating point, or under the threshold."""
        return tensor.numel() == 0 or tensor.numel() < self.state.threshold or not tensor.is_floating_point()

    def _compress(self, tensor: torch.Tensor, key: Hashable | None) -> tuple[Payload, Any]:
        if self._dense(tensor):
            return tensor, TopKContext(tensor.shape, tensor.dtype, sparse=False)
        return self._select(tensor, key)

    def _select(self, tensor: torch.Tensor, key: Hashable | None) -> tuple[Payload, Any]:
        numel = tensor.numel()
        corrected = self._corrected(tensor, key)
        k = self.num_selected(numel)
        indices = top_indices(corrected, k, self.state)
        values = corrected.index_select(0, indices)  # index_select: much faster than corrected[indices] on CPU
        if self.state.error_feedback:
            corrected.index_fill_(0, indices, 0)  # corrected is the residual buffer: now corrected - sent
        index_dtype = torch.int32 if numel < 2**31 else torch.int64
        return [values, indices.to(index_dtype)], TopKContext(tensor.shape, tensor.dtype, sparse=True)

    def _corrected(self, tensor: torch.Tensor, key: Hashable | None) -> torch.Tensor:
        """Flat ``tensor`` plus ``key``'s residual: the residual buffer itself, updated in place.

        Without error feedback: a flat view of ``tensor``, which the caller only reads.
        """
        flat = tensor.reshape(-1)
        if not self.state.error_feedback:
            return flat
        if key is None:
            raise ValueError("TopKCompressor with error feedback needs a key naming the tensor across steps, "
                             "e.g. compress(grad, key=param_name); or build it with error_feedback=False")
        residual = self.state.residuals.get(key)
        if residual is None:
            residual = self.state.residuals[key] = flat.clone(memory_format=torch.contiguous_format)
            return residual
        if residual.numel() != flat.numel() or residual.dtype != flat.dtype or residual.device != flat.device:
            raise ValueError(
                f"key {key!r} was a {residual.numel()}-element {residual.dtype} tensor on {residual.device}, "
                f"now {flat.numel()} elements {flat.dtype} on {flat.device}; call state.reset({key!r}) "
                "after changing buckets, or use a different key")
        return residual.add_(flat)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return self.merge([payload], ctx)

    def reduce(self, shard: torch.Tensor, key: Hashable, group: Any, peers: tuple[int, ...],
               me: int) -> Reduced:
        """A sparse allreduce: allgather every rank's ``k`` values and indices, then add them into ``shard``.

        Values and indices travel in one allgather (packed as bytes, :func:`.reduction.pack`): one collective's
        latency, not two, on the critical path. The merge writes straight into ``shard`` (zeroed, then an
        ``index_add_`` of each rank's entries): no dense tensor per peer, and no dense result to copy back.
        Tensors TopK leaves dense (below the threshold) take the dense allreduce. A group of one sends
        nothing and selects nothing (:func:`.base.alone`): the residual stays as it was.
        """
        if alone(peers):
            return NOTHING_SENT
        raw = shard.numel() * shard.element_size()
        if self._dense(shard):
            self.stats.add(raw, raw)
            return self._reduce_dense(shard, shard, TopKContext(shard.shape, shard.dtype, sparse=False), group,
                                      peers, me)
        with torch.no_grad():
            (values, indices), _ = self._select(shard, key)
        packed = pack(values, indices)
        wire = packed.numel()
        self.stats.add(raw, wire)
        g = len(peers)
        gathered = packed.new_empty(g * wire)
        all_gather(gathered, packed, group=group)
        flat = shard.view(-1)
        flat.zero_()
        for part in gathered.view(g, wire):
            flat.index_add_(0, *unpack(part, values, indices))
        return Reduced((g - 1) * raw, (g - 1) * wire, spread(peers, me, wire))

    @staticmethod
    def merge(payloads: Sequence[Payload], ctx: TopKContext) -> torch.Tensor:
        """Sum several ranks' payloads for one tensor into a dense tensor of ``ctx.shape``.

        Indices may repeat across ranks; their values add up. Dense payloads (``ctx.sparse`` False) are summed.
        """
        if not isinstance(ctx, TopKContext):
            raise TypeError(f"TopK merge needs a TopKContext, got {type(ctx).__name__}")
        if not payloads:
            raise ValueError("TopK merge needs at least one payload")
        if not ctx.sparse:
            dense = [p for p in payloads if isinstance(p, torch.Tensor)]
            if len(dense) != len(payloads):
                raise ValueError("TopK ctx says dense but a payload is a list; payloads and ctx do not match")
            if len(dense) == 1:
                return dense[0]
            return torch.stack([d.reshape(ctx.shape) for d in dense]).sum(0).to(ctx.dtype)
        out: torch.Tensor | None = None
        for payload in payloads:
            if isinstance(payload, torch.Tensor) or len(payload) != 2:
                raise ValueError("a sparse TopK payload is [values, indices]; payloads and ctx do not match")
            values, indices = payload
            if out is None:
                out = torch.zeros(math.prod(ctx.shape), dtype=ctx.dtype, device=values.device)
            out.index_add_(0, indices, values.to(ctx.dtype))
        assert out is not None
        return out.reshape(ctx.shape)


def build(spec: CompressionSpec) -> Compressor:
    """A new compressor for ``spec``: the one place that maps a spec's kind to a class. Each call gives a fresh
    one (its own residuals); :func:`.config.compressor_for` keeps one per spec for the allreduce."""
    if spec.kind == "topk":
        assert spec.ratio is not None and spec.threshold is not None
        return TopKCompressor(spec.ratio, spec.threshold)
    if spec.kind == "powersgd":
        assert spec.rank is not None and spec.warmup is not None and spec.min_size is not None
        return PowerSGDCompressor(spec.rank, warmup=spec.warmup, min_size=spec.min_size)
    simple: dict[str, type[Compressor]] = {"none": NoneCompressor, "fp16": FP16Compressor,
                                           "bf16": BF16Compressor}
    return simple[spec.kind]()


def parse_compression(spec: CompressionSpec | str | None) -> Compressor:
    """A new compressor from a spec (``taco.parse_compression``, kept for users): ``None``/``"none"``,
    ``"fp16"``, ``"bf16"``, ``"topk:RATIO[:threshold=N]"``, ``"powersgd:RANK[:warmup=N][:min_size=N]"`` or a
    :class:`.spec.CompressionSpec`, parsed by :meth:`.spec.CompressionSpec.parse`.

    >>> parse_compression("topk:0.01:threshold=1000").name
    'topk:0.01:threshold=1000'
    """
    return build(CompressionSpec.parse(spec))
