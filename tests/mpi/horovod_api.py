"""Run under ``mpiexec -n N`` (2 or 4; with LIGHT_INTRA_SIZE=2 on 4: two emulated nodes): every call of
``taco_notebook.horovod`` against its Horovod meaning. Prints 'OK <rank> <checks>' when all hold.

Written as a Horovod program would be (``hvd.*`` only, after ``hvd.init()``); expected values are computed
from the rank count, never hard-coded results.
"""

from __future__ import annotations

import warnings

import torch

import taco_notebook.horovod as hvd

torch.set_num_threads(1)
checks = 0


def check(condition: bool, what: object) -> None:
    global checks
    assert condition, what
    checks += 1


def raises(kind: type[BaseException], fn, match: str = "") -> None:
    try:
        fn()
    except kind as exc:
        check(match in str(exc), (match, str(exc)))
    else:
        raise AssertionError(f"expected {kind.__name__} from {fn}")


# --- before init: Horovod's ValueError, never a hang
check(not hvd.is_initialized(), "initialized before init()")
for call in (hvd.rank, hvd.size, hvd.local_rank, lambda: hvd.allreduce(torch.ones(1)),
             lambda: hvd.broadcast_object(1), lambda: hvd.allgather(torch.ones(1)), hvd.join,
             lambda: hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1))):
    raises(ValueError, call, "Horovod has not been initialized; use hvd.init().")
hvd.init()
hvd.init()  # idempotent
check(hvd.is_initialized(), "not initialized after init()")
r, n = hvd.rank(), hvd.size()
check(hvd.local_size() * hvd.cross_size() == n and 0 <= hvd.local_rank() < hvd.local_size(), "topology")
check(hvd.cross_rank() * hvd.local_size() + hvd.local_rank() == r, (hvd.cross_rank(), hvd.local_rank(), r))
check(hvd.is_homogeneous() and hvd.gloo_built() and hvd.mpi_built() and not hvd.mpi_enabled(), "built flags")
check(hvd.nccl_built() == 0 or torch.cuda.is_available(), "nccl_built without CUDA")
mean_rank = (n - 1) / 2

# --- allreduce: a new tensor, averaged by default; the input unchanged
x = torch.full((3, 2), float(r))
y = hvd.allreduce(x, name="x")
check(y is not x and torch.equal(x, torch.full((3, 2), float(r))), "allreduce changed its input")
check(torch.allclose(y, torch.full((3, 2), mean_rank)), y)
check(torch.equal(hvd.allreduce(x, op=hvd.Sum), torch.full((3, 2), float(n * mean_rank))), "Sum")
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    check(torch.equal(hvd.allreduce(x, average=False), torch.full((3, 2), float(n * mean_rank))), "average=False")
    check(torch.allclose(hvd.allreduce(x, average=True), y), "average=True")
raises(ValueError, lambda: hvd.allreduce(x, average=True, op=hvd.Sum), "supersedes average")
check(hvd.allreduce(torch.tensor([float(r)]), op=hvd.Min).item() == 0.0, "Min")
check(hvd.allreduce(torch.tensor([float(r)]), op=hvd.Max).item() == n - 1, "Max")
check(hvd.allreduce(torch.tensor([2.0]), op=hvd.Product).item() == 2.0 ** n, "Product")
raises(NotImplementedError, lambda: hvd.allreduce(x, op=hvd.Adasum), "Adasum")
# prescale before the sum, postscale after (and after the average)
check(torch.allclose(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
                     torch.full((3, 2), float(n * mean_rank))), "pre/postscale with Sum")
check(torch.allclose(hvd.allreduce(x, prescale_factor=3.0), torch.full((3, 2), 3 * mean_rank)), "prescale avg")
check(hvd.allreduce(torch.tensor([1.0]), op=hvd.Max, postscale_factor=4.0).item() == 4.0, "postscale Max")
# dtypes: 0-d, ints (average floor-divides, as Horovod), doubles, halves, non-contiguous
scalar = hvd.allreduce(torch.tensor(float(r)), name="loss")
check(scalar.dim() == 0 and abs(scalar.item() - mean_rank) < 1e-6, scalar)
ints = torch.tensor([r, 2 * r + 1], dtype=torch.int32)
check(hvd.allreduce(ints, op=hvd.Sum).tolist() == [n * (n - 1) // 2, n * n], "int Sum")
avg_ints = hvd.allreduce(ints)
check(avg_ints.dtype == torch.int32 and avg_ints.tolist() == [n * (n - 1) // 2 // n, n * n // n], avg_ints)
check(hvd.allreduce(torch.tensor(r, dtype=torch.int64), op=hvd.Sum).item() == n * (n - 1) // 2, "0-d int")
# Horovod's integer average truncates toward zero: -(2n-1)/n is -1 (floor would give -2)
neg = hvd.allreduce(torch.tensor([-1 if r else -n], dtype=torch.int32), op=hvd.Average)
check(neg.tolist() == [-1], ("integer average truncates toward zero", neg))
# Horovod's _parameter_names table: with no named_parameters, one name per parameter, unique across param groups
two = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
grouped = hvd.DistributedOptimizer(torch.optim.SGD([{"params": two[0].parameters()}, {"params": two[1].parameters()}],
                                                   lr=0.1))
check(sorted(grouped._parameter_names.values()) == [f"allreduce.noname.{i}.{j}" for i in range(2) for j in range(2)],
      grouped._parameter_names)
mine = sorted(grouped._parameter_names.values())
check(hvd.allgather_object(mine) == [mine] * n, "parameter names differ between ranks")
d = hvd.allreduce(torch.full((5,), r + 0.25, dtype=torch.float64))
check(d.dtype == torch.float64 and torch.allclose(d, torch.full((5,), mean_rank + 0.25, dtype=torch.float64)), d)
h = hvd.allreduce(torch.full((4,), float(r), dtype=torch.float16))
check(h.dtype == torch.float16 and torch.allclose(h.float(), torch.full((4,), mean_rank)), h)
base = torch.arange(12.0).reshape(3, 4) * (r + 1)
check(torch.allclose(hvd.allreduce(base.t()), (torch.arange(12.0).reshape(3, 4) * (n + 1) / 2).t()), "strided")
# compression: Horovod's and this project's, as objects of one kind
for compression, tol in ((hvd.Compression.none, 0), (hvd.Compression.fp16, 4e-3), (hvd.Compression.bf16, 4e-2),
                         (hvd.Compression.topk(1.0, threshold=0), 1e-6)):
    c = hvd.allreduce(torch.linspace(0, 1, 50) * (r + 1), compression=compression, name=f"c.{compression.spec}")
    check(c.dtype == torch.float32 and torch.allclose(c, torch.linspace(0, 1, 50) * (n + 1) / 2, atol=tol),
          (compression, c))


class Doubling(hvd.Compressor):
    """A user's own Horovod compressor: applied around the allreduce, as Horovod does."""

    @staticmethod
    def compress(tensor):
        return tensor * 2, "ctx"

    @staticmethod
    def decompress(tensor, ctx):
        assert ctx == "ctx"
        return tensor / 2


check(torch.allclose(hvd.allreduce(x, compression=Doubling), y), "custom Compressor")
# in place
z = torch.full((4,), float(r))
check(hvd.allreduce_(z, op=hvd.Sum) is z and z.tolist() == [float(n * mean_rank)] * 4, z)
# autograd through the out-of-place allreduce (gradient of a sum over ranks)
w = torch.ones(3, requires_grad=True)
(hvd.allreduce(w * (r + 1), op=hvd.Sum) * (r + 1)).sum().backward()
check(torch.allclose(w.grad, torch.full((3,), float((r + 1) * sum(k + 1 for k in range(n))))), w.grad)

# --- async handles: poll / synchronize, in and out of place, every op
a = torch.full((1000,), float(r))
h1 = hvd.allreduce_async(a, name="a1")
h2 = hvd.allreduce_async_(a, op=hvd.Sum, name="a2")
h3 = hvd.allreduce_async(torch.tensor([float(r)]), op=hvd.Max)
out1 = hvd.synchronize(h1)
check(torch.allclose(out1, torch.full((1000,), mean_rank)), "async average")
out2 = hvd.synchronize(h2)
check(out2 is a and a[0].item() == n * mean_rank, "async in place")
while not hvd.poll(h3):
    pass
check(hvd.synchronize(h3).item() == n - 1, "async Max")
check(hvd.synchronize(h3) is None, "a released handle gives None, as Horovod")
raises(ValueError, lambda: hvd.poll(h3), "unknown handle")
g_handle = hvd.grouped_allreduce_async([torch.ones(2) * r, torch.ones(3) * r], op=hvd.Sum)
check([t.tolist() for t in hvd.synchronize(g_handle)] == [[n * mean_rank] * 2, [n * mean_rank] * 3], "grouped")
grouped = [torch.ones(2) * r]
check(hvd.grouped_allreduce_(grouped)[0] is grouped[0] and grouped[0][0].item() == mean_rank, "grouped_")

# --- allgather with uneven first dimensions, 0-d, ints, async, autograd
mine = torch.full((r + 1, 2), float(r))
gathered = hvd.allgather(mine, name="g")
check(gathered.shape == (n * (n + 1) // 2, 2), gathered.shape)
check(gathered[:, 0].tolist() == [float(k) for k in range(n) for _ in range(k + 1)], gathered)
check(hvd.allgather(torch.tensor(r)).tolist() == list(range(n)), "allgather of 0-d")
check(hvd.synchronize(hvd.allgather_async(torch.tensor([r], dtype=torch.int64))).tolist() == list(range(n)), "ag")
empty = hvd.allgather(torch.empty(0, 3) if r == 0 else torch.ones(1, 3))
check(empty.shape == (n - 1, 3), empty.shape)
v = torch.ones(r + 1, requires_grad=True)
(hvd.allgather(v) * torch.arange(n * (n + 1) // 2, dtype=torch.float32)).sum().backward()
offset = r * (r + 1) // 2
# Horovod averages the gathered tensor's gradient over ranks: each rank's own rows of the (equal) upstream grads
check(torch.allclose(v.grad, torch.arange(offset, offset + r + 1, dtype=torch.float32)), v.grad)
# broadcast's gradient: the average of every rank's, on the root only
u = torch.ones(2, requires_grad=True)
(hvd.broadcast(u, root_rank=n - 1) * (r + 1)).sum().backward()
check(u.grad.tolist() == ([(n + 1) / 2] * 2 if r == n - 1 else [0.0, 0.0]), u.grad)

# --- broadcast(_) with root_rank, objects, parameters, optimizer state
root = n - 1
b = torch.full((3,), float(r))
got = hvd.broadcast(b, root_rank=root, name="b")
check(got is not b and b[0].item() == r and got.tolist() == [float(root)] * 3, "broadcast out of place")
check(hvd.broadcast_(b, root_rank=root) is b and b.tolist() == [float(root)] * 3, "broadcast_")
bi = torch.tensor(r * 10)
check(hvd.synchronize(hvd.broadcast_async_(bi, 1)) is bi and bi.item() == 10, "broadcast_async_ 0-d int")
check(hvd.synchronize(hvd.broadcast_async(torch.tensor([r]), 0)).tolist() == [0], "broadcast_async")
raises(ValueError, lambda: hvd.broadcast(b, root_rank=n), "root")
check(hvd.broadcast_object({"from": r, "list": [r] * r}, root_rank=root) == {"from": root, "list": [root] * root},
      "broadcast_object")
check(hvd.allgather_object(("rank", r, "x" * r)) == [("rank", k, "x" * k) for k in range(n)], "allgather_object")

torch.manual_seed(r)  # different weights everywhere
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
flat = torch.cat([t.detach().flatten().float() for t in model.state_dict().values()])
check(torch.equal(hvd.broadcast(flat, 0), flat), "broadcast_parameters(state_dict)")
torch.manual_seed(100 + r)
other = torch.nn.Linear(3, 2)
hvd.broadcast_parameters(other.named_parameters(), root_rank=root)
check(torch.equal(hvd.broadcast(other.weight.detach(), root), other.weight.detach()), "named_parameters")

# optimizer state: the root has stepped (Adam state, its lr changed); the others have not stepped at all
net = torch.nn.Linear(3, 2)
hvd.broadcast_parameters(net.state_dict(), root_rank=0)
adam = torch.optim.Adam(net.parameters(), lr=0.1, weight_decay=0.1)
before = [p.detach().clone() for p in net.parameters()]
if r == root:
    net(torch.ones(4, 3)).sum().backward()
    adam.step()
    adam.param_groups[0]["lr"] = 0.05
    before = [p.detach().clone() for p in net.parameters()]
hvd.broadcast_optimizer_state(adam, root_rank=root)
check(adam.param_groups[0]["lr"] == 0.05, adam.param_groups[0]["lr"])
check(all(torch.equal(p, q) for p, q in zip(net.parameters(), before, strict=True)),
      "broadcast_optimizer_state moved params")
state = adam.state_dict()["state"]
check(sorted(state) == [0, 1] and float(state[0]["step"]) == 1.0, state)
for t in (state[0]["exp_avg"], state[1]["exp_avg_sq"]):
    check(torch.equal(hvd.broadcast(t, root), t), "optimizer state differs")

# --- alltoall: equal parts, splits (returns received splits), autograd
at = torch.arange(2 * n, dtype=torch.float32) + 100 * r
out = hvd.alltoall(at)
check(out.tolist() == [float(100 * k + 2 * r + i) for k in range(n) for i in range(2)], out)
splits = [k + 1 for k in range(n)]  # send k+1 rows to rank k
rows = torch.full((sum(splits), 2), float(r))
recv, recv_splits = hvd.alltoall(rows, splits=splits)
check(recv_splits.tolist() == [r + 1] * n and recv[:, 0].tolist() == [float(k) for k in range(n) for _ in
                                                                        range(r + 1)], (recv, recv_splits))
raises(ValueError, lambda: hvd.alltoall(torch.ones(n + 1)) if n > 1 else hvd.alltoall(torch.ones(1), [2]), "divide")
ag = torch.ones(2 * n, requires_grad=True)
(hvd.alltoall(ag) * (r + 1)).sum().backward()
check(ag.grad.tolist() == [float(k + 1) for k in range(n) for _ in range(2)], ag.grad)

# --- join and barrier
hvd.barrier()
last = hvd.join()
check(0 <= last < n and last == hvd.broadcast_object(last, 0), last)
raises(ValueError, lambda: hvd.allreduce(x, process_set=hvd.ProcessSet([0])), "add_process_set")

# --- shutdown and init again (comm's group is rebuilt: same engine)
hvd.shutdown()
check(not hvd.is_initialized(), "initialized after shutdown()")
raises(ValueError, hvd.rank, "not been initialized")
hvd.init()
check(hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == n, "after re-init")

print(f"OK {r} {checks} checks", flush=True)
