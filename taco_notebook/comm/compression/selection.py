"""TopK's selection of the ``k`` largest-magnitude entries, by device: the GPU's own ``torch.topk`` on an
accelerator (no host sync), a sampled threshold and a ranking of the few candidates on a CPU (where a full
``torch.topk`` is slow).

Only the choice of indices: the compressor, its residuals and its reduction are in :mod:`.compressors`.
``scratch`` is the compressor's :class:`.compressors.TopKState` (a :class:`Scratch`), whose reused buffers the
passes write into.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

__all__ = ["selection_for", "Scratch"]


class Scratch(Protocol):
    """Where the passes write: reused buffers the size of the tensor (:class:`.compressors.TopKState`)."""

    def buffers(self, like: torch.Tensor, mask: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]: ...

# Entries sampled to estimate the top-k threshold of a large tensor (see _sampled_top): one in 64, within
# these bounds. The upper bound keeps ranking the sample a small part of the selection.
_SAMPLE_SIZE = 1 << 17
_MIN_SAMPLE = 1 << 15
# Candidates aimed at, in multiples of k: the first try, then a retry if the sample misjudged. A sample of
# 2**15 estimates the fraction above the threshold within a few percent, so 1.25·k misses only on skewed
# data; fewer candidates make the ranking cheaper.
_CANDIDATE_FACTORS = (1.25, 4.0)


def top_indices(values: torch.Tensor, k: int, scratch: Scratch) -> torch.Tensor:
    """Indices (int64) of the ``k`` largest-magnitude entries of the 1-D ``values``: the exact top-k, chosen
    by the selection suited to the tensor's device (:func:`selection_for`)."""
    return selection_for(values.device)(values, k, scratch)


def selection_for(device: torch.device) -> Callable[[torch.Tensor, int, Scratch], torch.Tensor]:
    """The top-k selection for tensors on ``device``: :func:`_device_top` on an accelerator, else
    :func:`_sampled_top` (tuned for the CPU). Chosen by the device type alone, never by looking at values."""
    return _sampled_top if device.type == "cpu" else _device_top


def _device_top(values: torch.Tensor, k: int, scratch: Scratch) -> torch.Tensor:
    """The GPU's own ``torch.topk`` of ``|values|``: one kernel chain on the current stream, no host sync.

    Why not :func:`_sampled_top` on a GPU: its ``nonzero`` passes and ranking each wait for the device to tell
    the host a size (a stream sync each), where ``torch.topk`` stays on the device. Ties at the k-th magnitude
    go wherever the kernel puts them (the set is exact up to ties).
    """
    magnitude, _ = scratch.buffers(values, mask=False)
    torch.abs(values, out=magnitude)
    return torch.topk(magnitude, k, sorted=False).indices


def _sampled_top(values: torch.Tensor, k: int, scratch: Scratch) -> torch.Tensor:
    """The exact top-k of a CPU tensor, in ascending index order, without ranking every entry.

    Why not ``torch.topk`` alone on a CPU: it ranks every entry, many times slower on large tensors, on the critical
    path (``benchmarks/topk_select.py``). A threshold estimated from a strided sample (aiming at 1.25·k survivors)
    leaves a few candidates, in ascending order, and only those are ranked (:func:`_exact_top`): most of the time goes
    in the full passes (``|x|`` and ``>= threshold`` into ``scratch``'s reused buffers, then :func:`_sparse_nonzero`).
    If the sample misjudged and fewer than ``k`` survive, a lower threshold (4·k survivors) and then the full topk
    run: the result is the exact top-k either way (among equal magnitudes at the k-th place, the lowest indices).
    """
    n = values.numel()
    if n < 4 * _SAMPLE_SIZE or 8 * k > n:
        return torch.topk(values.abs(), k, sorted=False).indices
    sample = values[:: n // min(max(n // 64, _MIN_SAMPLE), _SAMPLE_SIZE)].abs()
    magnitude, mask = scratch.buffers(values)
    assert mask is not None
    torch.abs(values, out=magnitude)
    for factor in _CANDIDATE_FACTORS:
        keep = min(sample.numel(), math.ceil(factor * k * sample.numel() / n))
        threshold = torch.topk(sample, keep, sorted=False).values.min()
        torch.ge(magnitude, threshold, out=mask[:n])
        candidates = _sparse_nonzero(mask)
        if candidates.numel() >= k:
            return _exact_top(candidates, magnitude.index_select(0, candidates), k)
    return torch.topk(magnitude, k, sorted=False).indices


def _sparse_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Ascending indices of the True entries of a sparse bool ``mask`` whose length is a multiple of 8:
    ``nonzero`` over its 8-byte words, then only inside the words that hold one: at TopK's densities few
    words do, so this is cheaper than ``mask.nonzero()``, the costliest pass of the selection."""
    words = mask.view(torch.int64).nonzero().view(-1)
    hits = mask.view(-1, 8).index_select(0, words).nonzero()
    return words.index_select(0, hits[:, 0]).mul_(8).add_(hits[:, 1])


def _exact_top(candidates: torch.Tensor, magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` of ``candidates`` (ascending indices, of ``magnitude``) with the largest magnitudes, still in
    ascending order (cache-friendly for the gather, the residual update and the merge that follow). Ties at
    the k-th magnitude go to the lowest indices."""
    if candidates.numel() == k:
        return candidates
    kth = torch.kthvalue(magnitude, magnitude.numel() - k + 1).values
    chosen = magnitude > kth
    short = k - int(chosen.sum())
    if short > 0:
        chosen[(magnitude == kth).nonzero().view(-1)[:short]] = True
    return candidates.index_select(0, chosen.nonzero().view(-1))
