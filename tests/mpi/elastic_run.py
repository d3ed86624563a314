"""Under plain mpiexec: taco.elastic.run retries a function whose collective failed, from the last commit.

Every rank's first attempt fails at step 15 as a failed collective does (a RuntimeError); the retry must start
from the commit at step 10 with identical parameters on every rank, and finish.
"""

from __future__ import annotations

import torch

import taco_notebook.comm as taco

torch.manual_seed(taco.rank())  # different weights on purpose: the first sync makes them rank 0's
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = taco.elastic.State(model=model, optimizer=opt, step=0)
starts = []


@taco.elastic.run
def train(state: taco.elastic.State, steps: int) -> int:
    starts.append(state.step)
    while state.step < steps:
        model(torch.ones(2, 4)).sum().backward()
        for p in model.parameters():
            taco.allreduce(p.grad, op="avg")
        opt.step()
        opt.zero_grad()
        state.step += 1
        if state.step % 10 == 0:
            state.commit()
        if state.step == 15 and len(starts) == 1:
            raise RuntimeError("a peer reset the connection (simulated on every rank)")
    return state.step


done = train(state, 30)
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
check = weights.clone()
taco.allreduce(check, op="avg")
assert torch.allclose(weights, check), "ranks diverged"
print(f"rank {taco.rank()} starts {starts} done {done}", flush=True)
taco.shutdown()
