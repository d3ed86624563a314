"""A DDP communication hook running taco's allreduce, so DDP code moves over unchanged.

    model = DistributedDataParallel(model)
    model.register_comm_hook(taco.hooks.TacoHookState(compression="fp16", algorithm="2d"),
                             taco.hooks.allreduce_hook)
    model.register_comm_hook(None, taco.hooks.allreduce_hook)  # taco's defaults, as torch's own hooks take

DDP hands the hook one flat bucket at a time, in the same order on every rank; the hook queues the bucket on
taco's communication thread (which also serialises it with any other taco collective) and returns a future
that DDP waits on before the optimizer step. The state may be a :class:`TacoHookState`, or what torch's own
hooks take: None or a process group (the world's: taco reduces over every rank), both meaning taco's defaults
(``configure()``, ``LIGHT_TOPK_ALLREDUCE``), kept in one process-wide default state.

What a stateful compressor keeps (TopK's residuals, PowerSGD's warm-started Q) belongs to the parameters a bucket
packs, not to the bucket's index: DDP rebuilds its buckets in gradient-ready order after the first iteration
(with ``static_graph=True`` too) and again whenever its process group is replaced, and two models may share one
state. So each distinct set of parameters gets its own allreduce name, described to the compressor
(:meth:`~taco_notebook.comm.compression.base.Compressor.describe_buffer`: PowerSGD then compresses each weight as its
own matrix), and when a parameter turns up in a new set, the sets it was in before are forgotten
(:meth:`~taco_notebook.comm.compression.base.Compressor.forget`), so nothing is applied to other parameters and nothing
piles up. ``no_sync()`` steps call no hook (the gradients accumulate in place and the next synchronised step
reduces the sum); ``find_unused_parameters=True`` reduces unused parameters' zero gradients like any other.
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations against the real
# dist.GradBucket and torch.futures.Future[torch.Tensor] classes, not strings.
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..collectives.algorithms import allreduce_async, single_rank
from ..compression.spec import CompressionSpec
from ..config import check_algorithm, compressor_for
from ..diagnostics.replicas import track

__all__ = ["TacoHookState", "allreduce_hook"]


_names = itertools.count()  # allreduce names, unique in the process: two models never share a compressor's memory


@dataclass
class TacoHookState:
    """What the hook does with each bucket; validated when built, not at the first backward."""

    # None = the rank's default (configure(), LIGHT_TOPK_ALLREDUCE); text such as "fp16" is parsed when built
    compression: CompressionSpec | str | None = None
    algorithm: str | None = None  # None = the rank's default ("auto": 2d across several nodes)
    # allreduce name -> the compressor it was described to and the parameters' shapes (what is live now)
    layouts: dict[Any, tuple[Any, tuple[torch.Size, ...]]] = field(default_factory=dict, init=False, repr=False)
    # the ids of a bucket's parameters -> its allreduce name and weak references to its first and last one;
    # a parameter's id -> the set it is in now
    names: dict[tuple[int, ...], tuple[Any, tuple[Any, ...]]] = field(default_factory=dict, init=False, repr=False)
    owners: dict[int, tuple[int, ...]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.compression is not None:
            self.compression = CompressionSpec.parse(self.compression)
        if self.algorithm is not None:
            check_algorithm(self.algorithm)


_default_state: TacoHookState | None = None


def _state_of(state: Any) -> TacoHookState:
    """The hook's state for what DDP was given: a TacoHookState as it is; None or the world's process group as
    the process-wide default state; anything else a clear error (raised from the first backward)."""
    global _default_state
    if isinstance(state, TacoHookState):
        return state
    outside = state is dist.GroupMember.NON_GROUP_MEMBER  # what new_group() gives the ranks it leaves out
    if state is not None and not outside and not isinstance(state, dist.ProcessGroup):
        raise TypeError(f"taco.hooks.allreduce_hook's state must be a taco.hooks.TacoHookState, None or a "
                        f"process group, got {type(state).__name__}: register_comm_hook(None, allreduce_hook) "
                        f"uses taco's defaults")
    if outside or (state is not None and dist.get_world_size(state) != dist.get_world_size()):
        which = "a group this rank is not in" if outside else f"a group of {dist.get_world_size(state)}"
        raise ValueError(f"taco.hooks.allreduce_hook reduces over every rank, but its state is {which} of the "
                         f"{dist.get_world_size()} ranks: pass None (or the default group) as the state, or use "
                         f"one of torch's own hooks for a subgroup")
    if _default_state is None:
        _default_state = TacoHookState()
    return _default_state


def allreduce_hook(state: TacoHookState | dist.ProcessGroup | None,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over every rank with taco's allreduce (``hook(state, bucket) -> Future``)."""
    chosen = _state_of(state)
    buffer = bucket.buffer()
    # With devices, set_result records an event on the completing thread's current stream (the comm stream,
    # once the collective ran) and DDP's consumers wait for it on theirs: ordered without a host sync.
    result: torch.futures.Future[torch.Tensor] = (
        torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future())
    if single_rank():  # the average over one rank is the bucket itself: no thread, no copy, no collective
        result.set_result(buffer)
        return result

    def done(job: Any) -> None:
        error = job.exception()
        if error is not None:
            result.set_exception(error)
        else:
            job.result()  # orders this thread's current stream after the reduction
            result.set_result(buffer)

    name = _bucket_name(chosen, bucket)
    allreduce_async(buffer, op="avg", compression=chosen.compression, algorithm=chosen.algorithm,
                    name=name).add_done_callback(done)
    return result


def _bucket_name(state: TacoHookState, bucket: dist.GradBucket) -> Any:
    """The allreduce name of the parameters ``bucket`` packs now, described to the compressor the first time.

    Looked at on every call: neither the buffer's size nor its address proves what it holds after DDP rebuilt
    its buckets. A set is known by its parameters' ids, its first and last checked against weak references so
    that a new model whose parameters reuse a freed one's ids starts afresh (a DDP model's parameters live and
    die together). The look is cheap next to a step (benchmarks/ddp_hook_describe.py)."""
    compressor = compressor_for(state.compression)
    params = bucket.parameters()
    packed = tuple(map(id, params))
    known = state.names.get(packed)
    if known is not None and known[1][0]() is params[0] and known[1][1]() is params[-1]:
        name = known[0]
        if state.layouts[name][0] is compressor:
            return name
        _forget(state, name)  # the compression changed (configure() between steps): the old memory goes
    else:  # a new set: the sets its parameters were in before (or whose ids they reuse) are stale
        for stale in {state.owners[i] for i in packed if i in state.owners}:
            _forget(state, state.names.pop(stale)[0])
            for i in stale:
                if state.owners.get(i) is stale:
                    del state.owners[i]
        name = ("ddp-bucket", next(_names))
        state.names[packed] = (name, (weakref.ref(params[0]), weakref.ref(params[-1])))
        state.owners.update((i, packed) for i in packed)
        track((None, p) for p in params)  # the replica check after each cell (replicas.py)
    shapes = tuple(p.shape for p in params)
    compressor.describe_buffer(name, shapes)
    state.layouts[name] = (compressor, shapes)
    return name


def _forget(state: TacoHookState, name: Any) -> None:
    described = state.layouts.pop(name, None)
    if described is not None:
        described[0].forget(name)
