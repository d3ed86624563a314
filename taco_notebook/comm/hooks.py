"""A DDP communication hook running taco's allreduce, so DDP code moves over unchanged.

    model = DistributedDataParallel(model)
    model.register_comm_hook(taco.hooks.TacoHookState(compression="fp16", algorithm="2d"),
                             taco.hooks.allreduce_hook)

DDP hands the hook one flat bucket at a time, in the same order on every rank; the hook queues the bucket on
taco's communication thread (which also serialises it with any other taco collective) and returns a future
that DDP waits on before the optimizer step.

Before a bucket's first reduction, and again whenever DDP changes what a bucket holds (it rebuilds its buckets
in gradient-ready order after the first iteration), the hook tells the compressor which tensors the flat
bucket packs (:meth:`~taco_notebook.comm.compressor.Compressor.describe_buffer`: PowerSGD then compresses each
weight as its own matrix) and makes it forget what it kept for the bucket's old contents
(:meth:`~taco_notebook.comm.compressor.Compressor.forget`: a TopK residual or PowerSGD's Q must not be
applied to other parameters).
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations against the real
# dist.GradBucket and torch.futures.Future[torch.Tensor] classes, not strings.
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .algorithms import allreduce_async
from .config import check_algorithm, compressor_for

__all__ = ["TacoHookState", "allreduce_hook"]


@dataclass
class TacoHookState:
    """What the hook does with each bucket; validated when built, not at the first backward."""

    compression: str | None = None  # None = the rank's default (configure(), LIGHT_TOPK_ALLREDUCE)
    algorithm: str | None = None  # None = the rank's default ("auto": 2d across several nodes)
    # per bucket name: the compressor it was described to and the parameters' shapes, as last described
    layouts: dict[Any, tuple[Any, tuple[torch.Size, ...]]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.compression is not None:
            self.compression = compressor_for(self.compression).name
        if self.algorithm is not None:
            check_algorithm(self.algorithm)


def allreduce_hook(state: TacoHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over every rank with taco's allreduce (``hook(state, bucket) -> Future``)."""
    buffer = bucket.buffer()
    # With devices, set_result records an event on the completing thread's current stream (the comm stream,
    # once the collective ran) and DDP's consumers wait for it on theirs: ordered without a host sync.
    result: torch.futures.Future[torch.Tensor] = (
        torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future())

    def done(job: Any) -> None:
        error = job.exception()
        if error is not None:
            result.set_exception(error)
        else:
            job.result()  # orders this thread's current stream after the reduction
            result.set_result(buffer)

    name = ("ddp-bucket", bucket.index())
    _describe(state, name, bucket)
    allreduce_async(buffer, op="avg", compression=state.compression, algorithm=state.algorithm,
                    name=name).add_done_callback(done)
    return result


def _describe(state: TacoHookState, name: Any, bucket: dist.GradBucket) -> None:
    """Describe the bucket's tensors to the compressor when they (or the compressor) changed since last time.

    Looked at on every call: DDP rebuilds its buckets after the first iteration and again whenever its process
    group is replaced (``_update_process_group``), and neither the buffer's size nor its address proves the order
    of what it holds. The look costs about 0.5 µs per tensor (100 µs for a bucket of 200 on this machine's CPU),
    against the step's milliseconds."""
    compressor = compressor_for(state.compression)
    shapes = tuple(p.shape for p in bucket.parameters())
    if state.layouts.get(name) == (compressor, shapes):
        return
    if name in state.layouts:  # DDP rebuilt its buckets: this name now holds other parameters
        compressor.forget(name)
    compressor.describe_buffer(name, shapes)
    state.layouts[name] = (compressor, shapes)
