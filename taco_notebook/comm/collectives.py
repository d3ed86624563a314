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

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from . import agreement, bootstrap, groups
from .compression.spec import CompressionSpec
from .stall import tracked
from .state import state
from .transport import streams

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

REDUCE_OPS = ("sum", "avg", "min", "max", "product")


def _ready() -> None:
    if not bootstrap.is_initialized():
        bootstrap.init()


def _check_tensor(tensor: Any, what: str) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")


def _wider(dtype: Any) -> Any:
    """The dtype a reduction of ``dtype`` travels in when gloo has no kernel for it (None: it has one).

    Sums wrap as they would in the narrow type once cast back; uint64 goes as int64 (same bits for sums)."""
    import torch

    return {
        torch.int16: torch.int32,
        torch.uint16: torch.int32,
        torch.uint32: torch.int64,
        torch.uint64: torch.int64,
    }.get(dtype)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous, at least 1-d) seen as rows of uint8, its first dimension kept, when gloo lacks its
    dtype (broadcast, allgather, alltoall only move bytes); the tensor itself otherwise."""
    import math

    import torch

    if _wider(tensor.dtype) is None or tensor.is_cuda:
        return tensor
    return tensor.reshape(tensor.shape[0], math.prod(tensor.shape[1:])).view(torch.uint8)


def _checked(
    sig: agreement.Signature,
    work: Callable[[], Any],
    extra: int = 0,
    then: Callable[[list[int]], Any] | None = None,
    group: Any = None,
) -> Callable[[], Any]:
    """``work`` preceded, on the communication thread, by the agreement of the ranks (of ``group``, a torch
    group; None: all) on ``sig``; ``then`` (if given) runs instead of ``work`` with every rank's ``extra``."""

    def run() -> Any:
        _ready()
        if not agreement.enabled():
            return work() if then is None else then([])
        extras = tracked("agree", sig.name, lambda: agreement.agree(sig, extra, group))()
        return work() if then is None else then(extras)

    return run


def _refuse(kind: str, error: BaseException, group: Any = None) -> BaseException:
    """Tell the other ranks (of ``group``) this call failed here (they raise, naming it, instead of waiting);
    return ``error``. Only while the process group is up: before it, nothing is waiting."""
    if bootstrap.is_initialized() and agreement.enabled():
        sig = agreement.invalid(kind, error)
        state.comm_thread.submit(tracked("agree", None, lambda: agreement.agree(sig, 0, group)))
    return error


def _in_place(tensor: torch.Tensor, collective: Any) -> torch.Tensor:
    """Run ``collective`` on a contiguous buffer and write the result back into ``tensor``."""
    if tensor.numel() == 0:
        return tensor
    if tensor.is_contiguous():
        collective(tensor)
        return tensor
    buffer = tensor.contiguous()
    collective(buffer)
    tensor.copy_(buffer)
    return tensor


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

    ``name`` is what ranks agree on; ``key`` (default ``name``) keys TopK's error feedback."""
    pg = groups.resolve(group)
    try:
        _check_tensor(tensor, "allreduce")
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
        wide = _wider(tensor.dtype) if not tensor.is_cuda else None
        work, future = _reduce_work(
            tensor if wide is None else tensor.to(wide),
            op,
            compression,
            algorithm,
            name if key is None else key,
            prescale,
            postscale,
            group,
        )
    except (TypeError, ValueError) as error:
        raise (_refuse("allreduce", error, pg) if check else error) from None
    if wide is not None:
        reduce_wide = work

        def work() -> torch.Tensor:
            return tensor.copy_(reduce_wide())

    return (_checked(sig, work, group=pg) if check else work), future


def _reduce_work(
    tensor: torch.Tensor,
    op: str,
    compression: CompressionSpec | str | None,
    algorithm: str | None,
    name: Any,
    prescale: float,
    postscale: float,
    group: groups.SubGroup | None = None,
) -> tuple[Callable[[], torch.Tensor], Future[Any]]:
    """Sum/avg over every rank: the accelerated path (:mod:`.algorithms`); anything else, or over a group: the
    backend's allreduce."""
    import torch.distributed as dist

    from .algorithms import _check, _job, scale_

    if op in ("sum", "avg") and group is None:
        return _job(tensor, op, compression, algorithm, name, prescale, postscale)
    if op in ("sum", "avg"):
        _check(tensor, op)
    reduce_op = {
        "sum": dist.ReduceOp.SUM,
        "avg": dist.ReduceOp.SUM,
        "min": dist.ReduceOp.MIN,
        "max": dist.ReduceOp.MAX,
        "product": dist.ReduceOp.PRODUCT,
    }[op]
    pg = groups.resolve(group)

    def reduce(buf: torch.Tensor) -> None:
        scale_(buf, prescale)
        dist.all_reduce(buf, op=reduce_op, group=pg)
        if op == "avg":
            buf.div_(dist.get_world_size(pg))
        scale_(buf, postscale)

    def work() -> torch.Tensor:
        _ready()
        return _in_place(tensor, reduce)

    return streams.on_comm_stream(tensor, tracked("allreduce", name, work))


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
        _check_tensor(tensor, "broadcast")
        _check_root(root, group)
    except (TypeError, ValueError) as error:
        raise _refuse("broadcast", error, pg) from None
    sig = agreement.describe_tensor("broadcast", tensor, name, root=root)

    def send(buf: torch.Tensor) -> None:
        dist.broadcast(_as_bytes(buf.reshape(-1)), src=root, group=pg)

    def work() -> torch.Tensor:
        return _in_place(tensor, send)

    return streams.on_comm_stream(tensor, _checked(sig, tracked("broadcast", name, work), group=pg))


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


def _caller_stream(tensor: torch.Tensor) -> Any:
    """The submitting thread's current CUDA stream for ``tensor``'s device (None on CPU)."""
    import torch

    return torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None


def _output(tensor: torch.Tensor, caller: Any) -> torch.Tensor:
    """A new tensor made on the comm stream and handed to the caller: tell the caching allocator the caller's
    stream uses it too, so its memory is not reused on the comm stream while the caller still reads it."""
    if caller is not None:
        tensor.record_stream(caller)
    return tensor


def _gathered_counts(count: int, device: Any, group: Any = None) -> list[int]:
    """Every rank's ``count``, in rank order (a collective: call on the communication thread)."""
    import torch
    import torch.distributed as dist

    from .transport.reduction import all_gather

    mine = torch.tensor([count], dtype=torch.int64, device=device)
    every = mine.new_empty(dist.get_world_size(group))
    all_gather(every, mine, group=group)
    return [int(c) for c in every.tolist()]


def _allgather_job(
    tensor: torch.Tensor, name: Any = None, group: groups.SubGroup | None = None
) -> tuple[Callable[[], torch.Tensor], Future[Any]]:
    """Concatenate every rank's ``tensor`` along the first dimension into a new tensor (same on every rank).

    First dimensions may differ between ranks (the rest must match); a 0-d tensor counts as one row, so
    the result has one entry per rank. Rows are padded to the longest rank's for the backend's allgather.
    The row counts ride on the agreement exchange (one collective fewer).
    """
    import torch

    from .transport.reduction import all_gather

    pg = groups.resolve(group)
    try:
        _check_tensor(tensor, "allgather")
    except TypeError as error:
        raise _refuse("allgather", error, pg) from None
    rows = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
    caller = _caller_stream(rows)
    sig = agreement.describe_tensor("allgather", rows, name, rows_may_differ=True)

    def gather(counts: list[int]) -> torch.Tensor:
        counts = counts or _gathered_counts(rows.shape[0], rows.device, pg)
        longest = max(counts)
        padded = (
            rows
            if rows.shape[0] == longest
            else torch.cat([rows, rows.new_zeros((longest - rows.shape[0], *rows.shape[1:]))])
        )
        out = _output(rows.new_empty((longest * len(counts), *rows.shape[1:])), caller)
        if out.numel():
            all_gather(_as_bytes(out), _as_bytes(padded), group=pg)
        if all(c == longest for c in counts):
            return out
        return _output(torch.cat([out[i * longest : i * longest + c] for i, c in enumerate(counts)]), caller)

    def work() -> torch.Tensor:
        return _checked(
            sig,
            lambda: None,
            extra=rows.shape[0],
            then=lambda counts: tracked("allgather", name, lambda: gather(counts))(),
            group=pg,
        )()

    return streams.on_comm_stream(rows, work)


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
        _check_tensor(tensor, "alltoall")
        sends = _alltoall_sends(tensor, splits, state.ensure_topology().size if group is None else group.size)
    except (TypeError, ValueError) as error:
        raise _refuse("alltoall", error, pg) from None
    source = tensor.contiguous()
    caller = _caller_stream(source)
    sig = agreement.describe_tensor("alltoall", source, name, rows_may_differ=True)

    def work() -> tuple[torch.Tensor, torch.Tensor]:
        sent = torch.tensor(sends, dtype=torch.int64, device=source.device)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=pg)
        counts = [int(c) for c in received.tolist()]
        out = _output(source.new_empty((sum(counts), *source.shape[1:])), caller)
        dist.all_to_all_single(
            _as_bytes(out), _as_bytes(source), output_split_sizes=counts, input_split_sizes=sends, group=pg
        )
        return out, received.cpu()

    return streams.on_comm_stream(source, _checked(sig, tracked("alltoall", name, work), group=pg))


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


def barrier(group: groups.SubGroup | None = None) -> None:
    """Wait until every rank (of ``group``) reaches this point."""
    import torch.distributed as dist

    pg = groups.resolve(group)

    def work() -> None:
        dist.barrier(group=pg)

    state.comm_thread.run(_checked(agreement.Signature("barrier"), tracked("barrier", None, work), group=pg))


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
