"""Run under ``mpiexec -n 4`` with LIGHT_INTRA_SIZE=2 (2 emulated nodes): every algorithm and compression.

Prints 'OK <rank>' when every check holds; any failed assert ends the rank with a traceback.
"""

from __future__ import annotations

import sys

import torch

import taco_notebook.comm as taco
from taco_notebook.comm.collectives import algorithms

torch.set_num_threads(1)
r, n = taco.rank(), taco.size()
topo = taco.topology()
assert topo.num_nodes == 2 and topo.local_size == 2, topo


def same_everywhere(t: torch.Tensor) -> bool:
    copies = [torch.empty_like(t) for _ in range(n)]
    torch.distributed.all_gather(copies, t)
    return all(torch.equal(copies[0], c) for c in copies)


# --- every algorithm x compression on odd sizes; exact for none, within dtype tolerance for casts
for algorithm in ("flat", "2d"):
    for size in (1, 7, 1001, 3 * 1024 + 5):
        base = torch.arange(size, dtype=torch.float32) % 97
        t = base * (r + 1)
        taco.allreduce(t, algorithm=algorithm)
        assert torch.equal(t, base * sum(range(1, n + 1))), (algorithm, size)
        assert same_everywhere(t)
        for spec, tol in (("fp16", 1e-3), ("bf16", 1e-2)):
            c = (base + 0.5) * (r + 1) / 7
            taco.allreduce(c, op="avg", compression=spec, algorithm=algorithm)
            want = (base + 0.5) * (n + 1) / 2 / 7
            assert torch.allclose(c, want, rtol=tol, atol=tol), (algorithm, spec, (c - want).abs().max())
            assert c.dtype == torch.float32 and same_everywhere(c)

# --- pipelined 2D: shared-memory passes in chunks on their own thread, casts fused into the passes. Chunks of
# 4 KiB and of an odd size (not a multiple of the local size in bytes) force many chunks and a ragged last one.
for chunk_mb in (0.004, 0.0013):
    taco.configure(chunk_mb=chunk_mb)
    for size in (5, 4099, 20_001):
        base = torch.arange(size, dtype=torch.float32) % 97
        t = base * (r + 1)
        taco.allreduce(t, algorithm="2d")
        assert torch.equal(t, base * sum(range(1, n + 1))), (chunk_mb, size)  # exact for none
        wide = base.double() * (r + 1)
        taco.allreduce(wide, algorithm="2d")
        assert torch.equal(wide, base.double() * sum(range(1, n + 1))), (chunk_mb, size)
        for spec, tol in (("fp16", 1e-3), ("bf16", 1e-2)):
            c = (base + 0.5) * (r + 1) / 7
            taco.allreduce(c, op="avg", compression=spec, algorithm="2d")
            want = (base + 0.5) * (n + 1) / 2 / 7
            assert torch.allclose(c, want, rtol=tol, atol=tol), (chunk_mb, spec, (c - want).abs().max())
            assert c.dtype == torch.float32 and same_everywhere(c)
        for spec in ("topk:0.05:threshold=0", "powersgd:1:warmup=0:min_size=0"):
            c = torch.randn(size, generator=torch.Generator().manual_seed(r))
            taco.allreduce(c, compression=spec, algorithm="2d", name=("chunks", spec, chunk_mb, size))
            assert same_everywhere(c), (chunk_mb, spec, size)
taco.configure(chunk_mb=0.004)
taco.metrics.reset()
t = torch.ones(40_000)
taco.allreduce(t, compression="topk:0.01:threshold=0", algorithm="2d", name="chunked-m")
assert taco.metrics.snapshot()["compression_ratio"] > 10  # TopK ignores the chunk size: the shard goes whole
taco.configure(chunk_mb="auto")
calibration = algorithms.hierarchy().calibration
assert calibration is not None and calibration.pass_bytes_per_s > 0 and calibration.chunk_overhead_s > 0
agreed = torch.tensor([calibration.chunk_bytes(100 << 20)], dtype=torch.float64)
assert same_everywhere(agreed), agreed  # every rank cuts a buffer the same way

# --- TopK with error feedback: a constant gradient is fully delivered over steps; all ranks agree
for algorithm, chunk_mb in (("flat", "auto"), ("2d", "auto"), ("2d", 0.004)):
    taco.configure(chunk_mb=chunk_mb)
    g = torch.linspace(-1, 1, 4000) * (r + 1)
    delivered = torch.zeros_like(g)
    steps = 200  # the residual stays bounded (~1/ratio steps of gradient), so its share shrinks
    for _ in range(steps):
        out = g.clone()
        taco.allreduce(out, compression="topk:0.05:threshold=0", algorithm=algorithm,
                       name=("ef", algorithm, chunk_mb))
        assert same_everywhere(out)
        delivered += out
    truth = torch.linspace(-1, 1, 4000) * sum(range(1, n + 1)) * steps
    err = (delivered - truth).norm() / truth.norm()
    assert err < 0.08, (algorithm, chunk_mb, float(err))
taco.configure(chunk_mb="auto")

# --- TopK on 2D with shards large enough for the sampled selection (600K elements each): the exact answer. Every
# rank holds (r+1)·base, so the node sums are 3·base and 7·base, whose top-k in each shard are the same entries:
# the result is 10·base there and 0 elsewhere, exactly (integers below 2**24), on every rank, and the step after
# (residuals now in play) still leaves identical replicas.
gen = torch.Generator().manual_seed(3)
base = (torch.randperm(1_200_000, generator=gen) + 1).float() * torch.where(torch.rand(1_200_000, generator=gen) < 0.5,
                                                                             -1.0, 1.0)
want = torch.zeros_like(base)
for lo in (0, 600_000):
    top = torch.topk(base[lo:lo + 600_000].abs(), 6_000).indices + lo
    want[top] = 10 * base[top]
for step in range(2):
    out = base * (r + 1)
    taco.allreduce(out, compression="topk:0.01:threshold=0", algorithm="2d", name="large-shards")
    assert same_everywhere(out), step
    if step == 0:
        assert torch.equal(out, want), int((out != want).sum())

# --- metrics: bytes per link and compression ratio
taco.metrics.reset()
t = torch.ones(400_000)
taco.allreduce(t, compression="topk:0.01:threshold=0", algorithm="2d", name="m")
snap = taco.metrics.snapshot()
assert snap["compression_ratio"] > 10, snap["compression_ratio"]
other_node = 1 - topo.node
assert snap["sent_by_node"].get(other_node, 0) > 0 and snap["sent_by_node"].get(topo.node, 0) > 0, snap
cross_peer = topo.node_ranks[other_node][topo.local_rank]
assert set(r2 for r2 in snap["sent_by_rank"] if r2 in topo.node_ranks[other_node]) == {cross_peer}, snap

# --- DistributedOptimizer: same parameters everywhere after every step; fusion + overlap; accumulation
torch.manual_seed(0)
x, y = torch.randn(256, 32), torch.randn(256, 1)
for spec, fusion in (("none", 0.0), ("none", 64.0), ("fp16", 64.0), ("topk:0.1:threshold=0", 0.01)):
    torch.manual_seed(r)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    taco.broadcast_parameters(model)
    opt = taco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                    named_parameters=model.named_parameters(), compression=spec,
                                    fusion_mb=fusion, backward_passes_per_step=2)
    assert (len(opt.buckets) == 4) == (fusion == 0.0), (spec, fusion, len(opt.buckets))
    for step in range(10):
        opt.zero_grad()
        for half in (slice(r, 128, n), slice(128 + r, None, n)):
            torch.nn.functional.mse_loss(model(x[half]), y[half]).backward()
        opt.step()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        assert same_everywhere(flat), (spec, step)
    opt.remove_hooks()

# --- TopK 1% with error feedback trains to within 5% of uncompressed training's loss, same steps
def train(spec: str, steps: int = 500) -> float:
    """A regression with a noise floor (so the loss to match is not ~0) and 1% = 2 of 161 entries sent."""
    torch.manual_seed(7)
    xs, w = torch.randn(512, 32), torch.randn(32, 1)
    ys = torch.tanh(xs @ w / 4) + 0.1 * torch.randn(512, 1)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(32, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = taco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), compression=spec)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs[r::n]), ys[r::n]).backward()
        opt.step()
    opt.remove_hooks()
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(xs), ys)
    return float(final)


dense, sparse = train("none"), train("topk:0.01:threshold=0")
assert abs(sparse - dense) <= 0.05 * dense, f"topk final loss {sparse:.5f} vs uncompressed {dense:.5f}"
if r == 0:
    print(f"loss after 500 steps: uncompressed {dense:.5f}, topk 1% {sparse:.5f}", flush=True)

# --- DDP with taco's communication hook: unchanged DDP code, same parameters everywhere
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

for spec in ("none", "fp16"):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                                      torch.nn.Linear(64, 1)), bucket_cap_mb=0.01)
    ddp.register_comm_hook(taco.hooks.TacoHookState(compression=spec, algorithm="2d"), taco.hooks.allreduce_hook)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(5):
        sgd.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[r::n]), y[r::n]).backward()
        sgd.step()
        assert same_everywhere(torch.cat([p.detach().flatten() for p in ddp.parameters()])), (spec, step)

# --- bad input is a clear error
for bad, kind, words in ((lambda: taco.allreduce(torch.ones(2), compression="gzip"), ValueError, "unknown compression"),
                         (lambda: taco.allreduce(torch.ones(2), algorithm="3d"), ValueError, "unknown algorithm"),
                         (lambda: taco.DistributedOptimizer(object()), TypeError, "wraps a torch.optim.Optimizer"),
                         (lambda: taco.configure(fusion_mb=-1), ValueError, "fusion threshold"),
                         (lambda: taco.configure(chunk_mb="big"), ValueError, "pipeline chunk size must be")):
    try:
        bad()
    except kind as exc:
        assert words in str(exc), exc
    else:
        sys.exit(f"expected {kind.__name__} ({words})")

print(f"OK {r}", flush=True)
