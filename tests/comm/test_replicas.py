"""The replica check: fingerprints and their comparison here; with real ranks, a rank whose parameters were
changed by a ``--targets`` cell is named after the next training cell, by hand and after the cell."""

from __future__ import annotations

import re

import pytest
import torch

from taco_notebook.comm.diagnostics.replicas import CAUSES, DIVERGED, _blocks, compare, fingerprint


def test_the_fingerprint_sees_one_changed_element_and_ignores_a_copy() -> None:
    weights = torch.randn(300_001)
    same = fingerprint(weights.clone())
    assert torch.equal(fingerprint(weights), same) and same.dtype == torch.float64 and same.shape == (3,)
    changed = weights.clone()
    changed[123_457] += 1e-3
    assert not torch.equal(fingerprint(changed), same)
    assert fingerprint(torch.arange(10)).tolist()[:2] == [45.0, 285.0]  # integers (an optimizer's step) too


def test_compare_names_the_minority_and_the_tensors() -> None:
    a, b = torch.randn(100), torch.randn(7)
    rows = torch.stack([fingerprint(a), fingerprint(b)])
    other = torch.stack([fingerprint(a * 1.01), fingerprint(b)])
    report = compare(["fc.weight", "fc.bias"], [rows, rows, other, rows])
    assert (report.differing, report.reference, report.count) == ([2], [0, 1, 3], 1)
    text = report.text()
    assert text.startswith("replicas differ: rank 2 holds other values than ranks 0, 1, 3 in 1 of 2 tensors; first:")
    assert re.search(r"^  fc\.weight: norm [\d.]+ on ranks 0, 1, 3; norm [\d.]+ on rank 2 \(1\.00e-02 apart\), sum off "
                     r"by [\d.e-]+$", text, re.M), text
    assert text.endswith(CAUSES)
    assert compare(["fc.weight", "fc.bias"], [rows, rows]).ok


def test_nan_everywhere_is_named_as_divergence_not_as_replicas_that_differ() -> None:
    weight, bias = torch.randn(100), torch.randn(7)
    weight[3] = float("nan")
    rows = torch.stack([fingerprint(weight), fingerprint(bias)])
    report = compare(["fc.weight", "fc.bias"], [rows.clone() for _ in range(4)])
    assert not report.ok and report.differing == [] and report.nonfinite == [0, 1, 2, 3]
    expected = f"non-finite values (NaN or inf) on all 4 ranks in 1 of 2 tensors, first: fc.weight; {DIVERGED}"
    assert report.text() == expected
    assert "apart" not in report.text() and "nan" not in report.text()


def test_inf_on_one_rank_is_named_and_the_finite_ranks_still_compared() -> None:
    weight, bias = torch.randn(100), torch.randn(7)
    rows = torch.stack([fingerprint(weight), fingerprint(bias)])
    blown = torch.stack([fingerprint(weight * float("inf")), fingerprint(bias)])
    other = torch.stack([fingerprint(weight), fingerprint(bias * 2)])
    report = compare(["fc.weight", "fc.bias"], [rows, blown, rows, other])
    assert report.nonfinite == [1] and report.differing == [3] and report.reference == [0, 2]
    first, second = report.text().split("\n")[:2]
    assert first.startswith("non-finite values (NaN or inf) on rank 1 in 1 of 2 tensors, first: fc.weight;")
    assert second == "replicas differ: rank 3 holds other values than ranks 0, 2 in 1 of 2 tensors; first:"


def test_ranks_that_track_other_tensors_differ() -> None:
    one = torch.stack([fingerprint(torch.ones(3))])
    count = torch.full((1, 3), 1.0, dtype=torch.float64)
    none = torch.full((1, 3), 0.0, dtype=torch.float64)
    blocks = _blocks(torch.cat([one, count, one, count, none]))  # ranks 0 and 1 track a tensor, rank 2 none
    assert [b.shape[0] for b in blocks] == [1, 1, 0]
    report = compare(["w"], blocks)
    assert report.differing == [2] and report.details == ["rank 2 tracks 0 tensors, ranks 0, 1 1"]


TRAIN = """\
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = taco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                named_parameters=model.named_parameters())
def train(steps):
    g = torch.Generator().manual_seed(taco.rank())
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
train(3)
"""


@pytest.mark.cluster
def test_a_rank_changed_by_a_targets_cell_is_named_after_the_next_training_cell(ip, shared_cluster, capsys) -> None:
    ip.run_cell_magic("taco_run", "", TRAIN)
    assert "replicas differ" not in capsys.readouterr().err  # trained together: they agree
    assert ip.run_cell_magic("taco_run", "--gather", "taco.check_replicas(model).ok") == [True] * 4
    ip.run_cell_magic("taco_run", "--targets 3", "with torch.no_grad():\n    model[0].weight[2, 5] += 0.01")
    assert "replicas differ" not in capsys.readouterr().err  # a --targets cell is not checked: its peers idle
    ip.run_cell_magic("taco_run", "", "train(2)")
    err = capsys.readouterr().err
    # 4 parameters and their 4 momentum buffers; the averaged gradients kept the momentum equal
    assert re.search(r"^\[taco\] replicas differ: rank 3 holds other values than ranks 0-2 in 1 of 8 tensors; "
                     r"first:\n  0\.weight: norm [\d.]+ on ranks 0-2; norm [\d.]+ on rank 3 \([\d.e+-]+ apart\), sum "
                     r"off by 0\.01$", err, re.M), err
    assert "a cell run with --targets that changed some ranks only" in err
    by_hand = "taco.check_replicas(model, opt, show=False).differing"
    assert ip.run_cell_magic("taco_run", "--gather", by_hand) == [[3]] * 4
    assert "replicas differ: rank 3" in capsys.readouterr().err  # that cell ran a collective: checked after it too
    ip.run_cell_magic("taco_run", "--no-check-replicas", "train(1)")
    assert "replicas differ" not in capsys.readouterr().err
    # the check itself never changed a rank: broadcasting rank 0's parameters and momentum makes them agree again
    ip.run_cell_magic("taco_run", "", "taco.broadcast_parameters(model)\n"
                      "for s in opt.state.values():\n    taco.broadcast(s['momentum_buffer'], 0)\ntrain(1)")
    assert "replicas differ" not in capsys.readouterr().err


DDP_AND_STATE = """\
torch.manual_seed(1)
net = torch.nn.Linear(8, 4)
ddp = torch.nn.parallel.DistributedDataParallel(net)
ddp.register_comm_hook(taco.hooks.TacoHookState(), taco.hooks.allreduce_hook)
sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
torch.manual_seed(2)
head = torch.nn.Linear(4, 1)
adam = torch.optim.Adam(head.parameters(), lr=0.01)
state = taco.elastic.State(model=head, optimizer=adam, step=0)
def train_both(steps):
    for _ in range(steps):
        sgd.zero_grad()
        ddp(torch.randn(4, 8)).pow(2).mean().backward()   # each rank its own data: DDP averages the gradients
        sgd.step()
        adam.zero_grad()
        head(torch.ones(2, 4)).sum().backward()            # the same on every rank
        adam.step()
        state.step += 1
train_both(2)
"""


@pytest.mark.cluster
def test_the_ddp_hook_and_elastic_state_register_what_they_train(ip, shared_cluster, capsys) -> None:
    """DDP with taco's comm hook (its parameters, unnamed) and a taco.elastic.State (its model and Adam's state,
    named): both checked after the cell; a rank changed behind their back is named."""
    ip.run_cell_magic("taco_run", "", DDP_AND_STATE)
    assert "replicas differ" not in capsys.readouterr().err
    ip.run_cell_magic("taco_run", "--targets 2", "with torch.no_grad():\n    net.bias[0] -= 0.5\n    head.weight[0, 1] "
                      "+= 0.25")
    ip.run_cell_magic("taco_run", "", "train_both(1)")
    err = capsys.readouterr().err
    # of 2 + 2 parameters, Adam's step, exp_avg and exp_avg_sq of the State's 2 (its gradients do not depend on
    # the weights: they stayed equal), and whatever earlier tests left on the shared cluster
    assert re.search(r"^\[taco\] replicas differ: rank 2 holds other values than ranks 0, 1, 3 in 2 of \d+ tensors",
                     err, re.M), err
    assert re.search(r"^  weight: norm .* on rank 2 .*, sum off by 0\.25$", err, re.M), err  # the State's, named
    assert re.search(r"^  unnamed parameter #\d \(4,\): norm [\d.]+ on ranks 0, 1, 3; norm [\d.]+ on rank 2 .* sum "
                     r"off by 0\.5$", err, re.M), err  # the DDP bias (the hook sees no names)
