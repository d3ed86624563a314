"""PowerSGD (Vogels et al., 2019) as a taco compressor: ``powersgd:RANK[:warmup=N][:min_size=N]``.

A gradient viewed as an ``n x m`` matrix ``M`` is sent as two thin factors: ``P = M Q`` (``n x r``) is summed
over the group, orthogonalised, then ``Q = M^T P`` (``m x r``) is summed, and every rank rebuilds
``P Q^T``: ``(n + m) r`` numbers instead of ``n m``, in two small dense allreduces. As PyTorch's
``ddp_comm_hooks/powerSGD_hook.py`` does, it keeps error feedback (what the projection lost is added to the
next gradient: delayed, never dropped), warm-starts each step from the previous summed ``Q`` (the first from a
fixed seed, the same on every rank) and sends small tensors dense; the knobs are :class:`PowerSGDState`'s.

Shapes: a flat 1-D buffer (a fusion bucket, or on ``2d`` the shard that crosses nodes) is viewed as a
near-square matrix, as PyTorch's ``batched_powerSGD_hook`` does; a tensor of 2 or more dimensions as ``(shape[0],
rest)``, as its per-parameter hook does, and so is each tensor of a buffer whose layout is described
(:meth:`PowerSGDCompressor.describe_buffer`, :mod:`.layout`): with heavy momentum the square view of a fused
bucket loses too much. Half precision computes in float32 on the gradient's device, with no host sync.

Orthogonalisation is ``torch.linalg.qr``: cheaper than Gram-Schmidt, and a zero column (a gradient of lower
rank than ``r``) still comes out orthonormal instead of stuck at zero.

>>> c = PowerSGDCompressor(4, warmup=0, min_size=0)
>>> payload, ctx = c.compress(grad, key="fc.weight")   # [P, Q], the local factorisation
>>> grad_hat = c.decompress(payload, ctx)              # P Q^T, dense, grad's shape and dtype
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..transport.reduction import Reduced, ring_accounted
from .base import NOTHING_SENT, Compressor, Payload, alone
from .factors import compute_dtype, matrix_shape, orthonormal, summed
from .layout import packed_numel, pieces, row_cuts
from .spec import DEFAULT_POWERSGD_MIN_SIZE, DEFAULT_POWERSGD_WARMUP, POWERSGD

__all__ = ["PowerSGDCompressor", "PowerSGDState", "PowerSGDContext", "DEFAULT_POWERSGD_WARMUP",
           "DEFAULT_POWERSGD_MIN_SIZE"]


@dataclass(frozen=True)
class PowerSGDContext:
    """What a receiver needs besides ``[P, Q]``: the tensor's ``shape`` and ``dtype``, and the matrix view.

    ``lowrank`` is False when the tensor travelled dense (too small, not floating, or still warming up);
    the payload is then the tensor itself.
    """

    shape: torch.Size
    dtype: torch.dtype
    rows: int
    cols: int
    lowrank: bool


class PowerSGDState:
    """Knobs and per-tensor state of :class:`PowerSGDCompressor` (cf. PyTorch's ``PowerSGDState``)."""

    __slots__ = ("rank", "warmup", "min_size", "seed", "error_feedback", "residuals", "qs", "steps", "layouts")

    def __init__(self, rank: int, warmup: int, min_size: int, error_feedback: bool = True,
                 seed: int = 0) -> None:
        # Rank r of the approximation: the wire carries (n + m) r numbers per n x m matrix. 1-4 is usual;
        # higher keeps more of each step's gradient (less left to the residual) at more bytes and compute.
        self.rank = rank
        # Calls per key reduced dense before compressing (see spec.DEFAULT_POWERSGD_WARMUP).
        self.warmup = warmup
        # Tensors with fewer elements travel dense (see specs.DEFAULT_POWERSGD_MIN_SIZE).
        self.min_size = min_size
        # Keep what the projection lost and add it to the next gradient. Without it a rank-r projection
        # drops everything outside the top subspace every step and training stalls (the paper's Table 2).
        self.error_feedback = error_feedback
        # Seed of the first Q: every rank must project on the same Q, or the summed P means nothing.
        self.seed = seed
        # key -> flat (n * m) residual in the compute dtype, zero in the padding. Local to this rank.
        self.residuals: dict[Hashable, torch.Tensor] = {}
        # key -> the last summed Q (m x r), the warm start; the same on every rank of the group.
        self.qs: dict[Hashable, torch.Tensor] = {}
        # key -> calls so far, for the warm-up.
        self.steps: dict[Hashable, int] = {}
        # allreduce name -> shapes of the tensors its flat buffer packs (describe_buffer): each is then its own
        # matrix, as in PyTorch's per-parameter hook. A layer's gradient is low-rank as (out, in), not as a
        # square cut of a fused bucket (tests/mpi/powersgd.py holds the regression).
        self.layouts: dict[Hashable, tuple[torch.Size, ...]] = {}

    def keys(self) -> list[Hashable]:
        return list(self.steps)

    def reset(self, key: Hashable | None = None) -> None:
        """Forget every tensor's state, or only ``key``'s (after a restore, a re-bucketing or an elastic
        change); the next call starts again from the seeded Q (and warms up again)."""
        for table in (self.residuals, self.qs, self.steps):
            if key is None:
                table.clear()
            else:
                table.pop(key, None)


class PowerSGDCompressor(Compressor):
    """Rank-``r`` PowerSGD with error feedback and warm start; reduces itself in two small allreduces.

    Payload: ``[P, Q]`` in the compute dtype (float32 for half gradients), ``ctx`` a
    :class:`PowerSGDContext`. :meth:`compress` alone factorises one rank's tensor (what a group of one
    would send); :meth:`reduce` interleaves the two sums over the group between the steps.
    """

    # A 2D shard goes whole (cut on rows when described): chunks would each cost a rank-r factorisation of a
    # slice and would lose the warm start when the chunk size changes.
    pipelines = False

    def __init__(self, rank: int, warmup: int = DEFAULT_POWERSGD_WARMUP,
                 min_size: int = DEFAULT_POWERSGD_MIN_SIZE, error_feedback: bool = True, seed: int = 0) -> None:
        super().__init__()
        for option, value in zip((POWERSGD.first, *POWERSGD.options), (rank, warmup, min_size), strict=True):
            option.check(value, f"powersgd {option.key}")
        self.state = PowerSGDState(rank, warmup, min_size, error_feedback, seed)
        # (name, what) -> (the shapes it was derived from, the cuts or pieces): derived once per layout, not per
        # call on the allreduce path
        self._derived: dict[tuple[Hashable, tuple[Any, ...]], tuple[tuple[torch.Size, ...], Any]] = {}

    @property
    def name(self) -> str:  # type: ignore[override]
        """Its spec's canonical text (:attr:`.spec.CompressionSpec.name`), e.g. ``powersgd:4:warmup=0``."""
        return POWERSGD.format(self.state.rank, warmup=self.state.warmup, min_size=self.state.min_size)

    def compresses(self, tensor: torch.Tensor, key: Hashable | None) -> bool:
        """Whether ``tensor`` goes low-rank this call (else dense): floating, big enough, past warm-up, and
        its factors at most half the matrix (PyTorch's ``min_compression_rate`` of 2)."""
        numel = tensor.numel()
        if not tensor.is_floating_point() or numel < max(self.state.min_size, 1):
            return False
        if self.state.steps.get(key, 0) < self.state.warmup:
            return False
        rows, cols = matrix_shape(tensor.shape)
        return 2 * (rows + cols) * self.state.rank <= rows * cols

    def _count(self, key: Hashable | None) -> None:
        self.state.steps[key] = self.state.steps.get(key, 0) + 1

    def _forget_if_changed(self, tensor: torch.Tensor, key: Hashable | None) -> None:
        """Start ``key`` over when its tensor changed size, dtype or device since the last call.

        Why not an error (as TopK raises): the allreduce cannot tell when buckets change under a key (DDP
        rebuilds its buckets after the first iteration; a notebook re-runs a cell with another model), and
        every rank of the group sees the same change at the same call, so all of them start over alike.
        A same-size tensor under a reused key keeps the old residual: reset the key for a new model.
        """
        rows, cols = matrix_shape(tensor.shape)
        residual, q = self.state.residuals.get(key), self.state.qs.get(key)
        if residual is not None and (residual.numel() != rows * cols or residual.device != tensor.device
                                     or residual.dtype != compute_dtype(tensor.dtype)):
            self.state.reset(key)
        elif q is not None and (q.shape[0] != cols or q.device != tensor.device):
            self.state.reset(key)

    # ------------------------------------------------------------ the power iteration
    def _matrix(self, tensor: torch.Tensor, key: Hashable | None, rows: int, cols: int) -> torch.Tensor:
        """``tensor`` (plus ``key``'s residual) as a ``rows x cols`` matrix in the compute dtype.

        With error feedback this is the residual buffer itself, updated in place; ``tensor`` is only read.
        """
        flat = tensor.reshape(-1)
        numel, dtype = flat.numel(), compute_dtype(tensor.dtype)
        if not self.state.error_feedback:
            if numel == rows * cols and flat.dtype == dtype:
                return flat.view(rows, cols)
            padded = flat.new_zeros(rows * cols, dtype=dtype)
            padded[:numel].copy_(flat)
            return padded.view(rows, cols)
        if key is None:
            raise ValueError("PowerSGDCompressor needs a key naming the tensor across steps (its residual and "
                             "warm-start Q), e.g. compress(grad, key=param_name)")
        residual = self.state.residuals.get(key)
        if residual is None:
            residual = self.state.residuals[key] = flat.new_zeros(rows * cols, dtype=dtype)
        residual[:numel].add_(flat)
        return residual.view(rows, cols)

    def _start_q(self, key: Hashable | None, matrix: torch.Tensor) -> torch.Tensor:
        """The warm-start Q of ``key``, or the seeded first one (the same on every rank)."""
        q = self.state.qs.get(key)
        if q is None:
            generator = torch.Generator().manual_seed(self.state.seed)
            q = torch.randn(matrix.shape[1], self.state.rank, generator=generator, dtype=matrix.dtype)
            q = q.to(matrix.device)
        return q

    def _factorise(self, tensor: torch.Tensor, key: Hashable | None,
                   total: Callable[[torch.Tensor], None]) -> tuple[torch.Tensor, torch.Tensor, PowerSGDContext]:
        """One power iteration on ``tensor``; ``total`` sums a factor over the group in place (or not at all).

        Returns the orthonormal ``P`` (summed over the group), ``Q`` (summed) and the context. The residual
        becomes ``M - P Q_local^T``: this rank's part of the sum is ``P Q_local^T``, so sent + residual = M.
        """
        rows, cols = matrix_shape(tensor.shape)
        matrix = self._matrix(tensor, key, rows, cols)
        p = matrix @ self._start_q(key, matrix)
        total(p)
        p = torch.linalg.qr(p).Q
        # Q^T = P^T M, not M^T P: walking M by rows is much faster on CPU.
        qt = p.t() @ matrix
        if self.state.error_feedback:
            matrix.addmm_(p, qt, alpha=-1)
            matrix.view(-1)[tensor.numel():].zero_()  # the padding is not part of the gradient
        total(qt)
        q = self.state.qs[key] = qt.t()
        return p, q, PowerSGDContext(tensor.shape, tensor.dtype, rows, cols, lowrank=True)

    # ------------------------------------------------------------ the Compressor interface
    def _compress(self, tensor: torch.Tensor, key: Hashable | None) -> tuple[Payload, Any]:
        self._forget_if_changed(tensor, key)
        rows, cols = matrix_shape(tensor.shape)
        lowrank = self.compresses(tensor, key)
        self._count(key)
        if not lowrank:
            return tensor, PowerSGDContext(tensor.shape, tensor.dtype, rows, cols, lowrank=False)
        p, q, ctx = self._factorise(tensor, key, lambda factor: None)
        return [p, q], ctx

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        if not isinstance(ctx, PowerSGDContext):
            raise TypeError(f"PowerSGD decompress needs a PowerSGDContext, got {type(ctx).__name__}")
        if not ctx.lowrank:
            if not isinstance(payload, torch.Tensor):
                raise ValueError("PowerSGD ctx says dense but the payload is [P, Q]; payload and ctx do not match")
            return payload
        if isinstance(payload, torch.Tensor) or len(payload) != 2:
            raise ValueError("a low-rank PowerSGD payload is [P, Q]; payload and ctx do not match")
        p, q = payload
        numel = math.prod(ctx.shape)
        return (p @ q.t()).view(-1)[:numel].to(ctx.dtype).view(ctx.shape)

    def describe_buffer(self, name: Hashable, shapes: Sequence[Sequence[int]]) -> None:
        """Say that the flat buffer allreduced under ``name`` packs tensors of ``shapes``, in order.

        Each tensor of 2 or more dimensions is then compressed as its own ``(shape[0], rest)`` matrix and 1-D
        ones travel dense, in 3 collectives for the whole buffer (dense part, every P, every Q). On ``2d`` the
        node's shards are cut on row boundaries (:meth:`shard_cuts`), and each piece of a weight in a shard is
        its own matrix: a weight split between two local ranks is factorised as two blocks of rows.

        >>> compressor.describe_buffer(("bucket", 0), [p.shape for p in bucket.params])
        """
        self.state.layouts[name] = tuple(torch.Size(shape) for shape in shapes)

    def forget(self, name: Hashable) -> None:
        """Drop the residuals, warm starts and layout kept for ``name`` (a DDP bucket rebuilt, a model gone): the
        whole shards' keys ``(name, where)`` and the described tensors' ``((name, "flat"), index)``."""
        super().forget(name)
        for key in self.state.keys():
            if isinstance(key, tuple) and key and isinstance(key[0], tuple) and key[0][:1] == (name,):
                self.state.reset(key)
        self.state.layouts.pop(name, None)
        for derived in [k for k in self._derived if k[0] == name]:
            del self._derived[derived]

    def _geometry(self, name: Hashable, what: tuple[Any, ...],
                  derive: Callable[[tuple[torch.Size, ...]], Any]) -> Any:
        """``derive(shapes)`` of the shapes described for ``name``, cached per layout; None if none is described."""
        try:
            shapes = self.state.layouts.get(name)
        except TypeError:  # an unhashable name
            return None
        if shapes is None:
            return None
        held = self._derived.get((name, what))
        if held is None or held[0] is not shapes:
            held = self._derived[(name, what)] = (shapes, derive(shapes))
        return held[1]

    def shard_cuts(self, name: Hashable, numel: int, parts: int) -> list[int] | None:
        """Row-aligned cuts of a described buffer (:func:`.layout.row_cuts`), else None (equal shards)."""
        if parts < 2:
            return None
        return self._geometry(name, ("cuts", numel, parts),
                              lambda shapes: row_cuts(shapes, parts) if packed_numel(shapes) == numel else None)

    def _layout(self, shard: torch.Tensor, key: Hashable) -> tuple[torch.Size, ...] | None:
        """The shapes ``shard`` packs: a described buffer reduced whole by the flat algorithm (key
        ``(name, "flat")``), or a row-aligned 2D shard ``[lo, hi)`` of one (key ``(name, "2d", lo, hi)``)."""
        numel = shard.numel()
        if isinstance(key, tuple) and len(key) == 2 and key[1] == "flat":
            return self._geometry(key[0], ("flat", numel), lambda s: s if packed_numel(s) == numel else None)
        if isinstance(key, tuple) and len(key) == 4 and key[1] == "2d" and key[3] - key[2] == numel:
            return self._geometry(key[0], ("2d", key[2], key[3]), lambda s: pieces(s, key[2], key[3]) or None)
        return None

    def reduce(self, shard: torch.Tensor, key: Hashable, group: Any, peers: tuple[int, ...],
               me: int) -> Reduced:
        """Sum ``shard`` over ``group`` in place: allreduce ``P``, orthogonalise, allreduce ``Q``, rebuild.

        On ``2d`` the group is the cross-node one, so only what crosses nodes is compressed. Tensors left
        dense (small, warming up) take the base class's dense allreduce. A group of one factorises
        nothing (:func:`.base.alone`): no warm-up step counted, no residual kept.
        """
        if alone(peers):
            return NOTHING_SENT
        shapes = self._layout(shard, key)
        if shapes is not None:
            with torch.no_grad():
                return self._reduce_tensors(shard, key, shapes, group, peers, me)
        self._forget_if_changed(shard, key)
        lowrank = self.compresses(shard, key)
        self._count(key)
        raw = shard.numel() * shard.element_size()
        if not lowrank:
            self.stats.add(raw, raw)
            dense = PowerSGDContext(shard.shape, shard.dtype, *matrix_shape(shard.shape), lowrank=False)
            return self._reduce_dense(shard, shard, dense, group, peers, me)
        with torch.no_grad():
            p, q, ctx = self._factorise(shard, key, lambda factor: dist.all_reduce(factor, group=group))
            out = shard.view(ctx.rows, ctx.cols) if shard.numel() == ctx.rows * ctx.cols else None
            if out is not None and out.dtype == p.dtype:
                torch.mm(p, q.t(), out=out)
            else:
                shard.copy_((p @ q.t()).view(-1)[: shard.numel()])
        wire = (p.numel() + q.numel()) * p.element_size()
        self.stats.add(raw, wire)
        return ring_accounted(raw, wire, peers, me)

    def _reduce_tensors(self, shard: torch.Tensor, key: Hashable, shapes: tuple[torch.Size, ...], group: Any,
                        peers: tuple[int, ...], me: int) -> Reduced:
        """:meth:`reduce` of a buffer packing ``shapes``: one allreduce of every dense tensor, one of
        every P, one of every Q (as PyTorch's hook batches them)."""
        views, offset = [], 0
        for index, shape in enumerate(shapes):
            numel = math.prod(shape)
            views.append(((key, index), shard[offset: offset + numel].view(shape)))
            offset += numel
        low: list[tuple[Hashable, torch.Tensor]] = []
        dense: list[tuple[Hashable, torch.Tensor]] = []
        for sub, view in views:
            self._forget_if_changed(view, sub)
            (low if view.dim() >= 2 and self.compresses(view, sub) else dense).append((sub, view))
            self._count(sub)
        wire = 0
        if dense:
            flat = torch.cat([view.reshape(-1) for _, view in dense])
            dist.all_reduce(flat, group=group)
            torch._foreach_copy_([view for _, view in dense], [  # type: ignore[arg-type]
                part.view(view.shape) for part, (_, view) in zip(flat.split([v.numel() for _, v in dense]),
                                                                 dense, strict=True)])
            wire += flat.numel() * flat.element_size()
        if low:
            mats = [self._matrix(view, sub, *matrix_shape(view.shape)) for sub, view in low]
            ps = summed([m @ self._start_q(sub, m) for (sub, _), m in zip(low, mats, strict=True)], group)
            ps = orthonormal(ps)
            qts = [p.t() @ m for p, m in zip(ps, mats, strict=True)]
            if self.state.error_feedback:
                for p, qt, m in zip(ps, qts, mats, strict=True):
                    m.addmm_(p, qt, alpha=-1)
            qts = summed(qts, group)
            for (low_key, view), p, qt in zip(low, ps, qts, strict=True):
                self.state.qs[low_key] = qt.t()
                if view.dtype == p.dtype:  # straight into the buffer: no full-size product to copy
                    torch.mm(p, qt, out=view.view(p.shape[0], qt.shape[1]))
                else:
                    view.copy_((p @ qt).view(view.shape))
                wire += (p.numel() + qt.numel()) * p.element_size()
        raw = shard.numel() * shard.element_size()
        self.stats.add(raw, wire)
        return ring_accounted(raw, wire, peers, me)
