"""Horovod's grouped allreduces: each tensor of a list reduced as by :mod:`.mpi_ops`, one handle (or list) for
all; a name becomes ``name.0``, ``name.1``, ... per tensor."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from .basics import reduce_op
from .compression import Compression
from .mpi_ops import allreduce, allreduce_async, allreduce_async_, new_handle, synchronize

__all__ = ["grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_"]


def _grouped(
    tensors: Sequence[torch.Tensor], start: Callable[..., int], name: str | None, kwargs: dict[str, Any]
) -> int:
    handles = [start(t, name=None if name is None else f"{name}.{i}", **kwargs) for i, t in enumerate(tensors)]
    future: Future[Any] = Future()
    future.set_result(None)
    return new_handle(future, lambda _: [synchronize(h) for h in handles])


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> int:
    """:func:`allreduce_async` of every tensor, one handle for the list of results."""
    op, average = reduce_op(op, average), None  # the deprecation warning names the caller's line
    return _grouped(
        tensors,
        allreduce_async,
        name,
        dict(
            average=average,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=process_set,
        ),
    )


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> int:
    """:func:`allreduce_async_` of every tensor, one handle for the list."""
    op, average = reduce_op(op, average), None  # the deprecation warning names the caller's line
    return _grouped(
        tensors,
        allreduce_async_,
        name,
        dict(
            average=average,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=process_set,
        ),
    )


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list[torch.Tensor]:
    """:func:`allreduce` of every tensor in the list (new tensors)."""
    op, average = reduce_op(op, average), None  # the deprecation warning names the caller's line
    return [
        allreduce(
            t,
            average,
            None if name is None else f"{name}.{i}",
            compression,
            op,
            prescale_factor,
            postscale_factor,
            process_set,
        )
        for i, t in enumerate(tensors)
    ]


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list[torch.Tensor]:
    """:func:`allreduce_` of every tensor in the list (in place)."""
    op, average = reduce_op(op, average), None  # the deprecation warning names the caller's line
    return synchronize(
        grouped_allreduce_async_(
            tensors,
            average,
            name,
            op,
            prescale_factor,  # type: ignore
            postscale_factor,
            process_set,
        )
    )
