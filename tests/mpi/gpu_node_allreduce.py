"""Run under ``mpiexec -n N`` on one host with one GPU and ``TACO_GPUS=auto``: ranks sharing the GPU reduce in it.

Checks that CUDA tensors of a one-node job whose ranks share a GPU go through the GPU's memory (CUDA IPC), not
gloo: exact sums for every dtype and awkward size, bitwise the same on every rank, across a growth of the slots;
back-to-back calls whose values change every time (a pass that read a slot too early would show); fp16/bf16 casts
within their precision; what it does not take (TopK, bool, ``shm`` off, CPU tensors) reduced correctly elsewhere.
Prints 'OK <rank>' when all hold.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import taco_notebook.comm as taco
from taco_notebook.comm.collectives import algorithms
from taco_notebook.comm.group import bootstrap

device = taco.device()
taco.init()
r, n = taco.rank(), taco.size()
assert device.type == "cuda" and torch.cuda.device_count() == 1 and n > 1, (device, n)
assert "cuda:gloo" in str(bootstrap.state.backend)


def segment():  # noqa: ANN201
    """This generation's slots on the GPU (None before the first CUDA allreduce)."""
    return algorithms._node_gpu.get(bootstrap.state.generation)


def calls() -> int:
    found = segment()
    return 0 if found is None else found.calls


def same_everywhere(t: torch.Tensor) -> bool:
    raw = t.contiguous().view(-1).view(torch.uint8).cpu().clone()
    every = [torch.empty_like(raw) for _ in range(n)]
    dist.all_gather(every, raw)
    return all(torch.equal(every[0], other) for other in every)


assert algorithms.resolve_algorithm(None) == "node"
for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int8,
              torch.uint8, torch.complex64):
    for numel in (1, n - 1, n + 1, 1_000_003, 5_000_011):
        t = (torch.arange(numel, device=device) % 3 + r).to(dtype)
        want = sum((torch.arange(numel) % 3 + k).to(torch.float64) for k in range(n))
        before = calls()
        taco.allreduce(t)
        assert calls() == before + 1, ("not through the GPU's memory", dtype, numel, segment().refused)
        got = (t.to(torch.complex128).real if dtype.is_complex else t.to(torch.float64)).cpu()
        assert torch.equal(got, want), (dtype, numel, got[:5], want[:5])
        assert same_everywhere(t), (dtype, numel)
assert segment().capacity >= 5_000_011 * 8 and segment().refused is None

# back to back, a new value each time, nothing waited for in between: a pass reading a slot before its owner
# wrote it (or after it moved on) gives a wrong sum
outs = []
for i in range(200):
    t = torch.full((4099,), float(r + i), device=device)
    outs.append(taco.allreduce_async(t))
for i, future in enumerate(outs):
    got = future.result()
    assert torch.equal(got, torch.full_like(got, float(n * i + n * (n - 1) // 2))), (i, got[:3])

# the other way to wait between passes (on the GPU, through interprocess events: what runs under MPS), the same
# sums; every rank switches, as the set-up decides for all
segment().on_gpu = not segment().on_gpu
outs = [taco.allreduce_async(torch.full((100_003,), float(r + i), device=device)) for i in range(50)]
for i, future in enumerate(outs):
    got = future.result()
    assert torch.equal(got, torch.full_like(got, float(n * i + n * (n - 1) // 2))), (segment().on_gpu, i, got[:3])
segment().on_gpu = not segment().on_gpu

# avg and a non-contiguous view
avg = torch.full((7,), float(r), device=device)
taco.allreduce(avg, op="avg")
assert torch.allclose(avg.cpu(), torch.full((7,), (n - 1) / 2)), avg
base = torch.arange(12.0, device=device).reshape(3, 4) * (r + 1)
taco.allreduce(base.t(), op="avg")
assert torch.allclose(base.cpu(), torch.arange(12.0).reshape(3, 4) * (n + 1) / 2)

# casts: through the slots in the wire dtype, the sum taken in float32
for spec, tol in (("fp16", 1e-3), ("bf16", 1e-2)):
    x = torch.linspace(-1, 1, 100_003, device=device) * (r + 1)
    exact = torch.linspace(-1, 1, 100_003, device=device) * (n * (n + 1) / 2)
    before = calls()
    taco.allreduce(x, compression=spec)
    assert calls() == before + 1, spec
    assert torch.allclose(x, exact, rtol=tol, atol=tol), (spec, (x - exact).abs().max())
    assert same_everywhere(x), spec

# not through the slots: TopK, bool, shm off, CPU tensors; each still right
before = calls()
k = torch.zeros(1000, device=device)
k[r] = 1.0
taco.allreduce(k, compression="topk:0.01")
assert k[:n].tolist() == [1.0] * n, k[:n]
flags = torch.tensor([r == 0, False], device=device)  # gloo's sum of bools is their "or"
taco.allreduce(flags)
assert flags.cpu().tolist() == [True, False], flags
cpu = torch.full((3,), float(r))
taco.allreduce(cpu)
assert cpu.tolist() == [float(n * (n - 1) // 2)] * 3
taco.configure(shm=False)
off = torch.ones(5, device=device)
taco.allreduce(off)
assert off.cpu().tolist() == [float(n)] * 5
taco.configure(reset=True)
assert calls() == before, "TopK, bool, a CPU tensor or shm=False went through the GPU's slots"

# the group rebuilt: new slots for the new generation, the old ones let go
taco.reinit()
again = torch.full((10,), 1.0, device=device)
taco.allreduce(again)
assert again.cpu().tolist() == [float(n)] * 10 and calls() == 1
print(f"OK {r}", flush=True)
