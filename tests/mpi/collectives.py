"""Run under ``mpiexec -n N``: checks the rank-side API end to end; prints 'OK <rank>' when all hold."""

from __future__ import annotations

from datetime import timedelta

import torch

import taco_notebook.comm as taco
from taco_notebook.comm.collectives import algorithms
from taco_notebook.comm.collectives import ops as comm_collectives
from taco_notebook.comm.state import state as comm_state

r, n = taco.rank(), taco.size()
topology = taco.topology()

# sum, in place, same result on every rank
t = torch.full((3,), float(r))
assert taco.allreduce(t) is t
assert t.tolist() == [float(sum(range(n)))] * 3, t

# avg / min / max / product on odd sizes not divisible by the rank count
odd = torch.arange(7, dtype=torch.float64) + r
taco.allreduce(odd, op="avg")
assert torch.allclose(odd, torch.arange(7, dtype=torch.float64) + (n - 1) / 2), odd
m = torch.tensor([r, -r], dtype=torch.int32)
taco.allreduce(m, op="max")
assert m.tolist() == [n - 1, 0]
p = torch.tensor([2.0])
taco.allreduce(p, op="product")
assert p.item() == 2.0**n

# non-contiguous: the result lands in the caller's view
base = torch.arange(12.0).reshape(3, 4) * (r + 1)
view = base.t()
assert not view.is_contiguous()
taco.allreduce(view, op="avg")
assert torch.allclose(base, torch.arange(12.0).reshape(3, 4) * (n + 1) / 2)

# empty and 0-d tensors, mixed dtypes
empty = torch.empty(0)
assert taco.allreduce(empty).numel() == 0
scalar = torch.tensor(float(r))
taco.allreduce(scalar)
assert scalar.item() == sum(range(n))
half = torch.ones(5, dtype=torch.bfloat16)
taco.allreduce(half)
assert half.dtype == torch.bfloat16 and half.float().tolist() == [float(n)] * 5

# bad input: clear errors, nothing sent
for bad, kind in ((lambda: taco.allreduce([1, 2]), TypeError),
                  (lambda: taco.allreduce(torch.ones(1), op="mean"), ValueError),
                  (lambda: taco.allreduce(torch.ones(1, dtype=torch.int64), op="avg"), TypeError),
                  (lambda: taco.broadcast(torch.ones(1), root=n), ValueError)):
    try:
        bad()
    except kind as exc:
        assert str(exc), exc
    else:
        raise AssertionError(f"expected {kind.__name__}")

# broadcast and broadcast_parameters
b = torch.full((4,), float(r))
taco.broadcast(b, root=n - 1)
assert b.tolist() == [float(n - 1)] * 4
torch.manual_seed(r)  # every rank starts with different weights
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
taco.broadcast_parameters(model, root=0)
flat = torch.cat([v.detach().flatten().float() for v in model.state_dict().values()])
gathered = flat.clone()
taco.allreduce(gathered, op="avg")
assert torch.allclose(flat, gathered), "parameters differ after broadcast_parameters"

# allgather (uneven first dimensions), alltoall with splits, async min/max, pre/postscale
gathered_rows = taco.allgather(torch.full((r + 1,), float(r)))
assert gathered_rows.tolist() == [float(k) for k in range(n) for _ in range(k + 1)], gathered_rows
swapped, received = taco.alltoall(torch.arange(float(n)) + 10 * r, [1] * n)
assert swapped.tolist() == [10.0 * k + r for k in range(n)] and received.tolist() == [1] * n, swapped
assert comm_collectives.allreduce_async(torch.tensor([float(r)]), op="max").result().item() == n - 1
scaled = torch.ones(2)
taco.allreduce(scaled, prescale=2.0, postscale=0.25)
assert scaled.tolist() == [n / 2] * 2, scaled

# the process group can be rebuilt without restarting the processes
generation = comm_state.generation
tiers = algorithms.hierarchy()  # 2D groups (and a shm segment) when LIGHT_INTRA_SIZE splits the job
assert (tiers is not None) == (topology.num_nodes > 1 and topology.local_size > 1), (tiers, topology)
del tiers  # the groups die with the old generation
torn_down: list[int] = []
comm_state.on_teardown(lambda: torn_down.append(comm_state.generation))
taco.configure(collective_timeout=77)  # configure() reaches the next init()'s store and group
taco.reinit()
assert comm_state.generation == generation + 1
assert torn_down == [generation], torn_down  # shutdown ran the registered teardown callbacks
assert generation not in algorithms._hierarchy  # ... algorithms' among them: the old 2D groups are gone
assert comm_state.store.timeout == timedelta(seconds=77), comm_state.store.timeout
taco.configure(reset=True)
taco.barrier()
again = torch.ones(2)
taco.allreduce(again)
assert again.tolist() == [float(n)] * 2

topo = taco.topology()
print(f"OK {r} local={topo.local_rank}/{topo.local_size} node={topo.node}/{topo.num_nodes}", flush=True)
