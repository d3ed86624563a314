"""The accelerated allreduce: flat or 2D hierarchical, with compression of what crosses nodes.

``2d`` (TACO-Training's LightCC, also Horovod's hierarchical allreduce) for L ranks on each of M nodes:

1. reduce-scatter inside each node: local rank i ends up with the node's sum of shard i (1/L of the tensor)
   (CPU tensors: through shared memory, in chunks pipelined with steps 2 and 3, see :mod:`.pipeline`);
2. L parallel inter-node allreduces, one per local rank, of that shard only, over the ranks with the same
   local rank on the other nodes: every rank's NIC share and core work, and only 2(M-1)/M·S/L per rank
   crosses the network, compressed (fp16/bf16 cast or TopK with error feedback) if asked;
3. allgather inside the node.

``flat`` is the backend's own allreduce over all ranks (gloo's ring on CPU, NCCL's on GPU), compressed as a
whole if asked. ``auto`` on a job of one node with several ranks reduces uncompressed CPU tensors through
the node's shared memory instead (the 2D algorithm's intra-node passes with no cross-node step,
:func:`.pipeline.reduce_node_shm`; resolved as ``node``); anything else there (CUDA tensors, compression,
``shm`` off, no room in ``/dev/shm``) takes ``flat``. The compressed step is the compressor's own
:meth:`.base.Compressor.reduce` (a dense allreduce of the cast payload, TopK's sparse allgather): this
module only asks whether a compressor compresses at all (``name == "none"``: the node algorithm's question).
All collectives of this module run on one background thread per process (``state.comm_thread``), in the
order they were submitted, so gradient buckets can be reduced while backward still runs, and the order of
collectives is the same on every rank. The 2D groups are cached per group generation in the process state
(:mod:`.state`), and dropped by the teardown callback :func:`forget_groups` when the group goes away.
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..compression.compressors import Compressor, NoneCompressor
from ..compression.spec import CompressionSpec
from ..config import check_algorithm, compressor_for, settings
from ..diagnostics import metrics
from ..diagnostics.stall import tracked
from ..group import bootstrap
from ..state import state
from ..transport import streams
from ..transport.cudaipc import DeviceSegment
from ..transport.pipeline import Calibration, calibrate, reduce_2d_shm, reduce_node_shm
from ..transport.reduction import all_gather, merge_sends, reduce_scatter, spread
from ..transport.shm import MAX_LOCAL, NodeSegment, new_tag

__all__ = ["allreduce", "allreduce_async", "reduce_flat", "scale_", "resolve_algorithm", "forget_groups", "comm_thread",
           "single_rank"]

comm_thread = state.comm_thread  # the name cluster/, collectives and tests use


@dataclass(frozen=True)
class _Hierarchy:
    local: Any  # process group of this node's ranks
    cross: Any  # process group of the ranks with this local rank on every node
    local_peers: tuple[int, ...]
    cross_peers: tuple[int, ...]
    segment: NodeSegment | None  # shared memory for the intra-node steps of CPU tensors
    calibration: Calibration | None = None  # measured speeds that size the pipeline's chunks (with segment)


_hierarchy = state.hierarchy  # generation -> this rank's 2D groups, dropped on teardown


def _build_hierarchy() -> _Hierarchy | None:
    """Node and cross-node groups (collective: every rank builds every group, in the same order)."""
    topo = state.topology
    assert topo is not None
    sizes = {len(ranks) for ranks in topo.node_ranks}
    if len(sizes) != 1 or topo.num_nodes == 1 or topo.local_size == 1:
        return None
    backend = state.backend  # the same per-device backends as the world ("cpu:gloo,cuda:nccl")
    locals_ = [dist.new_group(list(ranks), backend=backend) for ranks in topo.node_ranks]
    crosses = [dist.new_group([ranks[i] for ranks in topo.node_ranks], backend=backend)
               for i in range(topo.local_size)]
    local = locals_[topo.node]
    segment, calibration = None, None
    if settings().shm:  # configure(shm=False) / TACO_SHM=0 keeps the intra-node steps on the process group
        segment = NodeSegment(local, topo.local_rank, topo.local_size, new_tag(local),
                              settings().collective_timeout)
        calibration = calibrate(crosses[topo.local_rank])
    return _Hierarchy(local, crosses[topo.local_rank], topo.node_ranks[topo.node],
                      tuple(ranks[topo.local_rank] for ranks in topo.node_ranks), segment, calibration)


_world: dict[int, Any] = {}  # generation -> taco's own group of every rank, for the flat algorithm
_node: dict[int, NodeSegment] = {}  # generation -> the shared segment of a one-node job (the node algorithm)
_node_gpu: dict[int, DeviceSegment] = {}  # generation -> a one-node job's slots on the GPU its ranks share


# Built as soon as the process group is, while every rank is there: built lazily by the first collective, it
# would block the peers of a rank that failed before any collective inside new_group's rendezvous, where abort()
# on the failed rank cannot release them (only its group's sockets, which did not exist yet).
@state.on_group_start
def world_group() -> Any:
    """Every rank, in a group of taco's own (built on the comm thread, once per generation): the flat algorithm's
    collectives run on the comm thread, and on the default group they could interleave differently on each rank
    with what other code sends there meanwhile from its own thread (DDP's unused-parameter map during backward
    with ``find_unused_parameters=True``: gloo then fails with "Received data size doesn't match")."""
    generation = state.generation
    if generation not in _world:
        _world.clear()
        _world[generation] = dist.new_group(list(range(dist.get_world_size())), backend=state.backend)
    return _world[generation]


def hierarchy() -> _Hierarchy | None:
    """This rank's groups for the 2D algorithm, or None when the job is one node or uneven."""
    generation = state.generation
    if generation not in _hierarchy:
        _hierarchy.clear()
        _hierarchy[generation] = _build_hierarchy()
    return _hierarchy[generation]


def node_segment() -> NodeSegment:
    """The shared-memory segment of a one-node job, over taco's world group (collective the first time in a
    generation: every rank calls it, on the comm thread; it maps nothing until a tensor needs it)."""
    generation = state.generation
    if generation not in _node:
        topo = state.topology
        assert topo is not None and topo.num_nodes == 1
        for segment in _node.values():
            segment.close(leaving=True)  # left by a generation that was not torn down
        _node.clear()
        group = world_group()
        _node[generation] = NodeSegment(group, topo.rank, topo.size, new_tag(group), settings().collective_timeout)
    return _node[generation]


def node_device_segment(device: torch.device) -> DeviceSegment:
    """The slots on the shared GPU of a one-node job (made here; set up by the first CUDA tensor that needs them,
    collectively, on the comm thread)."""
    generation = state.generation
    if generation not in _node_gpu:
        for segment in _node_gpu.values():
            segment.close()
        _node_gpu.clear()
        topo = state.topology
        assert topo is not None
        _node_gpu[generation] = DeviceSegment(node_segment(), world_group(), topo.rank, topo.size, device)
    return _node_gpu[generation]


def built_hierarchy() -> _Hierarchy | None:
    """This generation's 2D groups if a collective built them already (the same answer on every rank: they are
    built collectively), else None; never builds them."""
    return _hierarchy.get(state.generation)


def one_node() -> bool:
    """Whether this job is one node of 2 to 1,024 ranks (the segment's header has room for that many) with the
    shared-memory steps on: the node algorithm's and the node exchange's jobs (the same answer on every rank)."""
    topo = state.topology
    return topo is not None and topo.num_nodes == 1 and 1 < topo.size <= MAX_LOCAL and settings().shm


@state.on_teardown
def forget_groups() -> None:
    """Drop the 2D groups and unmap the node's segment, and leave the comm thread (the group is going away).

    Registered with :meth:`.state.ProcessState.on_teardown`: ``bootstrap.shutdown()`` runs it without
    importing this module.
    """
    comm_thread.abandon()
    _world.clear()
    for gpu in _node_gpu.values():
        gpu.close()
    _node_gpu.clear()
    for segment in _node.values():
        segment.close(leaving=True)
    _node.clear()
    for tiers in _hierarchy.values():
        if tiers is not None and tiers.segment is not None:
            tiers.segment.close(leaving=True)
    _hierarchy.clear()


def single_rank() -> bool:
    """Whether the process group is up with this rank alone: every sum is then the tensor itself, so the
    optimizer and the DDP hook reduce nothing (Horovod registers no hooks at size 1 either). Local, no
    collective: asked once per step or bucket, since an elastic job may grow from one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1


def resolve_algorithm(algorithm: str | None) -> str:
    """'flat', '2d' or 'node' for this job. 'auto' (the default) is 2d when the job has several multi-rank
    nodes, node when it is one node of several ranks and the shared-memory steps are on (``shm``), else flat."""
    name = check_algorithm(algorithm or settings().algorithm)
    if name == "flat":
        return "flat"
    if hierarchy() is None:
        if name == "2d":
            warnings.warn("2d allreduce needs several nodes with the same number (>1) of ranks each; "
                          "using flat", stacklevel=3)
            return "flat"
        return "node" if one_node() else "flat"
    return "2d"


def _reduce_2d(buf: torch.Tensor, compressor: Compressor, key: Hashable, tiers: _Hierarchy,
               me: int) -> tuple[int, int, dict[int, int]]:
    if tiers.segment is not None and buf.device.type == "cpu":
        return reduce_2d_shm(buf, compressor, key, tiers.segment, tiers.cross, tiers.local_peers,
                             tiers.cross_peers, me, tiers.calibration)
    # CUDA tensors (and shm=False): the node's process group (NCCL on GPUs), on the comm stream. Local rank i
    # reduces part i of the buffer: an equal share, or the compressor's cut (PowerSGD: on rows, its state keyed
    # by the part). The collectives need equal widths: part i sits at i * chunk of a padded buffer, which is the
    # buffer itself when the parts already are equal and fill it.
    numel, local_size = buf.numel(), len(tiers.local_peers)
    cuts = compressor.shard_cuts(key, numel, local_size)
    if cuts is None:
        chunk = -(-numel // local_size)
        spans = list(itertools.pairwise(min(part * chunk, numel) for part in range(local_size + 1)))
    else:
        spans = list(itertools.pairwise(cuts))
        chunk = max(b - a for a, b in spans)
    lo, hi = spans[tiers.local_peers.index(me)]
    if numel == chunk * local_size:  # parts of at most chunk that fill it: part i is [i * chunk, (i + 1) * chunk)
        padded = buf
    else:
        padded = buf.new_zeros(chunk * local_size)
        for part, (a, b) in enumerate(spans):
            padded[part * chunk: part * chunk + b - a].copy_(buf[a:b])
    shard = buf.new_empty(chunk)
    reduce_scatter(shard, padded, group=tiers.local)
    name = (key, "2d") if cuts is None else (key, "2d", lo, hi)
    raw, wire, cross_sends = compressor.reduce(shard[: hi - lo], name, tiers.cross, tiers.cross_peers, me)
    all_gather(padded, shard, group=tiers.local)
    if padded is not buf:
        for part, (a, b) in enumerate(spans):
            buf[a:b].copy_(padded[part * chunk: part * chunk + b - a])
    shard_bytes = chunk * buf.element_size()
    local = spread(tiers.local_peers, me, 2 * shard_bytes)  # reduce-scatter + allgather, never compressed
    return raw, wire, merge_sends(local, cross_sends)


def reduce_flat(buf: torch.Tensor, compressor: Compressor, algorithm: str, key: Hashable) -> None:
    """Sum a 1-D contiguous ``buf`` over all ranks in place (runs on the communication thread).

    Metrics get the bytes sent to each peer, and the raw and wire bytes of the part compression applies to
    (all of it for flat, what crosses nodes for 2d): their ratio is the compression ratio.
    """
    began = time.perf_counter()
    topo = state.topology
    assert topo is not None
    me = topo.rank
    tiers = hierarchy() if algorithm == "2d" else None
    done = None
    if tiers is not None:
        done = _reduce_2d(buf, compressor, key, tiers, me)
    elif algorithm == "node" and _through_node(buf, compressor):
        done = reduce_node_shm(buf, compressor, key, node_segment(), tuple(range(topo.size)), me)
    elif algorithm == "node" and buf.is_cuda and "cuda:nccl" not in str(state.backend):
        done = reduce_node_gpu(buf, compressor, node_device_segment(buf.device), tuple(range(topo.size)), me)
    if done is None:  # flat (or node with no room for the segment: every rank learnt that together)
        done = compressor.reduce(buf, (key, "flat"), world_group(), tuple(range(topo.size)), me)
    raw, wire, sends = done
    metrics.record(time.perf_counter() - began, raw, wire, sends)


def _through_node(buf: torch.Tensor, compressor: Compressor) -> bool:
    """Whether the node algorithm takes ``buf`` through host memory: an uncompressed CPU tensor whose ``+`` is a
    sum (not bool). Compression stays on flat, where it changes what the ranks send to each other (a one-node job
    asks for it to see its effect before going to several nodes); CUDA tensors stay on NCCL's own intra-node
    rings, or, for ranks sharing a GPU (where NCCL cannot run), go through :func:`reduce_node_gpu`."""
    return buf.device.type == "cpu" and compressor.name == "none" and buf.dtype != torch.bool


def reduce_node_gpu(buf: torch.Tensor, compressor: Compressor, segment: DeviceSegment, peers: tuple[int, ...],
                    me: int) -> tuple[int, int, dict[int, int]] | None:
    """Sum the CUDA tensor ``buf`` of a one-node job whose ranks share a GPU in place, in that GPU's memory
    (:mod:`..transport.cudaipc`), uncompressed or cast (fp16/bf16: the slots hold the cast, the sum is taken in
    ``buf``'s dtype). None on every rank when the job keeps gloo: TopK and PowerSGD, bool, ranks on different
    GPUs, IPC refused. Returns the raw and wire bytes moved and the bytes sent to each peer."""
    wire = compressor.fused_wire_dtype(buf.dtype)
    if wire is None or buf.dtype == torch.bool or buf.device != segment.device:
        return None
    if not segment.ready(buf.numel() * wire.itemsize):
        return None
    shard = segment.allreduce(buf, wire)
    sends = spread(peers, me, 2 * shard)
    wire_bytes = sum(sends.values())
    raw_bytes = wire_bytes * buf.element_size() // wire.itemsize
    if compressor.name != "none":
        compressor.stats.add(raw_bytes, wire_bytes)
    return raw_bytes, wire_bytes, sends


def check_reducible(tensor: Any, op: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allreduce needs a torch.Tensor, got {type(tensor).__name__}")
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg' for the accelerated allreduce; got {op!r}")
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}; use op='sum'")


def _job(tensor: torch.Tensor, op: str, compression: CompressionSpec | str | None, algorithm: str | None,
         name: Hashable | None, prescale: float = 1.0,
         postscale: float = 1.0) -> tuple[Callable[[], torch.Tensor], streams.StreamFuture]:
    """Validate now (errors surface in the caller), reduce later on the communication thread.

    A CUDA tensor is reduced on the comm stream once the caller's stream reached this point; the future's
    ``result()`` orders the caller after the reduction, without a host sync (see :mod:`.streams`).
    """
    check_reducible(tensor, op)
    compressor = compressor_for(compression) if tensor.is_floating_point() else NoneCompressor()
    if algorithm is not None:
        check_algorithm(algorithm)
    key = name if name is not None else ("ptr", tensor.data_ptr(), tensor.numel())

    def work() -> torch.Tensor:
        if not bootstrap.is_initialized():
            bootstrap.init()
        resolved = resolve_algorithm(algorithm)  # may build groups: collective, so on this thread
        return reduce_in_place(tensor, op, compressor, resolved, key, prescale, postscale)

    return streams.on_comm_stream(tensor, tracked("allreduce", name, work))


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply ``tensor`` by ``factor`` in place; integer tensors keep their dtype (truncated toward zero,
    as Horovod scales integer buffers). Used for Horovod's pre- and postscale factors."""
    if factor != 1.0:
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.mul_(factor)
        else:
            tensor.copy_(tensor.double().mul_(factor).trunc_())
    return tensor


def reduce_in_place(tensor: torch.Tensor, op: str, compressor: Compressor, resolved: str,
                     key: Hashable, prescale: float = 1.0, postscale: float = 1.0) -> torch.Tensor:
    """Sum (or average) ``tensor`` over every rank in place, on the current (comm) stream; ``prescale``
    multiplies each rank's input before the sum, ``postscale`` the result after (and after averaging)."""
    if tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    scale_(flat, prescale)
    reduce_flat(flat, compressor, resolved, key)
    size = dist.get_world_size()
    if op == "avg" and size > 1:  # averaging over one rank is nothing: no pass over the buffer
        flat.div_(size)
    scale_(flat, postscale)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def allreduce_async(tensor: torch.Tensor, op: str = "sum", compression: CompressionSpec | str | None = None,
                    algorithm: str | None = None, name: Hashable | None = None, *, prescale: float = 1.0,
                    postscale: float = 1.0) -> Future[torch.Tensor]:
    """Start an in-place allreduce on the communication thread; the future yields ``tensor`` when done.

    ``name`` keys TopK's residual (error feedback) across steps; by default the tensor's storage address,
    which is stable for gradients and fusion buffers that are reused every step. ``prescale``/``postscale``
    multiply the input before and the result after the reduction (Horovod's factors; 1.0 changes nothing).
    """
    return comm_thread.submit(*_job(tensor, op, compression, algorithm, name, prescale, postscale))


def allreduce(tensor: torch.Tensor, op: str = "sum", compression: CompressionSpec | str | None = None,
              algorithm: str | None = None, name: Hashable | None = None, *, prescale: float = 1.0,
              postscale: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over every rank in place with the accelerated allreduce; returns it.

    >>> taco.allreduce(grad, op="avg", compression="topk:0.01", algorithm="2d", name="fc.weight")
    """
    return comm_thread.run(*_job(tensor, op, compression, algorithm, name, prescale, postscale))
