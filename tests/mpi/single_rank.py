"""Run under ``mpiexec -n 1``: with one rank, nothing is copied or communicated.

DistributedOptimizer and the DDP hook give exactly plain torch's parameters, with no hook on the gradients, no
fusion buffer made, no collective and no compression; ``taco.allreduce`` leaves the tensor where and as it was.
With a prescale factor the reduction still runs (the scaling is its work). Prints 'OK 0'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import taco_notebook.comm as taco
from taco_notebook.comm.config import compressor_for
from taco_notebook.comm.diagnostics import metrics
from taco_notebook.comm.training import hooks
from taco_notebook.comm.training.optimizer import DistributedOptimizer

torch.set_num_threads(1)
taco.init()
assert taco.size() == 1, taco.size()
COMPRESSIONS = ("none", "fp16", "topk:0.01:threshold=0", "powersgd:2:warmup=0:min_size=0")
gen = torch.Generator().manual_seed(5)
data = [(torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)) for _ in range(4)]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def grads(net: torch.nn.Module) -> list[torch.Tensor]:
    found = [p.grad for p in net.parameters()]
    assert all(g is not None for g in found), "a parameter has no gradient"
    return [g for g in found if g is not None]


def train(net: torch.nn.Module, opt: torch.optim.Optimizer, first: list[torch.Tensor] | None = None) -> None:
    for step, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(net(x), y).backward()
        before = [g.data_ptr() for g in grads(net)]
        opt.step()
        assert [g.data_ptr() for g in grads(net)] == before, "a gradient was replaced"
        if first is not None and step == 0:
            first.extend(g.clone() for g in grads(net))


plain = model()
plain_grads: list[torch.Tensor] = []
train(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), plain_grads)
want = [p.detach().clone() for p in plain.parameters()]

for spec in COMPRESSIONS:
    metrics.reset()
    compressor_for(spec).stats.reset()
    net = model()
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=net.named_parameters(), compression=spec)
    assert not opt._hooks, "hooks registered on a one-rank job"
    got_grads: list[torch.Tensor] = []
    train(net, opt, got_grads)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, plain_grads, strict=True)), spec
    assert all(torch.equal(p, w) for p, w in zip(net.parameters(), want, strict=True)), spec
    assert not any(b.allocated for b in opt.buckets), f"{spec}: a fusion buffer was made"
    snap = metrics.snapshot()
    assert snap["collectives"] == 0 and snap["wire_bytes"] == 0 and snap["steps"] == len(data), (spec, snap)
    assert compressor_for(spec).stats.tensors == 0, (spec, compressor_for(spec).stats)

    ddp_model = model()
    net = DDP(ddp_model)
    net.register_comm_hook(hooks.TacoHookState(compression=spec), hooks.allreduce_hook)
    train(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    assert all(torch.equal(p, w) for p, w in zip(ddp_model.parameters(), want, strict=True)), f"ddp {spec}"
    assert metrics.snapshot()["collectives"] == 0 and compressor_for(spec).stats.tensors == 0, f"ddp {spec}"
    del net

    t = torch.randn(1000, generator=gen)
    copy, where = t.clone(), t.data_ptr()
    taco.allreduce(t, op="avg", compression=spec)
    assert torch.equal(t, copy) and t.data_ptr() == where, spec

# A prescale factor is work to do even alone: the reduction runs (hooks on, buffers made), scaled.
net = model()
opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
                           prescale_factor=0.5)
assert opt._hooks
x, y = data[0]
F.cross_entropy(net(x), y).backward()
opt.step()
assert all(b.allocated for b in opt.buckets)
assert all(torch.equal(g, want * 0.5) for g, want in zip(grads(net), plain_grads, strict=True))
# remove_hooks() keeps them off whatever the world does next
opt.remove_hooks()
opt.step()
assert not opt._hooks

# On a GPU (skipped without one): the same one-rank steps on CUDA parameters wait for the host nowhere.
if torch.cuda.is_available() and taco.device().type == "cuda":
    device = taco.device()
    for spec in COMPRESSIONS:
        net = model().to(device)
        opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters(), compression=spec)
        x, y = data[0][0].to(device), data[0][1].to(device)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call in a step raises
        try:
            for _ in range(3):
                opt.zero_grad()
                F.cross_entropy(net(x), y).backward()
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert not any(b.allocated for b in opt.buckets), f"cuda {spec}: a fusion buffer was made"
    print("CUDA checked", flush=True)

taco.shutdown()
print("OK 0", flush=True)
