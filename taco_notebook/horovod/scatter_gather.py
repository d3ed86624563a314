"""Horovod's reducescatter, grouped allgather and reducescatter, and sparse allreduce, over comm/'s collectives.

``reducescatter`` averages by default (Horovod's ``op=Average``) and hands each rank its share of the first
dimension (the first ``rows % size`` ranks one row more); it is differentiable (the gradient is the
allgather of the incoming gradients, times the member count for Sum, as Horovod). ``sparse_allreduce_async``
gathers the indices and values of a sparse tensor from every rank and returns a callable giving the sum (or
average) as a sparse tensor, as Horovod's does (duplicate indices are left uncoalesced; ``coalesce()`` sums them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..comm.collectives import ops as collectives
from ..comm.collectives import scatter
from .basics import Average, ReduceOp, check_process_set, comm_op, reduce_op, size
from .gather_ops import allgather, allgather_async
from .mpi_ops import check_tensor, named, new_handle, synchronize

__all__ = [
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "sparse_allreduce_async",
]


def _scatter_op(op: Any) -> tuple[ReduceOp, str]:
    found = reduce_op(op)
    if found not in (Average, ReduceOp.SUM):
        raise ValueError(f"hvd.reducescatter supports op=hvd.Average or hvd.Sum, got {found.name.title()}")
    return found, comm_op(found)


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor * factor`` in Horovod's precision: float64 for integers, float32 for 16-bit floats, then cast back
    (integers truncated toward zero), so a scaled int tensor stays an int tensor."""
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point() and tensor.dtype not in (torch.float16, torch.bfloat16):
        return tensor * factor
    wide = torch.float32 if tensor.is_floating_point() else torch.float64
    return (tensor.to(wide) * factor).to(tensor.dtype)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start a reducescatter; :func:`~.mpi_ops.synchronize` gives this rank's rows of the reduced tensor."""
    check_tensor(tensor, "reducescatter_async")
    group = check_process_set(process_set)
    found, how = _scatter_op(op)
    source = tensor.detach()
    integer_mean = found is Average and not (source.is_floating_point() or source.is_complex())
    source = _scaled(source, prescale_factor)
    with named("reducescatter", name) as reserved:
        future = scatter.reduce_scatter_async(source, "sum" if integer_mean else how, name, group)
    members = size() if group is None else group.size

    def finish(part: torch.Tensor) -> torch.Tensor:
        if integer_mean:
            part = part.div_(members, rounding_mode="trunc")
        return _scaled(part, postscale_factor)

    return new_handle(future, finish, reserved)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, op: Any, process_set: Any) -> torch.Tensor:
        ctx.op, ctx.group = reduce_op(op), check_process_set(process_set)
        return synchronize(reducescatter_async(tensor, name, op, process_set))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # Horovod's convention (its test_horovod_reducescatter_grad*): the allgather of the incoming gradients,
        # times the member count for Sum, as is for Average
        gathered = collectives.allgather(grad.contiguous(), group=ctx.group)
        members = size() if ctx.group is None else ctx.group.size
        return (gathered if ctx.op is Average else gathered * members), None, None, None


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = None,
    op: Any = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over every rank (averaged by default), this rank's rows of it."""
    check_tensor(tensor, "reducescatter")
    if tensor.requires_grad and torch.is_grad_enabled() and prescale_factor == postscale_factor == 1.0:
        return _ReduceScatter.apply(tensor, name, op, process_set)  # type: ignore[no-any-return]
    handle = reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor)
    return synchronize(handle)  # type: ignore[no-any-return]


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: Any = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """:func:`reducescatter_async` of every tensor, one handle for the list of results."""
    handles = [
        reducescatter_async(
            t, None if name is None else f"{name}.{i}", op, process_set, prescale_factor, postscale_factor
        )
        for i, t in enumerate(tensors)
    ]
    return _list_handle(handles)


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: Any = None,
    op: Any = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """:func:`reducescatter` of every tensor in the list."""
    return [
        reducescatter(
            t, None if name is None else f"{name}.{i}", compression, op, process_set, prescale_factor, postscale_factor
        )
        for i, t in enumerate(tensors)
    ]


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None, process_set: Any = None) -> int:
    """:func:`~.gather_ops.allgather_async` of every tensor, one handle for the list of results."""
    return _list_handle(
        [allgather_async(t, None if name is None else f"{name}.{i}", process_set) for i, t in enumerate(tensors)]
    )


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: Any = None
) -> list[torch.Tensor]:
    """:func:`~.gather_ops.allgather` of every tensor in the list (differentiable as each is)."""
    return [allgather(t, None if name is None else f"{name}.{i}", process_set) for i, t in enumerate(tensors)]


def _list_handle(handles: list[int]) -> int:
    from concurrent.futures import Future

    done: Future[Any] = Future()
    done.set_result(None)
    return new_handle(done, lambda _: [synchronize(h) for h in handles])


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: Any = Average, process_set: Any = None
) -> Callable[[], torch.Tensor]:
    """Start summing (or averaging) a sparse ``tensor`` over every rank: its indices and values are allgathered.

    Returns a callable that waits and gives the result as a sparse tensor of ``tensor``'s size, as Horovod's.
    """
    if not (isinstance(tensor, torch.Tensor) and tensor.is_sparse):
        raise TypeError(f"hvd.sparse_allreduce_async needs a sparse torch.Tensor, got {type(tensor).__name__}")
    found = reduce_op(op)
    if found not in (Average, ReduceOp.SUM):
        raise ValueError(f"hvd.sparse_allreduce_async supports op=hvd.Average or hvd.Sum, got {found.name.title()}")
    indices = allgather_async(tensor._indices().transpose(0, 1).contiguous(), f"{name}.indices", process_set)
    values = allgather_async(tensor._values(), f"{name}.values", process_set)

    def wait() -> torch.Tensor:
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if found is Average:
            group = check_process_set(process_set)
            gathered_values = gathered_values / (size() if group is None else group.size)
        return torch.sparse_coo_tensor(gathered_indices.transpose(0, 1), gathered_values, tensor.size(),
                                       check_invariants=True)  # indices from other ranks: checked

    return wait
