"""Reduce-scatter over every rank: each rank gets its share of the rows of the reduced tensor.

``reduce_scatter(t)`` reduces ``t`` over the ranks and hands rank ``r`` rows ``[offset_r, offset_r + rows_r)``
of the result, the first dimension split as evenly as it goes (the first ``rows % size`` ranks get one more, as
Horovod's ``reducescatter``). Checked by :mod:`.agreement` like every collective. It runs as the backend's
allreduce followed by a slice: gloo has no reduce-scatter of uneven parts, and the allreduce moves twice what
a reduce-scatter needs (fine for the sizes this is used at; the gradient path does not use it).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ..diagnostics.stall import tracked
from ..state import state
from ..transport import streams
from . import agreement, groups
from .checked import REDUCE_OPS, check_tensor, refuse, run_checked, wider_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["reduce_scatter", "reduce_scatter_async", "scatter_rows"]


def scatter_rows(rows: int, size: int) -> list[int]:
    """How many of ``rows`` each of ``size`` ranks gets: even parts, the first ``rows % size`` one more."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


def _reduce_scatter_job(
    tensor: torch.Tensor, op: str, name: Any, group: groups.SubGroup | None = None
) -> tuple[Callable[[], torch.Tensor], Future[Any]]:
    import torch.distributed as dist

    pg = groups.resolve(group)
    try:
        check_tensor(tensor, "reduce_scatter")
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {', '.join(REDUCE_OPS)}; got {op!r}")
        if tensor.dim() == 0:
            raise ValueError("reduce_scatter needs a tensor of at least one dimension, got a 0-d tensor")
        if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
            raise TypeError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}; use op='sum'")
    except (TypeError, ValueError) as error:
        raise refuse("reduce_scatter", error, pg) from None
    topo = state.ensure_topology()
    members = list(range(topo.size)) if group is None else list(group.ranks)
    me = members.index(topo.rank)
    counts = scatter_rows(tensor.shape[0], len(members))
    offset = sum(counts[:me])
    sig = agreement.describe_tensor("reduce_scatter", tensor, name, op=op)
    wide = wider_dtype(tensor.dtype) if not tensor.is_cuda else None
    backend_op = {
        "sum": dist.ReduceOp.SUM,
        "avg": dist.ReduceOp.SUM,
        "min": dist.ReduceOp.MIN,
        "max": dist.ReduceOp.MAX,
        "product": dist.ReduceOp.PRODUCT,
    }[op]

    def work() -> torch.Tensor:
        buf = tensor.detach().to(wide) if wide is not None else tensor.detach().clone()
        buf = buf.contiguous()
        if buf.numel():
            dist.all_reduce(buf, op=backend_op, group=pg)
        if op == "avg":
            buf.div_(len(members))
        return buf.narrow(0, offset, counts[me]).to(tensor.dtype).clone()

    return streams.on_comm_stream(tensor, tracked("reduce_scatter", name, run_checked(sig, work, group=pg)))


def reduce_scatter(
    tensor: torch.Tensor, op: str = "sum", name: Any = None, group: groups.SubGroup | None = None
) -> torch.Tensor:
    """This rank's rows of ``tensor`` reduced over every rank (a new tensor; ``tensor`` is not changed).

    >>> part = taco.reduce_scatter(torch.ones(5, 2))   # rank 0 of 2: 3 rows of 2.0, rank 1: 2 rows
    """
    return state.comm_thread.run(*_reduce_scatter_job(tensor, op, name, group))


def reduce_scatter_async(
    tensor: torch.Tensor, op: str = "sum", name: Any = None, group: groups.SubGroup | None = None
) -> Future[torch.Tensor]:
    """:func:`reduce_scatter` started on the communication thread."""
    return state.comm_thread.submit(*_reduce_scatter_job(tensor, op, name, group))
