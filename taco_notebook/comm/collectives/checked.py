"""What every collective of comm/ shares: bring the group up, check the tensor, agree first, refuse for all.

:func:`run_checked` runs a collective's work after the ranks' agreement (:mod:`.agreement`) on the communication
thread; the caller wraps both in one ``stall.tracked`` scope, so the check and the collective are one numbered
collective for the stall watchdog. :func:`refuse` tells the other ranks that a call failed its own checks here.
Dtypes gloo lacks travel widened (:func:`wider_dtype`) or as bytes (:func:`as_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..diagnostics.stall import fresh_copy, tracked
from ..group import bootstrap
from ..state import state
from . import agreement

if TYPE_CHECKING:
    import torch

__all__ = ["REDUCE_OPS"]

REDUCE_OPS = ("sum", "avg", "min", "max", "product")


def ensure_ready() -> None:
    if not bootstrap.is_initialized():
        bootstrap.init()


def check_tensor(tensor: Any, what: str) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")


def wider_dtype(dtype: Any) -> Any:
    """The dtype a reduction of ``dtype`` travels in when gloo has no kernel for it (None: it has one).

    Sums wrap as they would in the narrow type once cast back; uint64 goes as int64 (same bits for sums)."""
    import torch

    return {
        torch.int16: torch.int32,
        torch.uint16: torch.int32,
        torch.uint32: torch.int64,
        torch.uint64: torch.int64,
    }.get(dtype)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous, at least 1-d) seen as rows of uint8, its first dimension kept, when gloo lacks its
    dtype (broadcast, allgather, alltoall only move bytes); the tensor itself otherwise."""
    import math

    import torch

    if wider_dtype(tensor.dtype) is None or tensor.is_cuda:
        return tensor
    return tensor.reshape(tensor.shape[0], math.prod(tensor.shape[1:])).view(torch.uint8)


def run_checked(
    sig: agreement.Signature,
    work: Callable[[], Any],
    extra: int = 0,
    then: Callable[[list[int]], Any] | None = None,
    group: Any = None,
) -> Callable[[], Any]:
    """``work`` preceded, on the communication thread, by the agreement of the ranks (of ``group``, a torch
    group; None: all) on ``sig``; ``then`` (if given) runs instead of ``work`` with every rank's ``extra``.
    Wrap the result in ``stall.tracked``: a rank waiting in the check waits for that collective."""

    def run() -> Any:
        ensure_ready()
        if not agreement.enabled():
            return work() if then is None else then([])
        extras = agreement.agree(sig, extra, group)
        if state.stalled is not None:  # the watchdog gave up on this collective while its check completed late
            raise fresh_copy(state.stalled)
        return work() if then is None else then(extras)

    return run


def refuse(kind: str, error: BaseException, group: Any = None) -> BaseException:
    """Tell the other ranks (of ``group``) this call failed here (they raise, naming it, instead of waiting);
    return ``error``. Only while the process group is up: before it, nothing is waiting.

    Waits for that exchange (usually every rank refused alike, and it is immediate): left running, it could
    still be in flight when the program ends and its group is destroyed under it."""
    if bootstrap.is_initialized() and agreement.enabled():
        sig = agreement.invalid(kind, error)
        try:
            state.comm_thread.run(tracked(kind, None, lambda: agreement.agree(sig, 0, group)))
        except Exception:  # noqa: BLE001, S110 - a rank that differs raises its own error; this one raises ``error``
            pass
    return error


def in_place(tensor: torch.Tensor, collective: Any) -> torch.Tensor:
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


def caller_stream(tensor: torch.Tensor) -> Any:
    """The submitting thread's current CUDA stream for ``tensor``'s device (None on CPU)."""
    import torch

    return torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None


def handed_to_caller(tensor: torch.Tensor, caller: Any) -> torch.Tensor:
    """A new tensor made on the comm stream and handed to the caller: tell the caching allocator the caller's
    stream uses it too, so its memory is not reused on the comm stream while the caller still reads it."""
    if caller is not None:
        tensor.record_stream(caller)
    return tensor


def gathered_counts(count: int, device: Any, group: Any = None) -> list[int]:
    """Every rank's ``count``, in rank order (a collective: call on the communication thread)."""
    import torch
    import torch.distributed as dist

    from ..transport.reduction import all_gather

    mine = torch.tensor([count], dtype=torch.int64, device=device)
    every = mine.new_empty(dist.get_world_size(group))
    all_gather(every, mine, group=group)
    return [int(c) for c in every.tolist()]
