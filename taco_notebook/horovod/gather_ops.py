"""Horovod's data-moving collectives (``hvd.broadcast``, ``allgather``, ``alltoall`` and their async and in-place
forms) over comm/'s, with Horovod's meaning: out-of-place calls return new tensors and are differentiable (the
gradients of allgather and broadcast are averaged over ranks, as Horovod's), ``*_async`` calls return handles
for :func:`~.mpi_ops.synchronize`, ``process_set=`` runs them among the set's ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.collectives import ops as collectives
from .basics import Average, check_process_set
from .mpi_ops import UNCOMPRESSED, check_tensor, named, new_handle, reduce_now, synchronize

__all__ = [
    "allgather",
    "allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
]


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> int:
    """Start gathering every rank's ``tensor`` along dimension 0 (first dimensions may differ)."""
    check_tensor(tensor, "allgather_async")
    group = check_process_set(process_set)
    with named("allgather", name) as reserved:
        return new_handle(collectives.allgather_async(tensor, name, group), reserved=reserved)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, process_set: Any) -> torch.Tensor:
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.scalar = tensor.dim() == 0
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor.detach(), name, process_set))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # Horovod averages the incoming gradients over ranks (each rank's loss saw the whole gathered tensor)
        averaged = reduce_now(grad, grad.detach().clone(), Average, None, 1.0, 1.0, UNCOMPRESSED, ctx.process_set)
        group = check_process_set(ctx.process_set)
        rows = collectives.allgather(torch.tensor([ctx.rows], dtype=torch.int64), group=group)
        from .basics import rank

        position = rank() if group is None else group.ranks.index(rank())
        offset = int(rows[:position].sum())
        mine = averaged.narrow(0, offset, ctx.rows)
        return (mine.reshape(()) if ctx.scalar else mine), None, None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """A new tensor: every rank's ``tensor`` concatenated along dimension 0, in rank order."""
    check_tensor(tensor, "allgather")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allgather.apply(tensor, name, process_set)  # type: ignore[no-any-return]
    return synchronize(allgather_async(tensor, name, process_set))  # type: ignore[no-any-return]


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> int:
    """Start copying ``root_rank``'s ``tensor`` into every rank's, in place."""
    check_tensor(tensor, "broadcast_async_")
    group = check_process_set(process_set)
    with named("broadcast", name) as reserved:
        return new_handle(collectives.broadcast_async(tensor, root_rank, name, group), reserved=reserved)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> int:
    """Start broadcasting a copy of ``tensor`` (which is not changed) from ``root_rank``."""
    check_tensor(tensor, "broadcast_async")
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Any, process_set: Any) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        from .basics import rank

        # Horovod: the root's gradient is the average of every rank's; the others' inputs did not reach the output
        averaged = reduce_now(grad, grad.detach().clone(), Average, None, 1.0, 1.0, UNCOMPRESSED, ctx.process_set)
        return (averaged if rank() == ctx.root_rank else averaged.zero_()), None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor`` on every rank (``tensor`` is not changed)."""
    check_tensor(tensor, "broadcast")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Broadcast.apply(tensor, root_rank, name, process_set)  # type: ignore[no-any-return]
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))  # type: ignore[no-any-return]


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """Copy ``root_rank``'s ``tensor`` into every rank's ``tensor``, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))  # type: ignore[no-any-return]


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None) -> int:
    """Start an alltoall; :func:`synchronize` gives ``(output, received_splits)``."""
    check_tensor(tensor, "alltoall_async")
    group = check_process_set(process_set)
    with named("alltoall", name) as reserved:
        return new_handle(collectives.alltoall_async(tensor, splits, name, group), reserved=reserved)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Any, process_set: Any) -> Any:
        output, received = synchronize(alltoall_async(tensor.detach(), splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[Any, ...]:
        group = check_process_set(ctx.process_set)
        back, _received = collectives.alltoall(grad.contiguous(), ctx.received.tolist(), group=group)
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` to rank ``i`` (equal parts without ``splits``); the rows received,
    in rank order, and with ``splits`` also how many rows came from each rank (``(output, received_splits)``)."""
    check_tensor(tensor, "alltoall")
    if tensor.requires_grad and torch.is_grad_enabled():
        output, received = _Alltoall.apply(tensor, splits, name, process_set)
    else:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received)
