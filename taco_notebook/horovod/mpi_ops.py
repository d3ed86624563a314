"""Horovod's allreduces, handles, barrier and join over comm/'s collectives (broadcast, allgather, alltoall:
:mod:`.gather_ops`).

Horovod's meaning, taco's engine: ``allreduce`` returns a new tensor and averages by default, ``allreduce_``
works in place; ``*_async`` calls return an integer handle for :func:`poll` and :func:`synchronize`. Every
call goes through :mod:`taco_notebook.comm.collectives.ops` on comm/'s one communication thread, so Horovod calls,
``taco.*`` calls and ``DistributedOptimizer`` buckets keep one order on every rank. Out-of-place calls are
differentiable. ``name=`` keys TopK's error feedback; integers averaged are summed, then divided and truncated
toward zero (as Horovod).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ..comm import StallError
from ..comm.collectives import agreement
from ..comm.collectives import ops as collectives
from ..comm.compression.spec import CompressionSpec
from ..comm.state import state
from .basics import Average, ReduceOp, check_initialized, check_process_set, comm_op, reduce_op, size
from .compression import Compression, spec_of

__all__ = [
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "poll",
    "synchronize",
    "join",
    "barrier",
]

UNCOMPRESSED = CompressionSpec("none")  # what crosses for ops other than sum/avg, and for a custom Compressor

_handles: dict[int, tuple[Future[Any], Callable[[Any], Any], str | None]] = {}
_next_handle = itertools.count(1)
_in_flight: dict[str, int] = {}  # "allreduce.NAME" -> its handle, until synchronized


class HorovodInternalError(RuntimeError):
    """A collective failed because the job broke (a peer died or stalled), as Horovod's: elastic code catches it
    to restore its state and go on. Ranks that merely disagree get a RuntimeError (CollectiveMismatchError)."""


def _reserve(kind: str, name: Any) -> str | None:
    """Horovod's rule: no two operations of a kind with one name in flight; raise before anything starts.

    In flight means not yet synchronized, which every rank decides alike (completion would race)."""
    if name is None:
        return None
    key = f"{kind}.{name}"
    if key in _in_flight:
        raise ValueError(
            f"hvd.{kind}: an operation named {name!r} is already in flight (handle "
            f"{_in_flight[key]}); synchronize it before starting another with the same name"
        )
    return key


@contextmanager
def named(kind: str, name: Any) -> Iterator[str | None]:
    """:func:`_reserve` the name; what the block submits is matched by name, as Horovod's coordinator does
    (``comm/collectives/byname.py``): a named operation one rank starts before the others reach it waits for them."""
    reserved = _reserve(kind, name)
    with state.comm_thread.by_name(reserved is not None):
        yield reserved


def new_handle(
    future: Future[Any], finish: Callable[[Any], Any] = lambda result: result, reserved: str | None = None
) -> int:
    handle = next(_next_handle)
    _handles[handle] = (future, finish, reserved)
    if reserved is not None:
        _in_flight[reserved] = handle
    return handle


def poll(handle: int) -> bool:
    """True once the operation behind ``handle`` finished (``synchronize`` will then not block)."""
    if handle not in _handles:
        raise ValueError(f"unknown handle {handle!r}: it was never returned by an *_async call, or was synchronized")
    future = _handles[handle][0]
    if not future.done():
        state.comm_thread.unpark(future)  # someone looks for it: it runs in order from now on (byname.py)
    return future.done()


def synchronize(handle: int) -> Any:
    """Wait for the operation behind ``handle`` and return its output (``None`` for an unknown handle, as
    Horovod); the handle is released."""
    if handle not in _handles:
        return None
    future, finish, reserved = _handles.pop(handle)
    if reserved is not None:
        _in_flight.pop(reserved, None)
    if not future.done():
        state.comm_thread.unpark(future)  # parked (collectives/byname.py): it runs in order, as this rank waits for it
    try:
        result = future.result()
    except (StallError, dist.DistBackendError) as error:
        raise HorovodInternalError(str(error)) from error
    finally:
        state.comm_thread.awaited_done(future)
    return finish(result)


def check_tensor(tensor: Any, what: str) -> None:
    check_initialized()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"hvd.{what} needs a torch.Tensor, got {type(tensor).__name__}")


def _start_allreduce(
    tensor: torch.Tensor,
    output: torch.Tensor,
    op: ReduceOp,
    name: Any,
    prescale: float,
    postscale: float,
    spec: CompressionSpec,
    process_set: Any,
) -> tuple[Future[Any], Callable[[Any], Any]]:
    """Reduce ``output`` (``tensor`` itself, or a copy of it) in place with the engine."""
    group = check_process_set(process_set)
    integer_mean = op is Average and not (output.is_floating_point() or output.is_complex())
    key = name if name is not None else ("hvd", tensor.data_ptr(), tensor.numel())  # stable for TopK's residual
    future = collectives.allreduce_async(
        output,
        "sum" if integer_mean else comm_op(op),
        compression=spec if op in (Average, ReduceOp.SUM) and group is None else None,
        name=name,
        key=key,
        prescale=float(prescale),
        postscale=float(postscale),
        group=group,
    )
    members = size() if group is None else group.size

    def finish(result: torch.Tensor) -> torch.Tensor:
        return result.div_(members, rounding_mode="trunc") if integer_mean else result

    return future, finish


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> int:
    """Start reducing a copy of ``tensor`` (which is not changed); returns a handle for :func:`synchronize`."""
    check_tensor(tensor, "allreduce_async")
    found = reduce_op(op, average)
    output = tensor.detach().clone()
    with named("allreduce", name) as reserved:
        return new_handle(
            *_start_allreduce(tensor, output, found, name, prescale_factor, postscale_factor, UNCOMPRESSED,
                              process_set),
            reserved,
        )


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> int:
    """Start reducing ``tensor`` in place; returns a handle for :func:`synchronize`."""
    check_tensor(tensor, "allreduce_async_")
    found = reduce_op(op, average)
    with named("allreduce", name) as reserved:
        return new_handle(
            *_start_allreduce(tensor, tensor, found, name, prescale_factor, postscale_factor, UNCOMPRESSED,
                              process_set),
            reserved,
        )


def reduce_now(
    tensor: torch.Tensor,
    output: torch.Tensor,
    op: ReduceOp,
    name: Any,
    prescale: float,
    postscale: float,
    spec: CompressionSpec,
    process_set: Any,
) -> torch.Tensor:
    future, finish = _start_allreduce(tensor, output, op, name, prescale, postscale, spec, process_set)
    return finish(future.result())  # type: ignore[no-any-return]


class _Allreduce(torch.autograd.Function):
    """Differentiable out-of-place allreduce: the gradient of a sum (or mean) is the sum (or mean) of the
    gradients, with the same factors, as Horovod's ``HorovodAllreduce``."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        op: ReduceOp,
        name: Any,
        prescale: float,
        postscale: float,
        spec: CompressionSpec,
        process_set: Any,
    ) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale, ctx.process_set = op, prescale, postscale, process_set
        return reduce_now(tensor, tensor.detach().clone(), op, name, prescale, postscale, spec, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = reduce_now(
            grad, grad.detach().clone(), ctx.op, None, ctx.prescale, ctx.postscale, UNCOMPRESSED, ctx.process_set
        )
        return reduced, None, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over every rank (averaged unless ``op`` says otherwise).

    ``compression``: an ``hvd.Compression`` member runs inside taco's allreduce; a user's own Horovod
    ``Compressor`` is applied around it, as Horovod does.
    """
    check_tensor(tensor, "allreduce")
    found = reduce_op(op, average)
    spec = spec_of(compression)
    payload, cctx = (tensor, None) if spec is not None else compression.compress(tensor)
    differentiable = found in (Average, ReduceOp.SUM) and payload.requires_grad and torch.is_grad_enabled()
    if differentiable:
        out = _Allreduce.apply(
            payload, found, name, prescale_factor, postscale_factor, spec or UNCOMPRESSED, process_set
        )
    else:
        out = reduce_now(
            payload,
            payload.detach().clone(),
            found,
            name,
            prescale_factor,
            postscale_factor,
            spec or UNCOMPRESSED,
            process_set,
        )
    return out if spec is not None else compression.decompress(out, cctx)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over every rank in place (averaged unless ``op`` says otherwise); returns it."""
    op, average = reduce_op(op, average), None  # the deprecation warning names the caller's line
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))  # type: ignore[no-any-return]


def barrier(process_set: Any = None) -> None:
    """Wait until every rank (of ``process_set``) reaches this point."""
    check_initialized()
    collectives.barrier(check_process_set(process_set))


def join(device: int = -1) -> int:
    """Finish this rank's work: until every rank called ``join()``, take part in the allreduces the others still
    run with zeros (so an average counts this rank as zeros, as Horovod's); return the rank that joined last.

    Other collectives (allgather, broadcast, alltoall) run by ranks that did not join raise on those ranks
    while a rank has joined. ``device`` is accepted for compatibility (zeros go where the others' tensors are).
    """
    check_initialized()

    def feed_zeros(sig: agreement.Signature) -> None:
        device_of = state.device if sig.device == "cuda" else torch.device("cpu")
        zeros = torch.zeros(sig.shape or (), dtype=getattr(torch, sig.dtype or "float32"), device=device_of)
        work, _ = collectives._allreduce_job(
            zeros, sig.op or "sum", sig.compression, sig.algorithm, sig.name, 1.0, 1.0, check=False
        )
        work()

    arrivals = state.comm_thread.run(lambda: agreement.run_joined(feed_zeros))
    return int(max(range(len(arrivals)), key=lambda r: arrivals[r]))
