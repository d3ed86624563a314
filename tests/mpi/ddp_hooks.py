"""Run under ``mpiexec -n 2``: taco's DDP comm hook over several buckets, every way DDP is used, for 6 steps each.

Each compression (none, fp16, bf16, topk, powersgd) x each way of training (plain; ``no_sync()`` gradient
accumulation; ``static_graph=True``; ``find_unused_parameters=True`` with a branch that gets no gradient) keeps
the replicas identical on every rank after every step; with none, the parameters equal plain DDP's (no hook).
Then the state torch's own hooks take: None and the world group (taco's defaults), two models sharing that
default state, and a subgroup (a clear error). DDP rebuilds its buckets after the first iteration, so every case
runs on the rebuilt buckets from step 2 on; the compressors' memory must follow them and not grow.

Prints 'OK <rank>' when every check holds; any failed assert ends the rank with a traceback.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import taco_notebook.comm as taco
from taco_notebook.comm.config import compressor_for

torch.set_num_threads(1)
taco.init()
r, n = taco.rank(), taco.size()
STEPS = 6
SPECS = ("none", "fp16", "bf16", "topk:0.1:threshold=0", "powersgd:2:warmup=1:min_size=0")
TOLERANCE = {"none": 1e-6, "fp16": 1e-2, "bf16": 5e-2}  # against plain DDP; topk/powersgd: replicas only


class Net(torch.nn.Module):
    """Three weights and biases, ~13 KB of gradients: with bucket_cap_mb=0.0005 DDP makes 3 buckets.
    ``unused``: a fourth layer forward never calls (DDP needs find_unused_parameters=True for it)."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(16, 48), torch.nn.Linear(48, 48), torch.nn.Linear(48, 4)
        if unused:
            self.unused = torch.nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


torch.manual_seed(0)
XS, YS = torch.randn(64, 16), torch.randn(64, 4)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def same_everywhere(t: torch.Tensor) -> bool:
    copies = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(copies, t)
    return all(torch.equal(copies[0], c) for c in copies)


def train(state: object, how: str, hook: bool = True, model: DistributedDataParallel | None = None,
          steps: int = STEPS, label: str = "") -> DistributedDataParallel:
    """``steps`` SGD steps of a fresh DDP model (or ``model``), checking the replicas agree after each."""
    if model is None:
        torch.manual_seed(1)
        model = DistributedDataParallel(Net(unused=how == "find_unused"), bucket_cap_mb=0.0005,
                                        static_graph=how == "static_graph", find_unused_parameters=how == "find_unused")
        if hook:
            model.register_comm_hook(state, taco.hooks.allreduce_hook)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        sgd.zero_grad()
        x, y = XS[r::n], YS[r::n]
        if how == "no_sync":  # two micro-batches, the first one's gradients only accumulated locally
            with model.no_sync():
                torch.nn.functional.mse_loss(model(x[:16]), y[:16]).backward()
            x, y = x[16:], y[16:]
        torch.nn.functional.mse_loss(model(x), y).backward()
        sgd.step()
        assert same_everywhere(flat(model)), (label, how, step)
    return model


def remembered(spec: str) -> set[object]:
    """The allreduce names a compressor keeps something for (residuals, warm starts, layouts)."""
    memory = getattr(compressor_for(spec), "state", None)
    if memory is None:
        return set()
    names = set(getattr(memory, "layouts", {}))
    for key in memory.keys():  # (name, where), or a described tensor's ((name, where), index)
        while isinstance(key, tuple) and key and key[0] != "ddp-bucket":
            key = key[0]
        names.add(key)
    return names


buckets_seen = 0
for how in ("plain", "no_sync", "static_graph", "find_unused"):
    plain = flat(train(None, how, hook=False))
    for spec in SPECS:
        before = remembered(spec)
        state = taco.hooks.TacoHookState(compression=spec)
        ddp = train(state, how, label=spec)
        buckets_seen = max(buckets_seen, len(state.layouts))
        # what the compressor keeps follows the live buckets: DDP's first-iteration layout was forgotten
        assert len(state.layouts) == len(state.names) == len(set(state.owners.values())), (spec, how)
        assert remembered(spec) - before <= set(state.layouts), (spec, how, remembered(spec) - before)
        if spec in TOLERANCE:
            gap = float((flat(ddp) - plain).abs().max())
            assert gap <= TOLERANCE[spec], (spec, how, gap)
assert buckets_seen >= 3, f"the model should span several buckets, saw {buckets_seen}"

# --- the state torch's own hooks take: None and the world's group mean taco's defaults; equal to plain DDP
plain = flat(train(None, "plain", hook=False))
for state in (None, dist.group.WORLD, dist.distributed_c10d._get_default_group()):
    gap = float((flat(train(state, "plain", label=repr(state))) - plain).abs().max())
    assert gap <= 1e-6, (state, gap)

# --- two models sharing the default state, stepped in turn: neither forgets the other's buckets
taco.configure(compression="topk:0.1:threshold=0")
first, second = train(None, "plain", steps=1), train(None, "plain", steps=1)
for _ in range(4):
    train(None, "plain", model=first, steps=1)
    train(None, "plain", model=second, steps=1)
default = taco.hooks._state_of(None)
for model in (first, second):  # each model's 3 rebuilt buckets, each described once and still known
    mine = {id(p) for p in model.parameters()}
    sets = [packed for packed in default.names if set(packed) <= mine]
    assert len(sets) == 3 and all(default.names[packed][0] in default.layouts for packed in sets), sets
taco.configure(reset=True)

# --- a subgroup is refused with an error that names the way out, from the first backward
group = dist.new_group([0])
refused = DistributedDataParallel(Net(), bucket_cap_mb=0.0005)
refused.register_comm_hook(group, taco.hooks.allreduce_hook)
try:
    torch.nn.functional.mse_loss(refused(XS[r::n]), YS[r::n]).backward()
except Exception as exc:  # noqa: BLE001 - DDP wraps what the hook raised in its own error type
    assert "reduces over every rank" in str(exc) and "pass None" in str(exc), exc
else:
    sys.exit("a subgroup state should have been refused")

print(f"OK {r}", flush=True)
