"""Allgather and alltoall over every rank (or a group): new tensors whose first dimension comes from each rank.

First dimensions may differ between ranks, the others must match (checked by :mod:`.agreement`, which also
carries allgather's row counts). Every dtype torch has works (gloo's missing ones travel as bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ..diagnostics.stall import tracked
from ..state import state
from ..transport import streams
from . import agreement, groups
from .checked import as_bytes, caller_stream, check_tensor, gathered_counts, handed_to_caller, refuse, run_checked

if TYPE_CHECKING:
    import torch

__all__ = ["allgather", "allgather_async", "alltoall", "alltoall_async"]


def _allgather_job(
    tensor: torch.Tensor, name: Any = None, group: groups.SubGroup | None = None
) -> tuple[Callable[[], torch.Tensor], Future[Any]]:
    """Concatenate every rank's ``tensor`` along the first dimension into a new tensor (same on every rank).

    First dimensions may differ between ranks (the rest must match); a 0-d tensor counts as one row, so
    the result has one entry per rank. Rows are padded to the longest rank's for the backend's allgather.
    The row counts ride on the agreement exchange (one collective fewer).
    """
    import torch

    from ..transport.reduction import all_gather

    pg = groups.resolve(group)
    try:
        check_tensor(tensor, "allgather")
    except TypeError as error:
        raise refuse("allgather", error, pg) from None
    rows = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
    caller = caller_stream(rows)
    sig = agreement.describe_tensor("allgather", rows, name, rows_may_differ=True)

    def gather(counts: list[int]) -> torch.Tensor:
        counts = counts or gathered_counts(rows.shape[0], rows.device, pg)
        longest = max(counts)
        padded = (
            rows
            if rows.shape[0] == longest
            else torch.cat([rows, rows.new_zeros((longest - rows.shape[0], *rows.shape[1:]))])
        )
        out = handed_to_caller(rows.new_empty((longest * len(counts), *rows.shape[1:])), caller)
        if out.numel():
            all_gather(as_bytes(out), as_bytes(padded), group=pg)
        if all(c == longest for c in counts):
            return out
        return handed_to_caller(torch.cat([out[i * longest : i * longest + c] for i, c in enumerate(counts)]), caller)

    work = run_checked(sig, lambda: None, extra=rows.shape[0], then=gather, group=pg)
    return streams.on_comm_stream(rows, tracked("allgather", name, work))


def allgather(tensor: torch.Tensor, name: Any = None, group: groups.SubGroup | None = None) -> torch.Tensor:
    """Every rank's (of ``group``) ``tensor`` concatenated along dimension 0, first dimensions may differ (see
    :func:`_allgather_job`); a new tensor, the same on every rank."""
    return state.comm_thread.run(*_allgather_job(tensor, name, group))


def allgather_async(
    tensor: torch.Tensor, name: Any = None, group: groups.SubGroup | None = None
) -> Future[torch.Tensor]:
    """:func:`allgather` started on the communication thread."""
    return state.comm_thread.submit(*_allgather_job(tensor, name, group))


def _alltoall_sends(tensor: torch.Tensor, splits: Any, size: int) -> list[int]:
    import torch

    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor of at least one dimension, got a 0-d tensor")
    rows = tensor.shape[0]
    if splits is None:
        if rows % size:
            raise ValueError(
                f"alltoall without splits needs the first dimension ({rows}) to divide by the "
                f"number of ranks ({size}); pass splits=[rows for each rank]"
            )
        return [rows // size] * size
    if isinstance(splits, torch.Tensor) and (splits.is_floating_point() or splits.is_complex()):
        raise ValueError(f"alltoall splits must hold integers, got a {splits.dtype} tensor")
    sends = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(sends) != size or min(sends) < 0 or sum(sends) != rows:
        raise ValueError(
            f"alltoall splits must be {size} non-negative counts summing to the first dimension ({rows}), got {sends}"
        )
    return sends


def _alltoall_job(
    tensor: torch.Tensor, splits: Sequence[int] | None, name: Any = None, group: groups.SubGroup | None = None
) -> tuple[Callable[[], tuple[torch.Tensor, torch.Tensor]], Future[Any]]:
    """Send ``splits[i]`` rows of ``tensor`` (in order along dimension 0) to rank ``i``; receive from each.

    ``splits`` defaults to equal parts (the first dimension must then divide by the rank count). The future
    yields ``(received, received_splits)``: the rows from every rank in rank order, and how many came from each.
    """
    import torch
    import torch.distributed as dist

    pg = groups.resolve(group)
    try:
        check_tensor(tensor, "alltoall")
        sends = _alltoall_sends(tensor, splits, state.ensure_topology().size if group is None else group.size)
    except (TypeError, ValueError) as error:
        raise refuse("alltoall", error, pg) from None
    source = tensor.contiguous()
    caller = caller_stream(source)
    sig = agreement.describe_tensor("alltoall", source, name, rows_may_differ=True)

    def work() -> tuple[torch.Tensor, torch.Tensor]:
        sent = torch.tensor(sends, dtype=torch.int64, device=source.device)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=pg)
        counts = [int(c) for c in received.tolist()]
        out = handed_to_caller(source.new_empty((sum(counts), *source.shape[1:])), caller)
        dist.all_to_all_single(
            as_bytes(out), as_bytes(source), output_split_sizes=counts, input_split_sizes=sends, group=pg
        )
        return out, received.cpu()

    return streams.on_comm_stream(source, tracked("alltoall", name, run_checked(sig, work, group=pg)))


def alltoall(
    tensor: torch.Tensor, splits: Sequence[int] | None = None, name: Any = None, group: groups.SubGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send ``splits[i]`` rows of ``tensor`` to rank ``i`` (of ``group``: its ``i``-th rank; equal parts by
    default); returns ``(received, received_splits)``: the rows from every rank in rank order, and how many
    came from each."""
    return state.comm_thread.run(*_alltoall_job(tensor, splits, name, group))


def alltoall_async(
    tensor: torch.Tensor, splits: Sequence[int] | None = None, name: Any = None, group: groups.SubGroup | None = None
) -> Future[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`alltoall` started on the communication thread."""
    return state.comm_thread.submit(*_alltoall_job(tensor, splits, name, group))
