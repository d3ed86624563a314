"""Collectives on tensors over every rank: allreduce, broadcast, barrier, parameter broadcast.

Each call brings the process group up on first use, so a plain ``mpiexec -n 4 python train.py`` needs no
set-up call, and is watched by the stall watchdog (:mod:`.stall`). Tensors are changed in place (and returned,
for chaining), as in Horovod's ``allreduce_``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import bootstrap, streams
from .stall import tracked
from .state import state

if TYPE_CHECKING:
    import torch

__all__ = ["allreduce", "broadcast", "barrier", "broadcast_parameters", "REDUCE_OPS"]

REDUCE_OPS = ("sum", "avg", "min", "max", "product")


def _ready() -> None:
    if not bootstrap.is_initialized():
        bootstrap.init()


def _check_tensor(tensor: Any, what: str) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")


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


def allreduce(tensor: torch.Tensor, op: str = "sum", compression: str | None = None,
              algorithm: str | None = None, name: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks in place; ``op`` is one of :data:`REDUCE_OPS`.

    ``sum`` and ``avg`` take the accelerated path (:mod:`.algorithms`: flat or 2D hierarchical, optionally
    compressed, ``name`` keying TopK's error feedback); ``min``, ``max`` and ``product`` use the backend's.

    >>> t = torch.ones(3); taco.allreduce(t, op="avg")   # every rank now holds the mean
    """
    import torch.distributed as dist

    from .algorithms import allreduce as accelerated

    _check_tensor(tensor, "allreduce")
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {', '.join(REDUCE_OPS)}; got {op!r}")
    if op in ("sum", "avg"):
        return accelerated(tensor, op, compression, algorithm, name)
    if compression not in (None, "none"):
        raise ValueError(f"compression applies to op='sum' or 'avg' only, not {op!r}")
    reduce_op = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "product": dist.ReduceOp.PRODUCT}[op]

    def work() -> torch.Tensor:
        _ready()
        return _in_place(tensor, lambda buf: dist.all_reduce(buf, op=reduce_op))

    return state.comm_thread.run(*streams.on_comm_stream(tensor, tracked("allreduce", name, work)))


def broadcast(tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
    """Copy ``root``'s ``tensor`` into every rank's ``tensor`` in place."""
    import torch.distributed as dist

    _check_tensor(tensor, "broadcast")
    size = state.ensure_topology().size
    if not 0 <= root < size:
        raise ValueError(f"root must be a rank in 0..{size - 1}, got {root}")

    def work() -> torch.Tensor:
        _ready()
        return _in_place(tensor, lambda buf: dist.broadcast(buf, src=root))

    return state.comm_thread.run(*streams.on_comm_stream(tensor, tracked("broadcast", None, work)))


def barrier() -> None:
    """Wait until every rank reaches this point."""
    import torch.distributed as dist

    def work() -> None:
        _ready()
        dist.barrier()

    state.comm_thread.run(tracked("barrier", None, work))


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
