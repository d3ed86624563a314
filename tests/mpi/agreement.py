"""Run under ``mpiexec -n N`` (N >= 2) with ``comm`` or ``hvd``: ranks that disagree get one error, every rank.

For each mismatch kind (shape, dtype, root, op, a call that is invalid on one rank only, another collective
altogether), rank 0 differs from the others; every rank must raise the same error, naming rank 0 and the
others, within a second, and the next collective must work. Then every dtype torch has goes through each
collective. Prints 'OK <rank> <checks> checks' when all hold.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from taco_notebook.comm.collectives.agreement import CollectiveMismatchError

FACE = sys.argv[1]
if FACE == "hvd":
    import taco_notebook.horovod as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
else:
    import taco_notebook.comm as taco

    r, n = taco.rank(), taco.size()

checks = 0
others = ", ".join(map(str, range(1, n)))
side = "rank 1" if n == 2 else f"ranks {others}"


def expect_mismatch(
    what: str, call: Callable[[], Any], error: type[BaseException] = CollectiveMismatchError, says: tuple[str, ...] = ()
) -> None:
    """``call`` raises ``error`` on this rank within a second, naming both sides; the next allreduce works."""
    global checks
    began = time.monotonic()
    try:
        call()
    except error as raised:
        took = time.monotonic() - began
        message = str(raised)
    else:
        raise AssertionError(f"{what}: no error on rank {r}")
    assert took < 1.0, f"{what}: took {took:.2f} s on rank {r}"
    if error is CollectiveMismatchError:
        assert "rank 0:" in message and f"{side}:" in message, message
    for text in says:
        assert text in message, (what, text, message)
    after = torch.full((3,), float(r + 1))
    total = float(n * (n + 1) // 2)
    if FACE == "hvd":
        assert hvd.allreduce(after, op=hvd.Sum).tolist() == [total] * 3
    else:
        assert taco.allreduce(after).tolist() == [total] * 3
    checks += 1


if FACE == "comm":
    expect_mismatch("shape", lambda: taco.allreduce(torch.ones(17 + (r == 0))), says=("shape [18]", "shape [17]"))
    expect_mismatch("same numel, other shape", lambda: taco.allreduce(torch.ones(6) if r else torch.ones(2, 3)))
    expect_mismatch(
        "dtype",
        lambda: taco.allreduce(torch.ones(4, dtype=torch.int32 if r == 0 else torch.float32)),
        says=("int32", "float32"),
    )
    expect_mismatch(
        "op", lambda: taco.allreduce(torch.ones(4), op="max" if r == 0 else "sum"), says=("op max", "op sum")
    )
    expect_mismatch("root", lambda: taco.broadcast(torch.ones(4), root=1 if r == 0 else 0), says=("root 1", "root 0"))
    expect_mismatch("broadcast shape", lambda: taco.broadcast(torch.ones(3 + (r == 0)), root=0))
    expect_mismatch("allgather trailing dims", lambda: taco.allgather(torch.ones(2, 3 + (r == 0))))
    expect_mismatch("alltoall trailing dims", lambda: taco.alltoall(torch.ones(n, 2 + (r == 0))))
    expect_mismatch("alltoall dtype", lambda: taco.alltoall(torch.ones(n, dtype=torch.int64 if r else torch.int8)))
    expect_mismatch(
        "different collectives",
        lambda: taco.allgather(torch.ones(2)) if r == 0 else taco.allreduce(torch.ones(2)),
        says=("allgather", "allreduce"),
    )
    # a call that fails its own checks on rank 0 only: rank 0 gets its ValueError, the others are told why
    if r == 0:
        expect_mismatch(
            "invalid root on one rank",
            lambda: taco.broadcast(torch.ones(2), root=n + 5),
            ValueError,
            says=(f"got {n + 5}",),
        )
    else:
        expect_mismatch(
            "invalid root on one rank",
            lambda: taco.broadcast(torch.ones(2), root=0),
            says=("invalid on this rank: ValueError",),
        )
    # allgather's row counts may differ (they ride on the check)
    rows = taco.allgather(torch.full((r + 1, 2), float(r)))
    assert rows.shape == (n * (n + 1) // 2, 2) and rows[-1].tolist() == [n - 1.0] * 2, rows
    checks += 1
    # async: the error comes out of the future, on every rank
    future = taco.allreduce_async(torch.ones(3 + (r == 0)), name="grad")
    expect_mismatch("async shape", future.result, says=("'grad'",))
    # every dtype torch has, through every collective
    for dtype in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    ):
        t = torch.full((5,), r + 1).to(dtype)
        if dtype is not torch.bool:
            assert taco.allreduce(t.clone()).to(torch.int64).tolist() == [n * (n + 1) // 2] * 5, dtype
            assert taco.allreduce(t.clone(), op="max").to(torch.int64).tolist() == [n] * 5, dtype
        b = taco.broadcast(torch.full((2, 3), r).to(dtype), root=n - 1)
        assert b.dtype == dtype and b.to(torch.int64).eq(int(bool(n - 1)) if dtype is torch.bool else n - 1).all()
        g = taco.allgather(torch.full((r + 1,), r).to(dtype))
        assert g.dtype == dtype and g.shape == (n * (n + 1) // 2,), (dtype, g)
        received, counts = taco.alltoall(torch.arange(2 * n).to(dtype))
        assert received.dtype == dtype and counts.tolist() == [2] * n, dtype
        checks += 1
    # sub-groups: the ranks after rank 0 reduce and gather among themselves; rank 0 is refused
    rest = taco.new_group(range(1, n))
    if r == 0:
        try:
            taco.allreduce(torch.ones(2), group=rest)
        except ValueError as error:
            assert "rank 0 is not in" in str(error), error
        else:
            raise AssertionError("a collective over a group without this rank did not raise")
    else:
        assert taco.allreduce(torch.ones(2), group=rest).tolist() == [n - 1.0] * 2
        assert taco.allgather(torch.full((1,), r), group=rest).tolist() == list(range(1, n))
        assert taco.broadcast(torch.full((1,), r), root=n - 1, group=rest).tolist() == [n - 1]
        assert taco.reduce_scatter(torch.ones(n - 1), group=rest).tolist() == [n - 1.0]
        taco.barrier(group=rest)
    checks += 1
    taco.barrier()
else:
    expect_mismatch("shape", lambda: hvd.allreduce(torch.ones(17 + (r == 0))), RuntimeError)
    expect_mismatch(
        "dtype",
        lambda: hvd.allreduce(torch.ones(4, dtype=torch.int32 if r == 0 else torch.float32)),
        RuntimeError,
        says=("int32", "float32"),
    )
    expect_mismatch("op", lambda: hvd.allreduce(torch.ones(4), op=hvd.Max if r == 0 else hvd.Sum), RuntimeError)
    expect_mismatch(
        "root",
        lambda: hvd.broadcast(torch.ones(4), root_rank=1 if r == 0 else 0),
        RuntimeError,
        says=("root 1", "root 0"),
    )
    expect_mismatch(
        "name", lambda: hvd.allreduce(torch.ones(4), name="a" if r == 0 else "b"), RuntimeError, says=("'a'", "'b'")
    )
    expect_mismatch("allgather", lambda: hvd.allgather(torch.ones(2, 3 + (r == 0))), RuntimeError)
    expect_mismatch("alltoall", lambda: hvd.alltoall(torch.ones(n, 2 + (r == 0))), RuntimeError)
    # duplicate names in flight: a ValueError on every rank, before anything starts
    handle = hvd.allreduce_async(torch.ones(3), name="dup")
    expect_mismatch(
        "duplicate name",
        lambda: hvd.allreduce_async(torch.ones(3), name="dup"),
        ValueError,
        says=("'dup'", "in flight"),
    )
    assert hvd.synchronize(handle).tolist() == [1.0] * 3
    hvd.synchronize(hvd.allreduce_async(torch.ones(3), name="dup"))  # free again once synchronized
    checks += 1
    # matched by name, as Horovod's coordinator matches: rank 0 starts a named operation before a barrier that
    # the others reach first; it waits for them (parked) instead of meeting their barrier
    began = time.monotonic()
    early = hvd.allreduce_async(torch.full((3,), r + 1.0), name="early", op=hvd.Sum) if r == 0 else 0
    hvd.barrier()
    if r > 0:
        early = hvd.allreduce_async(torch.full((3,), r + 1.0), name="early", op=hvd.Sum)
    assert hvd.synchronize(early).tolist() == [n * (n + 1) / 2] * 3  # rank 0's runs in order once waited for
    # nobody waits on rank 0: the others' operation meets rank 0's next collective, which runs the parked one first
    gathered = hvd.allgather_async(torch.full((1,), r), name="parked") if r == 0 else 0
    hvd.barrier()
    if r > 0:
        gathered = hvd.allgather_async(torch.full((1,), r), name="parked")
    hvd.barrier()
    assert hvd.poll(gathered) and hvd.synchronize(gathered).tolist() == list(range(n))
    assert time.monotonic() - began < 5.0
    checks += 1
    # int16 and friends, Horovod's way
    for dtype in (torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.bfloat16):
        t = torch.full((4,), r + 1).to(dtype)
        assert hvd.allreduce(t, op=hvd.Sum).to(torch.int64).tolist() == [n * (n + 1) // 2] * 4, dtype
        assert hvd.allgather(t).dtype == dtype and hvd.broadcast(t, 0).to(torch.int64).tolist() == [1] * 4
        checks += 1
    # reducescatter (Horovod's row split, averaged by default, differentiable), grouped allgather, sparse allreduce
    rows = [5 // n + (1 if k < 5 % n else 0) for k in range(n)]
    full = torch.arange(10.0).reshape(5, 2) * (n * (n + 1) / 2)
    mine = full[sum(rows[:r]) : sum(rows[: r + 1])]
    assert torch.equal(hvd.reducescatter(torch.arange(10.0).reshape(5, 2) * (r + 1), op=hvd.Sum), mine)
    assert torch.allclose(hvd.reducescatter(torch.arange(10.0).reshape(5, 2) * (r + 1)), mine / n)
    x = torch.ones(4, 3, requires_grad=True)
    hvd.reducescatter(x, op=hvd.Sum).sum().backward()
    assert torch.equal(x.grad, torch.full((4, 3), float(n))), x.grad  # Horovod's convention: times n for Sum
    y = torch.ones(4, 3, requires_grad=True)
    hvd.reducescatter(y).sum().backward()
    assert torch.equal(y.grad, torch.ones(4, 3)), y.grad  # and as is for Average
    scaled = hvd.reducescatter(torch.full((2 * n,), 3, dtype=torch.int32), op=hvd.Sum, prescale_factor=0.5)
    assert scaled.dtype == torch.int32 and scaled.tolist() == [n, n], scaled  # 3 * 0.5 truncated to 1 first
    part = hvd.reducescatter(torch.ones(4, dtype=torch.int16), op=hvd.Sum)
    assert part.dtype == torch.int16 and part.tolist() == [n] * (4 // n + (1 if r < 4 % n else 0)), part
    expect_mismatch("reducescatter shape", lambda: hvd.reducescatter(torch.ones(4 + (r == 0))), RuntimeError)
    both = hvd.grouped_allgather([torch.full((r + 1,), r), torch.ones(2, 2) * r])
    assert both[0].shape == (n * (n + 1) // 2,) and both[1].shape == (2 * n, 2), both
    sparse = torch.sparse_coo_tensor(torch.tensor([[r, 3]]), torch.tensor([1.0, 2.0]), (5,))
    dense = hvd.sparse_allreduce_async(sparse, name="emb", op=hvd.Sum)().coalesce().to_dense()
    expected = torch.zeros(5)
    expected[3] = 2.0 * n
    for k in range(n):
        expected[k] += 1.0
    assert torch.equal(dense, expected), dense
    # sparse gradients in DistributedOptimizer (Horovod's test_sparse_embeddings): reduced, handed back sparse
    emb = torch.nn.Embedding(10, 3, sparse=True)
    hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
    for as_dense in (False, True):
        sparse_opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                              sparse_as_dense=as_dense)
        sparse_opt.zero_grad()
        emb(torch.LongTensor([[1, 2, 4], [r, 9, 9]])).sum().backward()
        local = emb.weight.grad.to_dense().clone()
        sparse_opt.synchronize()
        assert emb.weight.grad.is_sparse and torch.allclose(emb.weight.grad.to_dense(), hvd.allreduce(local))
        with sparse_opt.skip_synchronize():
            sparse_opt.step()
        sparse_opt.remove_hooks()
    assert torch.equal(hvd.broadcast(emb.weight.detach().clone(), root_rank=0), emb.weight.detach())
    checks += 1
    # process sets: even and odd ranks each run their own collectives, checked among themselves
    evens, odds = [k for k in range(n) if k % 2 == 0], [k for k in range(n) if k % 2]
    even_set, odd_set = hvd.add_process_set(evens), hvd.add_process_set(hvd.ProcessSet(odds))
    mine, other = (even_set, odd_set) if r % 2 == 0 else (odd_set, even_set)
    members = evens if r % 2 == 0 else odds
    assert mine.included() and not other.included() and mine.rank() == members.index(r) and other.rank() == -1
    total = float(sum(k + 1 for k in members))
    assert hvd.allreduce(torch.full((2,), r + 1.0), op=hvd.Sum, process_set=mine).tolist() == [total] * 2
    assert hvd.allreduce(torch.full((2,), r + 1), process_set=mine).tolist() == [int(total) // len(members)] * 2
    assert hvd.allgather(torch.full((1,), r), process_set=mine).tolist() == members
    assert hvd.broadcast(torch.full((2,), r), members[-1], process_set=mine).tolist() == [members[-1]] * 2
    part = hvd.reducescatter(torch.ones(len(members), 2), op=hvd.Sum, process_set=mine)
    assert part.tolist() == [[float(len(members))] * 2], part
    assert hvd.broadcast_object({"from": r}, members[0], process_set=mine) == {"from": members[0]}
    hvd.barrier(process_set=mine)
    # DistributedOptimizer over a process set: each set averages its own gradients
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(),
                                   process_set=mine)
    model(torch.full((1, 2), r + 1.0)).sum().backward()  # the gradient is the input: r + 1
    opt.step()
    assert model.weight.tolist() == [[1.0 - total / len(members)] * 2], (model.weight, members)
    # ... and a rank outside the optimizer's set steps on its own gradients (Horovod's test_optimizer_process_sets)
    outside = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(),
                                       process_set=other)
    outside.zero_grad()
    model(torch.full((1, 2), r + 1.0)).sum().backward()
    outside.step()
    assert model.weight.tolist() == [[1.0 - total / len(members) - (r + 1)] * 2], model.weight
    if len(members) > 1:  # a mismatch inside one set names that set's ranks only
        message = ""
        try:
            hvd.allreduce(torch.ones(2 + (r == members[0])), process_set=mine)
        except RuntimeError as error:
            message = str(error)
        assert f"rank {members[0]}:" in message and f"rank {members[1]}" in message, message
    try:
        hvd.allreduce(torch.ones(2), process_set=other)
    except ValueError as error:
        assert f"rank {r} is not in" in str(error), error
    else:
        raise AssertionError("an op on a process set without this rank did not raise")
    assert hvd.remove_process_set(other) and hvd.remove_process_set(mine) and not hvd.remove_process_set(mine)
    try:
        hvd.allreduce(torch.ones(2), process_set=mine)
    except ValueError as error:
        assert "add_process_set" in str(error), error
    else:
        raise AssertionError("an op on a removed process set did not raise")
    checks += 1
    # join: ranks that finished feed zeros to the others' allreduces; other collectives raise on the others
    if r == 0:
        last = hvd.join()
    else:
        mean = hvd.allreduce(torch.full((3,), 6.0), name="late")
        assert mean.tolist() == [6.0 * (n - 1) / n] * 3, mean
        expect_joined = hvd.allgather
        try:
            expect_joined(torch.ones(2))
        except RuntimeError as error:
            assert "join()" in str(error), error
        else:
            raise AssertionError("allgather with a joined rank did not raise")
        last = hvd.join()
    assert last in range(1, n), last  # rank 0 joined first
    checks += 1
    hvd.barrier()

if FACE == "comm" and taco.num_nodes() > 1:  # a 2D job: each node's segment, then one cross-node step
    from taco_notebook.comm.collectives import algorithms

    tiers = algorithms.built_hierarchy()
    assert tiers is not None and tiers.segment is not None
    said = tiers.segment._said
    taco.allreduce(torch.ones(2))
    taco.barrier()
    assert tiers.segment._said == said + 2, (said, tiers.segment._said)

print(f"OK {r} {checks} checks", flush=True)
