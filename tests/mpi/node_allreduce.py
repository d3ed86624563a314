"""Run under ``mpiexec -n N`` on one host: the node algorithm (one-node allreduce through shared memory).

Checks that ``auto`` resolves to it, that it gives the exact sum for every dtype and awkward size, bitwise the
same on every rank, through one chunk or several and after the segment grows; that what it does not take
(compression, bool, ``flat``, ``shm`` off) goes over gloo; and that the segment's file is gone once mapped.
Prints 'OK <rank>' when all hold.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import taco_notebook.comm as taco
from taco_notebook.comm.collectives import algorithms
from taco_notebook.comm.transport import pipeline

r, n = taco.rank(), taco.size()
assert taco.topology().num_nodes == 1 and n > 1


def through_node(run) -> bool:  # noqa: ANN001 - a callable
    """Whether ``run()`` went through the node's segment (its passes' clock moved)."""
    pipeline.reset_phases()
    run()
    return "scatter" in pipeline.phase_seconds


def same_everywhere(t: torch.Tensor) -> bool:
    """Whether every rank holds these exact bytes."""
    raw = t.contiguous().view(-1).view(torch.uint8).clone()
    every = [torch.empty_like(raw) for _ in range(n)]
    dist.all_gather(every, raw)
    return all(torch.equal(every[0], other) for other in every)


assert algorithms.resolve_algorithm(None) == "node"
assert algorithms.resolve_algorithm("flat") == "flat"

# exact sums, every dtype, sizes below the rank count, odd, and large enough to grow the segment twice
for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int8,
              torch.uint8, torch.complex64):
    for numel in (1, n - 1, n + 1, 1_000_003):
        t = (torch.arange(numel) % 3 + r).to(dtype)
        want = sum((torch.arange(numel) % 3 + k).to(torch.float64) for k in range(n))
        assert through_node(lambda t=t: taco.allreduce(t)), (dtype, numel)
        got = t.to(torch.complex128).real if dtype.is_complex else t.to(torch.float64)
        if dtype == torch.uint8 or dtype == torch.int8:  # wraps as every backend's integer sum does
            want = torch.tensor(want.to(torch.int64).tolist(), dtype=dtype).to(torch.float64)
        assert torch.equal(got, want), (dtype, numel, got[:5], want[:5])
        assert same_everywhere(t), (dtype, numel)
segment = algorithms.node_segment()
assert segment.growths >= 2 and segment.local_size == n, (segment.growths, segment.local_size)
assert not any(segment.tag in name for name in os.listdir(segment.location)), "the segment's name was left"

# the ranks agree on each collective through the segment too (its exchange), not over gloo: one exchange each,
# a mismatch in it still one error (tests/mpi/agreement.py runs every kind on one node)
said = segment._said
taco.allreduce(torch.ones(2))
taco.barrier()
assert segment._said == said + 2, (said, segment._said)

# avg, a non-contiguous view, 0 elements
avg = torch.full((5,), float(r))
taco.allreduce(avg, op="avg")
assert torch.allclose(avg, torch.full((5,), (n - 1) / 2)), avg
base = torch.arange(12.0).reshape(3, 4) * (r + 1)
taco.allreduce(base.t(), op="avg")
assert torch.allclose(base, torch.arange(12.0).reshape(3, 4) * (n + 1) / 2)
assert taco.allreduce(torch.empty(0)).numel() == 0

# several chunks (configure(chunk_mb=...)): each a round of its own through the segment, the same sum
taco.configure(chunk_mb=0.25)
big = torch.full((1 << 18,), float(r + 1))  # 1 MiB: four chunks
assert through_node(lambda: taco.allreduce(big))
assert torch.equal(big, torch.full((1 << 18,), float(n * (n + 1) // 2))) and same_everywhere(big)
taco.configure(reset=True)

# what the node algorithm does not take goes over gloo, with the same results
flags = torch.tensor([r == 0, False])  # gloo's sum of bools is their "or"
assert not through_node(lambda: taco.allreduce(flags))
assert flags.tolist() == [True, False], flags
topk = torch.full((64,), float(r + 1))
assert not through_node(lambda: taco.allreduce(topk, compression="fp16"))
assert torch.equal(topk, torch.full((64,), float(n * (n + 1) // 2)))
flat = torch.full((7,), float(r))
assert not through_node(lambda: taco.allreduce(flat, algorithm="flat"))
assert flat.tolist() == [float(sum(range(n)))] * 7
taco.configure(shm=False)
assert algorithms.resolve_algorithm(None) == "flat"
off = torch.ones(3)
assert not through_node(lambda: taco.allreduce(off))
assert off.tolist() == [float(n)] * 3
taco.configure(reset=True)

# a new process group builds a new segment; the old one is unmapped
old = algorithms.node_segment()
taco.reinit()
again = torch.ones(4)
assert through_node(lambda: taco.allreduce(again)) and again.tolist() == [float(n)] * 4
assert old.bytes is None and algorithms.node_segment() is not old

print(f"OK {r}", flush=True)
