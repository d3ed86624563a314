"""Run under ``mpiexec -n 2`` with LIGHT_INTRA_SIZE=1 (2 nodes of one rank): taco.tune on a small model.

Checks that every trial starts from the State's commit and that tuning leaves model, optimizer, counters and
compression as they were; the table's contents; what ``auto`` means before and after a tune; the
DDP path (hook with state None: the rank default is switched and put back); and bad input. Prints 'OK <rank>'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import taco_notebook.comm as taco
from taco_notebook.comm.training import advisor

torch.set_num_threads(1)
taco.init()
r = taco.rank()
assert taco.topology().num_nodes == 2
# threshold/min_size 0: the small model's tensors are compressed too (else they travel dense)
CANDIDATES = ["fp16", "topk:0.05:threshold=0", "powersgd:2:warmup=0:min_size=0"]


def make() -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    gen = torch.Generator().manual_seed(10 + r)
    means = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    data = []
    for _ in range(6):
        y = torch.randint(0, 4, (32,), generator=gen)
        data.append((means[y] + 0.5 * torch.randn(32, 64, generator=gen), y))
    return model, data


model, data = make()
opt = taco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                model.named_parameters(), compression="bf16")
state = taco.elastic.State(model=model, optimizer=opt, step=0)


def training_step(net: torch.nn.Module, optimizer: Any, counter: Any) -> Callable[[], torch.Tensor]:
    """The user's step as taco.tune takes it: one batch (chosen by the State's counter), backward, step."""

    def step() -> torch.Tensor:
        x, y = data[counter.step % len(data)]
        optimizer.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        counter.step += 1
        return loss

    return step


step = training_step(model, opt, state)


for _ in range(2):  # train a little and commit: tune must come back to this point, not to the start
    step()
state.commit()
committed = {k: v.clone() for k, v in model.state_dict().items()}
momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
step()  # uncommitted progress: tune starts from (and returns to) the commit
trial_starts = []
real_step = step


def counted_step() -> torch.Tensor:
    if state.step == 2:
        trial_starts.append(float(next(model.parameters()).detach().sum()))
    return real_step()


result = taco.tune(counted_step, state, candidates=CANDIDATES, steps=3, warmup=1)
assert all(torch.equal(v, committed[k]) for k, v in model.state_dict().items()), "model not restored"
assert all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in zip(model.parameters(), momentum,
                                                                           strict=True)), "optimizer not restored"
assert state.step == 2, state.counters
assert opt.compression.name == "bf16", opt.compression  # put back
# every trial (and none's second run) started from the same weights
assert len(trial_starts) == 5 and len(set(trial_starts)) == 1, trial_starts

names = [row["candidate"] for row in result.rows()]
assert names == ["none", "fp16", "topk:0.05:threshold=0", "powersgd:2:warmup=0:min_size=0"], names
rows = {row["candidate"]: row for row in result.rows()}
none_bytes = rows["none"]["wire_bytes_per_step"]
assert none_bytes > 0 and rows["none"]["verdict"] == "baseline" and rows["none"]["speedup"] == 1.0
assert abs(rows["fp16"]["wire_bytes_per_step"] / none_bytes - 0.5) < 0.02, rows["fp16"]
assert rows["topk:0.05:threshold=0"]["wire_bytes_per_step"] < 0.2 * none_bytes
assert rows["powersgd:2:warmup=0:min_size=0"]["wire_bytes_per_step"] < 0.5 * none_bytes
for row in rows.values():
    assert row["step_seconds"] > 0 and len(row["losses"]) == 3 and row["link_bytes_per_s"] > 0, row
    assert row["verdict"], row
assert rows["none"]["slope"] < 0, rows["none"]  # the loss falls over the 3 steps: slopes are compared
assert all(row["relative_slope"] is not None for row in rows.values())
assert result.best in names and (result.best == "none") == (not any(r["pays"] for r in rows.values()))
text = str(result)
assert all(name in text for name in names) and "speed-up" in text and f"recommends {result.best}" in text

# every rank decided the same
decided = [None] * taco.size()
torch.distributed.all_gather_object(decided, (result.best, [row["verdict"] for row in result.rows()]))
assert all(d == decided[0] for d in decided), decided

# --compression auto: the remembered choice, and none (saying so) before any tune
assert advisor.remembered() is result
spec, note = advisor.auto_choice()
assert spec.name == result.best and note.startswith(f"--compression auto: {result.best} (taco.tune's choice"), note
advisor.forget()
spec, note = advisor.auto_choice()
assert spec.name == "none" and "no taco.tune result on this cluster yet" in note, note

# the DDP path: a hook with state None follows the rank default, which tune switches and puts back
ddp_model, _ = make()
ddp = DDP(ddp_model)
ddp.register_comm_hook(None, taco.hooks.allreduce_hook)
sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
ddp_state = taco.elastic.State(model=ddp, optimizer=sgd, step=0)
start = {k: v.clone() for k, v in ddp.state_dict().items()}


ddp_step = training_step(ddp, sgd, ddp_state)


taco.configure(compression="fp16")
ddp_result = taco.tune(ddp_step, ddp_state, candidates=["topk:0.05:threshold=0"], steps=2, remember=False)
assert taco.settings().compression.name == "fp16" and advisor.remembered() is None
assert all(torch.equal(v, start[k]) for k, v in ddp.state_dict().items())
ddp_rows = {row["candidate"]: row for row in ddp_result.rows()}
assert ddp_rows["topk:0.05:threshold=0"]["wire_bytes_per_step"] < 0.2 * ddp_rows["none"]["wire_bytes_per_step"]
taco.configure(reset=True)


# bad input: a clear error, and nothing changed
def refused(error: type[Exception], text: str, *args: object, **kwargs: object) -> None:
    try:
        taco.tune(*args, **kwargs)
    except error as exc:
        assert text in str(exc), (text, str(exc))
    else:
        raise AssertionError(f"taco.tune{args, kwargs} was not refused")


refused(ValueError, "bad candidate 'zip'", step, state, candidates=["fp16", "zip"])
refused(ValueError, "steps must be an integer >= 1, got 0", step, state, steps=0)
refused(ValueError, "warmup must be an integer >= 0, got -1", step, state, warmup=-1)
refused(TypeError, "needs a taco.elastic.State", step, model)
refused(TypeError, "step must be a function", "step", state)
refused(TypeError, "step must return the loss", lambda: (real_step(), None)[1], state, candidates=["fp16"], steps=1)
assert all(torch.equal(v, committed[k]) for k, v in model.state_dict().items()) and state.step == 2
assert opt.compression.name == "bf16"
print(f"OK {r}", flush=True)
