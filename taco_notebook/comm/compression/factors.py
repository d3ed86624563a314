"""The linear algebra of PowerSGD on its factors: the matrix view of a tensor, the compute dtype, the
orthonormalisation of many ``P`` at once, and the sum of many small factors in one allreduce.

The compressor, its state and its reductions are in :mod:`.powersgd`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["matrix_shape"]


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """The ``(rows, cols)`` a tensor is viewed as: ``(shape[0], rest)``, or near-square for 1-D ones
    (padded with at most ``cols - 1`` zeros)."""
    numel = math.prod(shape)
    if len(shape) >= 2 and numel:
        return shape[0], numel // shape[0]
    cols = max(1, math.isqrt(max(numel - 1, 0)) + 1) if numel > 1 else 1
    return -(-numel // cols), cols


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32 and the half types compute in float32 (QR needs it, and the
    residual of a half gradient would lose what it is meant to keep)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def orthonormal(ps: list[torch.Tensor]) -> list[torch.Tensor]:
    """``torch.linalg.qr(p).Q`` of each ``p``, one batched QR per distinct shape: a model's weights come in a
    few shapes, so a few QRs (each several kernels on a GPU) instead of one per weight. On a CPU the batch runs
    the same LAPACK call per matrix, so the result is the same to the bit."""
    by_shape: dict[tuple[torch.Size, torch.dtype], list[int]] = {}
    for index, p in enumerate(ps):
        by_shape.setdefault((p.shape, p.dtype), []).append(index)
    out: list[torch.Tensor] = list(ps)
    for indices in by_shape.values():
        if len(indices) == 1:
            out[indices[0]] = torch.linalg.qr(ps[indices[0]]).Q
            continue
        for index, q in zip(indices, torch.linalg.qr(torch.stack([ps[i] for i in indices])).Q.unbind(0), strict=True):
            out[index] = q
    return out


def summed(factors: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """Sum several small matrices over ``group`` in one allreduce (latency, not bytes, is their cost)."""
    flat = torch.cat([f.reshape(-1) for f in factors])
    dist.all_reduce(flat, group=group)
    return [part.view(f.shape) for part, f in zip(flat.split([f.numel() for f in factors]), factors, strict=True)]
