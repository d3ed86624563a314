"""Collectives on tensors over every rank: allreduce, broadcast, allgather, alltoall, barrier, parameter broadcast.

Each call brings the process group up on first use, so a plain ``mpiexec -n 4 python train.py`` needs no
set-up call, and is watched by the stall watchdog (:mod:`.stall`). allreduce and broadcast change tensors in
place (and return them, for chaining), as in Horovod's ``allreduce_``; allgather and alltoall make new tensors.
Every collective runs on the communication thread (:mod:`.state`), so ``*_async`` calls and gradient buckets
keep one order on every rank.

Before moving data, the ranks agree on what they run (:mod:`.agreement`): a different shape, dtype, root or op
on one rank raises the same :class:`~.agreement.CollectiveMismatchError` on every rank, and a call that fails
its own checks on one rank only makes the others raise instead of wait. Every dtype torch has works: the few
gloo lacks (int16, uint16, uint32, uint64) travel widened (reductions) or as bytes (the others).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ..compression.spec import CompressionSpec
from ..diagnostics.stall import tracked
from ..state import state
from ..transport import streams
from . import agreement, groups
from .checked import REDUCE_OPS, as_bytes, check_tensor, ensure_ready, in_place, refuse, run_checked, wider_dtype
from .gather import allgather, allgather_async, alltoall, alltoall_async

if TYPE_CHECKING:
    import torch

__all__ = [
    "allreduce",
    "allreduce_async",
    "broadcast",
    "broadcast_async",
    "allgather",
    "allgather_async",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast_parameters",
    "REDUCE_OPS",
]


def _allreduce_sig(
    tensor: torch.Tensor, op: str, compression: Any, algorithm: str | None, name: Any
) -> agreement.Signature:
    spec = CompressionSpec.parse(compression)
    return agreement.describe_tensor(
        "allreduce", tensor, name, op=op, compression=None if spec.kind == "none" else str(spec), algorithm=algorithm
    )


def _allreduce_job(
    tensor: torch.Tensor,
    op: str,
    compression: CompressionSpec | str | None,
    algorithm: str | None,
    name: Any,
    prescale: float,
    postscale: float,
    check: bool = True,
    key: Any = None,
    group: groups.SubGroup | None = None,
) -> tuple[Callable[[], torch.Tensor], Future[Any]]:
    """Validate now (errors surface in the caller); the returned work runs on the communication thread.

    ``name`` is what ranks agree on; ``key`` (default ``name``) keys TopK's error feedback. ``check=False``:
    no agreement first (a rank inside ``join()`` feeding zeros to an allreduce the others agreed on)."""
    pg = groups.resolve(group)
    try:
        check_tensor(tensor, "allreduce")
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {', '.join(REDUCE_OPS)}; got {op!r}")
        if op not in ("sum", "avg") and CompressionSpec.parse(compression).kind != "none":
            raise ValueError(f"compression applies to op='sum' or 'avg' only, not {op!r}")
        if group is not None and (CompressionSpec.parse(compression).kind != "none" or algorithm is not None):
            raise ValueError(
                "an allreduce over a group runs uncompressed on the backend's algorithm: pass no "
                "compression or algorithm with group="
            )
        sig = _allreduce_sig(tensor, op, compression, algorithm, name)
        wide = wider_dtype(tensor.dtype) if not tensor.is_cuda else None
        buffer = tensor if wide is None else tensor.to(wide)
        reduce = _reduce_work(buffer, op, compression, algorithm, name if key is None else key, prescale, postscale, pg)
    except (TypeError, ValueError) as error:
        raise (refuse("allreduce", error, pg) if check else error) from None

    def work() -> torch.Tensor:
        reduced = reduce()
        return reduced if wide is None else tensor.copy_(reduced)

    job = run_checked(sig, work, group=pg) if check else work
    return streams.on_comm_stream(tensor, tracked("allreduce", name, job))


def _reduce_work(
    tensor: torch.Tensor,
    op: str,
    compression: CompressionSpec | str | None,
    algorithm: str | None,
    key: Any,
    prescale: float,
    postscale: float,
    pg: Any,
) -> Callable[[], torch.Tensor]:
    """The reduction of ``tensor`` in place, to run on the communication thread (validated now). Sum/avg over
    every rank: the accelerated path (:mod:`.algorithms`, compressed, flat or 2D); anything else, or over a
    group (``pg``): the backend's allreduce."""
    import torch.distributed as dist

    from ..compression.compressors import NoneCompressor
    from ..config import check_algorithm, compressor_for
    from .algorithms import check_reducible, reduce_in_place, resolve_algorithm, scale_

    if op in ("sum", "avg"):
        check_reducible(tensor, op)
    if op in ("sum", "avg") and pg is None:
        compressor = compressor_for(compression) if tensor.is_floating_point() else NoneCompressor()
        if algorithm is not None:
            check_algorithm(algorithm)
        stable = key if key is not None else ("ptr", tensor.data_ptr(), tensor.numel())

        def accelerated() -> torch.Tensor:
            resolved = resolve_algorithm(algorithm)  # may build groups: collective, so on this thread
            return reduce_in_place(tensor, op, compressor, resolved, stable, prescale, postscale)

        return accelerated
    reduce_op = {
        "sum": dist.ReduceOp.SUM,
        "avg": dist.ReduceOp.SUM,
        "min": dist.ReduceOp.MIN,
        "max": dist.ReduceOp.MAX,
        "product": dist.ReduceOp.PRODUCT,
    }[op]

    def reduce(buf: torch.Tensor) -> None:
        scale_(buf, prescale)
        dist.all_reduce(buf, op=reduce_op, group=pg)
        if op == "avg":
            buf.div_(dist.get_world_size(pg))
        scale_(buf, postscale)

    def backend() -> torch.Tensor:
        ensure_ready()
        return in_place(tensor, reduce)

    return backend


def allreduce(
    tensor: torch.Tensor,
    op: str = "sum",
    compression: CompressionSpec | str | None = None,
    algorithm: str | None = None,
    name: Any = None,
    *,
    prescale: float = 1.0,
    postscale: float = 1.0,
    group: groups.SubGroup | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (or ``group``'s, see :mod:`.groups`) in place; ``op`` is one of
    :data:`REDUCE_OPS`.

    ``sum`` and ``avg`` take the accelerated path (:mod:`.algorithms`: flat or 2D hierarchical, optionally
    compressed, ``name`` keying TopK's error feedback); ``min``, ``max`` and ``product`` use the backend's.
    ``prescale``/``postscale`` multiply the input before and the result after (Horovod's factors). Ranks
    that disagree on the shape, dtype or op raise :class:`~.agreement.CollectiveMismatchError`, all of them.

    >>> t = torch.ones(3); taco.allreduce(t, op="avg")   # every rank now holds the mean
    """
    return state.comm_thread.run(
        *_allreduce_job(tensor, op, compression, algorithm, name, prescale, postscale, group=group)
    )


def allreduce_async(
    tensor: torch.Tensor,
    op: str = "sum",
    compression: CompressionSpec | str | None = None,
    algorithm: str | None = None,
    name: Any = None,
    *,
    prescale: float = 1.0,
    postscale: float = 1.0,
    key: Any = None,
    group: groups.SubGroup | None = None,
) -> Future[torch.Tensor]:
    """:func:`allreduce` started on the communication thread; the future yields ``tensor`` when done.
    ``key`` (default ``name``) keys TopK's error feedback where ``name`` is not stable."""
    return state.comm_thread.submit(
        *_allreduce_job(tensor, op, compression, algorithm, name, prescale, postscale, key=key, group=group)
    )


def _check_root(root: int, group: groups.SubGroup | None = None) -> None:
    size = state.ensure_topology().size
    if not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"root must be a rank in 0..{size - 1}, got {root!r}")
    if group is not None and root not in group.ranks:
        raise ValueError(f"root must be one of {group!r}'s ranks, got {root}")


def _broadcast_job(
    tensor: torch.Tensor, root: int, name: Any = None, group: groups.SubGroup | None = None
) -> tuple[Callable[[], torch.Tensor], Future[Any]]:
    import torch.distributed as dist

    pg = groups.resolve(group)
    try:
        check_tensor(tensor, "broadcast")
        _check_root(root, group)
    except (TypeError, ValueError) as error:
        raise refuse("broadcast", error, pg) from None
    sig = agreement.describe_tensor("broadcast", tensor, name, root=root)

    def send(buf: torch.Tensor) -> None:
        dist.broadcast(as_bytes(buf.reshape(-1)), src=root, group=pg)

    def work() -> torch.Tensor:
        return in_place(tensor, send)

    return streams.on_comm_stream(tensor, tracked("broadcast", name, run_checked(sig, work, group=pg)))


def broadcast(
    tensor: torch.Tensor, root: int = 0, name: Any = None, group: groups.SubGroup | None = None
) -> torch.Tensor:
    """Copy ``root``'s ``tensor`` into every rank's (of ``group``, a global rank as ``root``) in place."""
    return state.comm_thread.run(*_broadcast_job(tensor, root, name, group))


def broadcast_async(
    tensor: torch.Tensor, root: int = 0, name: Any = None, group: groups.SubGroup | None = None
) -> Future[torch.Tensor]:
    """:func:`broadcast` started on the communication thread; the future yields ``tensor`` when done."""
    return state.comm_thread.submit(*_broadcast_job(tensor, root, name, group))


def barrier(group: groups.SubGroup | None = None) -> None:
    """Wait until every rank (of ``group``) reaches this point."""
    import torch.distributed as dist

    pg = groups.resolve(group)

    def work() -> None:
        dist.barrier(group=pg)

    state.comm_thread.run(tracked("barrier", None, run_checked(agreement.Signature("barrier"), work, group=pg)))


def broadcast_parameters(params: Any, root: int = 0) -> None:
    """Make every rank's parameters and buffers equal to ``root``'s.

    Accepts a ``torch.nn.Module``, a ``state_dict()`` or an iterable of ``(name, tensor)`` pairs, like
    Horovod's ``broadcast_parameters``; call it once after building the model.
    """
    import torch

    if isinstance(params, torch.nn.Module):
        items = list(params.state_dict(keep_vars=True).items())
    elif isinstance(params, dict):
        items = list(params.items())
    else:
        items = list(params)
    for name, value in sorted(items, key=lambda item: item[0]):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(value).__name__}, not a tensor")
        with torch.no_grad():
            broadcast(value.data if isinstance(value, torch.nn.Parameter) else value, root)
