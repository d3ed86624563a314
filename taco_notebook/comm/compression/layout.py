"""Where a flat buffer of packed tensors may be cut so that each part is made of whole rows.

A fusion bucket packs several parameters' gradients end to end. The 2D allreduce gives each local rank one
shard of it to send across nodes; PowerSGD compresses a weight as a ``(shape[0], rest)`` matrix, which only
means something when the shard holds whole rows of it. :func:`row_cuts` moves each equal-share cut to the
nearest row boundary of the tensor it falls in (a shard is then off its equal share by less than one row),
and :func:`pieces` says what a shard ``[lo, hi)`` holds: the tail rows of one tensor, whole tensors, the
head rows of another, each a matrix of its own::

    bucket:  | fc1.weight 256 x 512 ............ | fc1.bias | fc2.weight 10 x 256 |
    cut:                         ^ row 164 of fc1.weight (the equal share, rounded to a row)
    shard 0: fc1.weight[:164]                    shard 1: fc1.weight[164:], fc1.bias, fc2.weight

A 1-D tensor (a bias) has no rows: a cut may fall anywhere in it, and it travels dense anyway.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import torch

__all__ = ["row_cuts", "pieces", "packed_numel"]


def packed_numel(shapes: Sequence[Sequence[int]]) -> int:
    """Elements a buffer packing tensors of ``shapes`` holds."""
    return sum(math.prod(shape) for shape in shapes)


def _spans(shapes: Sequence[Sequence[int]]) -> tuple[list[int], list[int], list[int]]:
    """Each tensor's first element in the buffer, its element count and its row length (1 for a 1-D one)."""
    offsets, sizes, cols, offset = [], [], [], 0
    for shape in shapes:
        numel = math.prod(shape)
        offsets.append(offset)
        sizes.append(numel)
        cols.append(numel // shape[0] if len(shape) >= 2 and numel else 1)
        offset += numel
    return offsets, sizes, cols


def row_cuts(shapes: Sequence[Sequence[int]], parts: int) -> list[int]:
    """``parts + 1`` offsets from 0 to the buffer's size, each inner one the row boundary nearest to an equal
    share (non-decreasing: a part may be empty when one row is larger than a share).

    >>> row_cuts([(4, 10), (5,)], 2)   # 45 elements: the share 22 falls in row 2 of the first tensor
    [0, 20, 45]
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    offsets, sizes, cols = _spans(shapes)
    total = sum(sizes)
    cuts = [0]
    for i in range(1, parts):
        share = round(i * total / parts)
        j = bisect.bisect_right(offsets, share) - 1
        while j > 0 and sizes[j] == 0:  # an empty tensor starts where the next one does
            j -= 1
        cut = share if share >= total else offsets[j] + round((share - offsets[j]) / cols[j]) * cols[j]
        cuts.append(min(max(cut, cuts[-1]), total))
    cuts.append(total)
    return cuts


def pieces(shapes: Sequence[Sequence[int]], lo: int, hi: int) -> tuple[torch.Size, ...] | None:
    """The shapes of what elements ``[lo, hi)`` of the buffer hold, in order: whole rows of each tensor of 2 or
    more dimensions (``(rows, *shape[1:])``), any run of a 1-D one. None when a bound splits a row (the cut
    did not come from :func:`row_cuts` of the same shapes) or lies outside the buffer."""
    offsets, sizes, cols = _spans(shapes)
    if not 0 <= lo <= hi <= sum(sizes):
        return None
    found: list[torch.Size] = []
    for shape, offset, size, row in zip(shapes, offsets, sizes, cols, strict=True):
        start, end = max(lo, offset), min(hi, offset + size)
        if end <= start:
            continue
        if len(shape) < 2:
            found.append(torch.Size([end - start]))
        elif (start - offset) % row or (end - start) % row:
            return None
        else:
            found.append(torch.Size([(end - start) // row, *shape[1:]]))
    return tuple(found)
