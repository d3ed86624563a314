"""Run under ``mpiexec -n N``: ``hvd.DistributedOptimizer`` and ``hvd.SyncBatchNorm`` against Horovod's meaning.

- DistributedOptimizer, uncompressed, with ``backward_passes_per_step`` 1 and 2, ``op=Sum`` and
  ``gradient_predivide_factor``: the same parameters as one process training on every rank's batch at once;
- with every compression (fp16, bf16, TopK, PowerSGD): replicas stay identical over several steps;
- ``synchronize()`` + ``skip_synchronize()`` (gradient clipping), Horovod's once-only warnings, clear errors;
- SyncBatchNorm (1d and 2d, CPU) against one ``BatchNorm`` over the concatenated batch: output, running
  statistics, input and weight gradients.

Prints 'OK <rank> <checks>' when all hold.
"""

from __future__ import annotations

import warnings

import torch

import taco_notebook.horovod as hvd

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0


def check(condition: bool, what: object) -> None:
    global checks
    assert condition, what
    checks += 1


def identical_everywhere(model: torch.nn.Module) -> bool:
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return all(torch.equal(flat, other) for other in hvd.allgather_object(flat))


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def batches(step: int, per_rank: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's batch of this step, stacked in rank order (rank r uses rows r*per_rank...)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n * per_rank, 6, generator=g), torch.randint(0, 3, (n * per_rank,), generator=g)


def mine(t: torch.Tensor, per_rank: int = 4) -> torch.Tensor:
    return t[r * per_rank: (r + 1) * per_rank]


loss_fn = torch.nn.CrossEntropyLoss()

# --- uncompressed: equal to one process on the whole batch (Average of per-rank mean losses = global mean)
for passes, op, predivide in ((1, hvd.Average, 1.0), (2, hvd.Average, 1.0), (1, hvd.Sum, 1.0),
                              (1, hvd.Average, float(n))):
    model, reference = make_model(), make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=passes,
                                   op=op, gradient_predivide_factor=predivide)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(passes):
            x, y = batches(10 * step + micro)
            loss_fn(model(mine(x)), mine(y)).backward()
            scale = float(n) if op == hvd.Sum else 1.0  # a sum over ranks of per-rank means
            (loss_fn(reference(x), y) * scale).backward()
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        check(torch.allclose(p, q, atol=1e-5), (passes, op, predivide, (p - q).abs().max()))
    check(identical_everywhere(model), (passes, op))
    opt.remove_hooks()

# --- every compression: replicas identical, and training still reduces the loss
for compression in (hvd.Compression.none, hvd.Compression.fp16, hvd.Compression.bf16,
                    hvd.Compression.topk(0.1, threshold=0), hvd.Compression.powersgd(2, warmup=1, min_size=0)):
    model = make_model(seed=r)  # different starting weights: broadcast_parameters must fix that
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2),
                                   named_parameters=model.named_parameters(), compression=compression,
                                   backward_passes_per_step=2)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    x, y = batches(0, per_rank=16)
    first = None
    for _step in range(8):
        for _ in range(2):
            loss = loss_fn(model(mine(x, 16)), mine(y, 16))
            loss.backward()
        opt.step()
        opt.zero_grad()
        first = loss.item() if first is None else first
    check(identical_everywhere(model), compression)
    final = hvd.allreduce(torch.tensor(loss_fn(model(x), y).item()), name="final").item()
    check(final < hvd.allreduce(torch.tensor(first)).item(), (compression, first, final))
    opt.remove_hooks()

# --- synchronize() + skip_synchronize() to clip, step() after synchronize() warns once and stays correct
model = make_model()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
x, y = batches(5)
loss_fn(model(mine(x)), mine(y)).backward()
opt.synchronize()
torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
clipped = [p.grad.clone() for p in model.parameters()]
before = [p.detach().clone() for p in model.parameters()]
with opt.skip_synchronize():
    opt.step()  # must use the clipped, reduced gradients as they are: no second reduction
check(all(torch.allclose(p, b - 0.1 * g) for p, b, g in zip(model.parameters(), before, clipped, strict=True)),
      "skip_synchronize stepped on other gradients")
check(identical_everywhere(model), "skip_synchronize")
opt.zero_grad()
loss_fn(model(mine(x)), mine(y)).backward()
opt.synchronize()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt.step()
    opt.synchronize()
    opt.step()
said = [w for w in caught if "skip_synchronize" in str(w.message)]
check(len(said) == 1, [str(w.message) for w in caught])
check(identical_everywhere(model), "step() after synchronize()")
opt.remove_hooks()

# --- accepted with a warning, once; refused with a clear error
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        extra = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), sparse_as_dense=True,
                                         num_groups=2, process_set=hvd.global_process_set)
        extra.remove_hooks()
messages = [str(w.message) for w in caught]
# sparse_as_dense=True is what is done anyway (sparse gradients are reduced dense): accepted silently
check(not any("sparse_as_dense" in m for m in messages) and sum("num_groups" in m for m in messages) == 1, messages)
for kwargs, kind, words in (({"op": hvd.Adasum}, NotImplementedError, "Adasum"),
                            ({"op": hvd.Max}, ValueError, "hvd.Average or hvd.Sum"),
                            ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, ValueError, "op != Average"),
                            ({"compression": hvd.Compressor}, TypeError, "custom Compressor")):
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    except kind as exc:
        check(words in str(exc), (kwargs, str(exc)))
    else:
        raise AssertionError(f"no {kind.__name__} for {kwargs}")

# --- SyncBatchNorm on CPU against one BatchNorm over the concatenated batch
for dims, reference_cls in ((2, torch.nn.BatchNorm1d), (4, torch.nn.BatchNorm2d)):
    torch.manual_seed(7)
    shape = (n * 3, 5) if dims == 2 else (n * 3, 5, 4, 4)
    full = torch.randn(*shape) * 3 + 1
    upstream = torch.randn(*shape)
    reference = reference_cls(5, momentum=0.3)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-0.5, 0.5)
    sync = hvd.SyncBatchNorm(5, momentum=0.3)
    sync.load_state_dict(reference.state_dict())
    ref_in = full.clone().requires_grad_()
    ref_out = reference(ref_in)
    (ref_out * upstream).sum().backward()
    part = full[3 * r: 3 * r + 3].clone().requires_grad_()
    out = sync(part)
    (out * upstream[3 * r: 3 * r + 3]).sum().backward()
    expected = ref_out[3 * r: 3 * r + 3]
    check(torch.allclose(out, expected, atol=1e-5), ("forward", (out - expected).abs().max()))
    check(torch.allclose(sync.running_mean, reference.running_mean, atol=1e-5), "running_mean")
    check(torch.allclose(sync.running_var, reference.running_var, atol=1e-4), "running_var")
    check(torch.allclose(part.grad, ref_in.grad[3 * r: 3 * r + 3], atol=1e-5), ("grad input", dims))
    weight_grad = hvd.allreduce(sync.weight.grad, op=hvd.Sum)
    check(torch.allclose(weight_grad, reference.weight.grad, atol=1e-4), ("grad weight", dims))
    check(torch.allclose(hvd.allreduce(sync.bias.grad, op=hvd.Sum), reference.bias.grad, atol=1e-4), "grad bias")
    sync.eval()
    reference.eval()
    check(torch.allclose(sync(part.detach()), reference(full)[3 * r: 3 * r + 3], atol=1e-5), "eval")

# --- SyncBatchNorm trains inside a model with DistributedOptimizer (collectives interleave with buckets)
net = torch.nn.Sequential(torch.nn.Linear(6, 8), hvd.SyncBatchNorm(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
hvd.broadcast_parameters(net.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
for step in range(3):
    x, y = batches(step)
    opt.zero_grad()
    loss_fn(net(mine(x)), mine(y)).backward()
    opt.step()
check(identical_everywhere(net), "SyncBatchNorm model replicas")
check(all(torch.equal(net[1].running_mean, other) for other in hvd.allgather_object(net[1].running_mean)), "stats")
opt.remove_hooks()

print(f"OK {r} {checks} checks", flush=True)
