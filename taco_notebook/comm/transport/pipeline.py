"""The 2D allreduce of CPU tensors through the node's shared memory, pipelined in chunks.

A buffer goes in chunks when its compressor's payload is dense (none, fp16, bf16: ``Compressor.pipelines``;
TopK and PowerSGD reduce a shard whole, with the same passes and one chunk). For each chunk, every rank copies
it into its slot, sums its shard across the slots straight into the output area (in the wire dtype when the
compression is a cast: fp16/bf16 are written by the same pass that sums), the cross-node step reduces that
shard in place, and every rank reads the output area back (casting back in the same copy). The shared-memory
passes run on a thread of their own (``_passes``), the cross-node steps on the communication thread, so the
intra-node reduce-scatter of chunk k+1, the cross-node exchange of chunk k and the allgather of chunk k-1
overlap. A dense cross-node step is issued before the previous one is waited for (two collectives in
flight), so the link does not idle through a collective's start-up latency between chunks::

    passes thread:  RS0  RS1  RS2  AG0  RS3  AG1  RS4  AG2 ...
    comm thread:         X0---X1---X2---X3-- ...        (X = cross-node step, a collective; waited one later)

Why the order of collectives stays the same on every rank: the passes issue none (they wait on counters in
the segment, :class:`.shm.NodeSegment`), and the communication thread issues the cross-node steps chunk by
chunk, in order, the chunk bounds being a function of the buffer's size and of settings every rank agreed on
(:class:`Calibration` is reduced over the world once, when the 2D groups are built).
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..compression.base import Compressor
from ..config import settings
from ..state import CommThread, state
from .reduction import Reduced, merge_sends, spread
from .shm import NodeSegment

__all__ = ["Calibration", "calibrate", "chunk_bounds", "reduce_2d_shm", "reduce_node_shm", "phase_seconds",
           "reset_phases"]

# Seconds this rank spent in each phase since reset_phases(): the passes ("scatter": copy in and sum,
# "gather": read back), the cross-node steps ("cross") and the comm thread's waits for the passes
# ("wait_scatter", "wait_gather"). Where the pipeline's time goes, for benchmarks and profiling.
phase_seconds: dict[str, float] = {}


def reset_phases() -> None:
    phase_seconds.clear()


def _add(phase: str, began: float) -> None:
    phase_seconds[phase] = phase_seconds.get(phase, 0.0) + time.perf_counter() - began


_passes = CommThread()  # the shared-memory passes of the pipeline; left behind with the group on teardown
state.on_teardown(_passes.abandon)

# Bounds of the automatic chunk size. Below 2 MiB a chunk's fixed cost (a collective's latency, two thread
# hand-offs, waking on a loaded machine) outweighs what it overlaps; above 64 MiB the first and last passes,
# which nothing overlaps, cost more than the per-chunk latency saved.
_MIN_CHUNK = 2 * 1024 * 1024
_MAX_CHUNK = 64 * 1024 * 1024


@dataclass(frozen=True)
class Calibration:
    """Speeds measured when the 2D groups were built, the same on every rank (slowest over the world).

    ``pass_bytes_per_s``: one shared-memory pass (sum of two slots into a third buffer), bytes of the chunk per
    second; ``chunk_overhead_s``: what a chunk costs besides its bytes (a small cross-node allreduce plus the
    hand-off to the passes thread); ``link_bytes_per_s``: the cross-node allreduce's rate for 1 MiB.
    """

    pass_bytes_per_s: float
    chunk_overhead_s: float
    link_bytes_per_s: float

    def chunk_bytes(self, nbytes: int) -> int:
        """The chunk size that minimises ``J * overhead + 2 * (nbytes / J) / pass speed`` over J chunks.

        The first chunk's reduce-scatter and the last one's allgather are not overlapped (2 C / pass speed);
        every chunk adds the fixed overhead. The optimum is C = sqrt(S · overhead · pass speed / 2). A buffer
        under two such chunks goes whole.
        """
        best = math.sqrt(nbytes * self.chunk_overhead_s * self.pass_bytes_per_s / 2)
        best = min(max(best, _MIN_CHUNK), _MAX_CHUNK)
        return nbytes if nbytes < 2 * best else int(best)

    def as_dict(self) -> dict[str, float]:
        return {"pass_bytes_per_s": self.pass_bytes_per_s, "chunk_overhead_s": self.chunk_overhead_s,
                "link_bytes_per_s": self.link_bytes_per_s}


def _timed(fn: Any, repeats: int) -> float:
    """The best of ``repeats`` runs: noise on a shared host (ranks sharing cores, a peer arriving late) only
    ever adds to these fixed costs, and a median reads them too high and sizes chunks too large."""
    best = math.inf
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best


def calibrate(cross: Any) -> Calibration:
    """Measure the pass speed, the per-chunk overhead and the cross-node rate; agree on the slowest.

    Collective over ``cross`` and then the world (call it where every rank builds the 2D groups). Runs once per
    process-group generation: a few passes and two 1 MiB allreduces over the cross-node link.
    """
    # 16 MiB operands, more than a cache holds: a pass over a large chunk streams from memory
    a, b = torch.ones(1 << 22), torch.ones(1 << 22)
    out = torch.empty(1 << 22)
    pass_s = _timed(lambda: torch.add(a, b, out=out), 5)
    tiny, mib = torch.zeros(1), torch.zeros(1 << 18)
    latency_s = _timed(lambda: dist.all_reduce(tiny, group=cross), 9)
    handoff_s = _timed(lambda: _passes.run(lambda: None), 9)
    mib_s = _timed(lambda: dist.all_reduce(mib, group=cross), 3)
    slow = torch.tensor([pass_s / (16 << 20), latency_s + handoff_s, max(mib_s - latency_s, 1e-6) / (1 << 20)],
                        dtype=torch.float64)
    dist.all_reduce(slow, op=dist.ReduceOp.MAX)  # every rank must cut buffers the same way
    return Calibration(1 / float(slow[0]), float(slow[1]), 1 / float(slow[2]))


def chunk_bounds(numel: int, chunk_numel: int, local_size: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each chunk: ``chunk_numel`` rounded down to a multiple of ``local_size`` (so that every
    chunk but the last splits into equal shards), at least ``local_size``; one chunk when ``chunk_numel`` covers
    the buffer (not a rounded-down chunk and a tail of fewer than ``local_size`` elements)."""
    if chunk_numel >= numel:
        return [(0, numel)]
    step = max(local_size, chunk_numel - chunk_numel % local_size)
    return [(lo, min(lo + step, numel)) for lo in range(0, numel, step)] or [(0, 0)]


def _chunk_numel(buf: torch.Tensor, compressor: Compressor, calibration: Calibration | None) -> int:
    numel = buf.numel()
    chosen = settings().chunk_mb
    if not compressor.pipelines or chosen == 0:
        return numel
    if chosen is None:
        if calibration is None:  # nothing measured to size chunks by (the node algorithm): one chunk
            return numel
        return max(1, calibration.chunk_bytes(numel * buf.element_size()) // buf.element_size())
    return max(1, int(chosen * (1 << 20)) // buf.element_size())


def _shard(lo: int, hi: int, local_size: int, local_rank: int) -> tuple[int, int, int]:
    """This rank's ``[start, end)`` of the chunk ``[lo, hi)`` and the padded shard width (same on every rank)."""
    width = -(-(hi - lo) // local_size)
    start = lo + local_rank * width
    return start, max(start, min(start + width, hi)), width


class _Run:
    """One pipelined allreduce of ``buf``: its chunks, and the three steps of a chunk."""

    def __init__(self, buf: torch.Tensor, compressor: Compressor, key: Hashable, segment: NodeSegment,
                 local_peers: tuple[int, ...], me: int, calibration: Calibration | None) -> None:
        self.buf, self.compressor, self.key, self.segment = buf, compressor, key, segment
        self.local_size, self.local_rank = len(local_peers), local_peers.index(me)
        self.wire_dtype = compressor.fused_wire_dtype(buf.dtype)
        self.area = self.wire_dtype or buf.dtype  # what the output area holds: the wire dtype when fused
        self.bounds = chunk_bounds(buf.numel(), _chunk_numel(buf, compressor, calibration), self.local_size)
        # A buffer in one chunk may be cut where its compressor asks (PowerSGD: on the rows of its weights)
        self.cuts = compressor.shard_cuts(key, buf.numel(), self.local_size) if len(self.bounds) == 1 else None
        widest = (max(b - a for a, b in zip(self.cuts, self.cuts[1:], strict=False)) if self.cuts is not None
                  else -(-(self.bounds[0][1] - self.bounds[0][0]) // self.local_size))
        self.scratch = (buf.new_empty(widest) if self.local_size > 2 and self.area != buf.dtype else None)

    def shard(self, k: int) -> tuple[int, int, int]:
        if self.cuts is not None:
            start, end = self.cuts[self.local_rank], self.cuts[self.local_rank + 1]
            return start, end, end - start
        return _shard(*self.bounds[k], self.local_size, self.local_rank)

    def scatter(self, k: int) -> None:
        """Passes thread: copy chunk ``k`` in, sum this rank's shard of it into the output area."""
        began, (lo, hi) = time.perf_counter(), self.bounds[k]
        start, end, width = self.shard(k)
        self.segment.copy_in(self.buf, lo, hi, k, own=(start, end))  # this rank's shard: read from buf
        self.segment.sum_shard(self.buf, start, end, self.segment.output(self.area, start, width), k, self.scratch)
        _add("scatter", began)

    def cross(self, k: int, group: Any, peers: tuple[int, ...], me: int) -> tuple[Reduced, Any]:
        """Comm thread: start reducing this rank's shard of chunk ``k`` across nodes, in place in the output
        area. A dense wire payload's collective is left in flight (its work is returned; :meth:`finish` waits);
        a compressor's own reduction runs to the end here (work None)."""
        began, (lo, hi) = time.perf_counter(), self.bounds[k]
        start, end, width = self.shard(k)
        shard = self.segment.output(self.area, start, width)
        work = None
        if self.wire_dtype is not None:
            done, work = self.compressor.start_reduce_wire(shard, width * self.buf.element_size(), group, peers, me)
        elif self.cuts is not None:  # the compressor's own cut, named by its bounds
            done = self.compressor.reduce(shard, (self.key, "2d", start, end), group, peers, me)
        elif len(self.bounds) == 1:
            done = self.compressor.reduce(shard, (self.key, "2d"), group, peers, me)
        else:  # state per chunk, keyed by its bounds: a new chunk size starts fresh instead of mismatching
            done = self.compressor.reduce(shard, (self.key, "2d", lo, hi), group, peers, me)
        _add("cross", began)
        return done, work

    def finish(self, k: int, work: Any) -> None:
        """Comm thread: wait for chunk ``k``'s cross-node step, then tell the node its shard is reduced."""
        began = time.perf_counter()
        if work is not None:
            work.wait()
        self.segment.reduced(k)
        _add("cross", began)

    def gather(self, k: int) -> None:
        """Passes thread: read chunk ``k`` back once every local rank reduced its shard of it."""
        began = time.perf_counter()
        self.segment.copy_out(self.buf, *self.bounds[k], self.area, k, last=k == len(self.bounds) - 1)
        _add("gather", began)


def _waited(future: Future[None], phase: str) -> None:
    began = time.perf_counter()
    future.result()
    _add(phase, began)


def reduce_2d_shm(buf: torch.Tensor, compressor: Compressor, key: Hashable, segment: NodeSegment, cross: Any,
                  local_peers: tuple[int, ...], cross_peers: tuple[int, ...], me: int,
                  calibration: Calibration | None) -> tuple[int, int, dict[int, int]]:
    """Sum the CPU tensor ``buf`` over every rank in place (on the communication thread): the pipeline above.

    Returns the raw and wire bytes of what crossed nodes and the bytes sent to each peer, as
    :func:`.algorithms.reduce_flat` records them.
    """
    run = _Run(buf, compressor, key, segment, local_peers, me, calibration)
    chunks = len(run.bounds)
    if not segment.prepare(buf.numel() * buf.element_size(), chunks, buf.element_size()):  # may grow: collective
        raise RuntimeError(f"no room for the 2D allreduce's shared-memory segment ({buf.numel() * buf.element_size()}"
                           f" bytes per local rank) in a hugetlbfs mount or /dev/shm on this node; give /dev/shm "
                           "more room or turn it off with taco.configure(shm=False) / TACO_SHM=0")
    if chunks == 1:  # nothing to overlap: the passes on this thread, without two hand-offs to the other
        run.scatter(0)
        done, work = run.cross(0, cross, cross_peers, me)
        run.finish(0, work)
        run.gather(0)
        return _accounted(buf, run.local_size, local_peers, me, done)
    scattered: list[Future[None]] = [_passes.submit(partial(run.scatter, 0))]
    gathered: list[Future[None]] = []
    total = Reduced(0, 0, {})
    in_flight: tuple[int, Any] | None = None  # the previous chunk's cross-node step, still running
    try:
        for k in range(chunks):
            if k + 1 < chunks:  # queued behind the allgather of chunk k-2: RS k+1, X k, X k-1 and AG k-2 overlap
                scattered.append(_passes.submit(partial(run.scatter, k + 1)))
            _waited(scattered[k], "wait_scatter")
            done, work = run.cross(k, cross, cross_peers, me)  # issued before chunk k-1's ends: no idle link
            total = Reduced(total.raw + done.raw, total.wire + done.wire, merge_sends(total.sends, done.sends))
            if in_flight is not None:
                run.finish(*in_flight)
                gathered.append(_passes.submit(partial(run.gather, in_flight[0])))
            in_flight = (k, work)
        assert in_flight is not None
        run.finish(*in_flight)
        gathered.append(_passes.submit(partial(run.gather, in_flight[0])))
        for future in gathered:
            _waited(future, "wait_gather")
    except BaseException:
        _passes.abandon()  # passes still queued wait on peers that may never come: leave them to time out
        raise
    return _accounted(buf, run.local_size, local_peers, me, total)


def reduce_node_shm(buf: torch.Tensor, compressor: Compressor, key: Hashable, segment: NodeSegment,
                    peers: tuple[int, ...], me: int) -> tuple[int, int, dict[int, int]] | None:
    """Sum the CPU tensor ``buf`` over the ranks of a one-node job in place, through the node's segment: the
    2D pipeline's passes with no cross-node step (copy in, sum this rank's shard, read every shard back).

    A gloo ring among L processes on one host is 2(L-1) steps, each a loopback TCP exchange that needs its two
    ranks on a core at once; this is two waits on counters, and each byte is copied three times. Returns what
    :func:`reduce_2d_shm` returns (nothing is compressed: raw and wire are the bytes moved), or None on every
    rank when the node has no room for the segment (the caller then takes the flat algorithm).
    """
    run = _Run(buf, compressor, key, segment, peers, me, None)
    chunks = len(run.bounds)  # one, unless configure(chunk_mb=...) asks for chunks
    if not segment.prepare(buf.numel() * buf.element_size(), chunks, buf.element_size()):  # may grow: collective
        return None
    for k in range(chunks):
        began, (lo, hi) = time.perf_counter(), run.bounds[k]
        start, end, width = run.shard(k)
        segment.copy_in(buf, lo, hi, k)  # this rank's shard too: one strided sum then reads every slot
        segment.sum_slots(buf.dtype, start, end, segment.output(buf.dtype, start, width), k)
        segment.reduced(k)
        _add("scatter", began)
        run.gather(k)
    _, _, sends = _accounted(buf, run.local_size, peers, me, Reduced(0, 0, {}))
    moved = sum(sends.values())
    return moved, moved, sends


def _accounted(buf: torch.Tensor, local_size: int, local_peers: tuple[int, ...], me: int,
               cross: Reduced) -> tuple[int, int, dict[int, int]]:
    """Raw and wire bytes of what crossed nodes, and the bytes sent to each peer (node and cross-node)."""
    shard_bytes = -(-buf.numel() // local_size) * buf.element_size()
    local = spread(local_peers, me, 2 * shard_bytes)  # reduce-scatter + allgather, never compressed
    return cross.raw, cross.wire, merge_sends(local, cross.sends)
