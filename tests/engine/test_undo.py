"""``%taco_cluster undo``: the rank's snapshot logic with real torch objects here (what counts as a change, the
memory bound, the reasons there is nothing to undo), then with real ranks: NaN written into the weights of a model
trained through ``taco.DistributedOptimizer`` is undone bit for bit on every rank, a cell that trains nothing
keeps the copy, and each reason for nothing to undo is a UsageError that names it."""

from __future__ import annotations

import gc
import re

import pytest
import torch
from IPython.core.error import UsageError

from taco_notebook.engine import undo
from taco_notebook.engine.tracked import Tracked


def _trained() -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, opt)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [
        v.clone() for values in opt.state.values() for v in values.values()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_copy_is_made_only_when_something_changed_and_restored_bit_for_bit() -> None:
    model, opt = _trained()
    rank = undo.Undo(lambda: Tracked(list(model.parameters()), [opt], []))
    rank.take()
    before = _state(model, opt)
    rank.take()
    assert (rank.copies, rank.kept) == (1, 1)  # nothing changed: the copy is kept
    _step(model, opt)  # in place: the tensors' counters move
    rank.take()
    assert (rank.copies, rank.kept) == (2, 1)
    before = _state(model, opt)
    weight, bias = list(model.parameters())[0], list(model.parameters())[3]  # 0.weight, 2.bias
    weight.data.fill_(float("nan"))  # through .data: no counter moves, the sampled elements do
    rank.take()
    assert rank.copies == 3
    weight.data.copy_(before[0])
    rank.take()
    opt.param_groups[0]["lr"] = 0.5  # a hyper-parameter
    rank.take()
    assert rank.copies == 5
    opt.param_groups[0]["lr"] = 0.01
    rank.take()
    before = _state(model, opt)
    with torch.no_grad():
        bias.fill_(float("nan"))
    _step(model, opt)
    report = rank.restore()
    assert _same(_state(model, opt), before)
    assert report == {"tensors": 4, "optimizers": 1, "states": 0, "dropped": 0, "new": 0, "unchanged": 0,
                      "bytes": sum(t.numel() * t.element_size() for t in before)}
    assert rank.restore()["unchanged"] == 1  # again: nothing had moved since
    _step(model, opt)  # the optimizer trains on its own copy: undoing again gives the same state
    assert rank.restore()["unchanged"] == 0
    assert _same(_state(model, opt), before)
    copies = rank.copies
    rank.take()
    assert rank.copies == copies  # after an undo the state is the copy's: nothing to copy


def test_the_memory_bound_and_taco_undo_turn_it_off_and_say_why(monkeypatch, capsys) -> None:
    model, opt = _trained()
    rank = undo.Undo(lambda: Tracked(list(model.parameters()), [opt], []))
    limit, reckoned = undo.memory_limit()
    assert 0 < limit < float("inf") and "0.25 of the" in reckoned and "shared by 1 rank " in reckoned
    monkeypatch.setattr(undo, "MEMORY_FRACTION", 1e-9)
    rank.take()
    _step(model, opt)
    rank.take()
    err = capsys.readouterr().err
    notices = re.findall(r"^\[taco\] undo is off for this cell: one copy of the [\d.]+ kB taco trains here would "
                         r"not fit comfortably in \d+ B, 1e-09 of the .*; TACO_UNDO=0 turns it off$", err, re.M)
    assert len(notices) == 1 and err.count("[taco]") == 1, err  # once per size
    with pytest.raises(undo.NothingToUndo, match=r"^undo was off for the last cell: one copy of the [\d.]+ kB taco "
                                                 r"trains here would not fit comfortably in \d+ B, 1e-09 of the"):
        rank.restore()
    monkeypatch.setattr(undo, "MEMORY_FRACTION", 0.25)
    monkeypatch.setenv(undo.OFF_ENV, "0")
    rank.take()
    assert rank.check() == "undo is off on this rank: TACO_UNDO=0" and rank.copies == 0


def test_nothing_to_undo_says_whether_nothing_was_tracked_registered_since_or_replaced() -> None:
    objects: list[Tracked] = [Tracked()]
    rank = undo.Undo(lambda: objects[0])
    assert "no %%taco_run cell has run on this rank" in str(rank.check())
    rank.take()
    assert rank.check() == undo.NOTHING_TRACKED
    model, opt = _trained()
    objects[0] = Tracked(list(model.parameters()), [opt], [])
    assert rank.check() == undo.REGISTERED_SINCE  # the model came in the last cell: no copy from before it
    rank.take()
    assert rank.check() is None
    objects[0] = Tracked()
    del model, opt
    gc.collect()
    assert rank.check() == undo.REPLACED
    with pytest.raises(undo.NothingToUndo, match="the last cell replaced the objects"):
        rank.restore()


# ---------------------------------------------------------------- with real ranks

TRAIN = """\
torch.manual_seed(0)
undo_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
undo_opt = taco.DistributedOptimizer(torch.optim.Adam(undo_model.parameters(), lr=0.01),
                                     named_parameters=undo_model.named_parameters())
def undo_train(steps):
    g = torch.Generator().manual_seed(taco.rank())
    for _ in range(steps):
        undo_opt.zero_grad()
        undo_model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        undo_opt.step()
undo_train(2)
import gc; gc.collect()  # the objects an earlier run of this cell made are gone: the sizes copied stay the same
"""
STATE = ("[p.detach().clone() for p in undo_model.parameters()] + [v.clone() for s in undo_opt.state.values() "
         "for v in s.values()]")
COUNTS = "from taco_notebook.engine.undo import rank_undo\n(rank_undo.copies, rank_undo.kept)"


def _gathered_equal(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return len(a) == len(b) == 4 and all(_same(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.cluster
def test_undo_restores_the_weights_before_a_cell_that_wrote_nan_bit_for_bit(ip, shared_cluster, capsys) -> None:
    ip.run_cell_magic("taco_run", "", TRAIN)
    ip.run_cell_magic("taco_run", "", "undo_train(1)")
    before = ip.run_cell_magic("taco_run", "--gather", STATE)  # this cell's start copied what undo_train(1) made
    counts = ip.run_cell_magic("taco_run", "--gather", COUNTS)
    ip.run_cell_magic("taco_run", "", "pass")
    after = ip.run_cell_magic("taco_run", "--gather", COUNTS)
    # a cell that trains nothing keeps the copy: two more cells started, no copy made
    assert [(c, k + 2) for c, k in counts] == after, (counts, after)
    capsys.readouterr()
    nan = ip.run_cell_magic("taco_run", "--gather --no-check-replicas",
                            "with torch.no_grad():\n    undo_model[0].weight.fill_(float('nan'))\nundo_train(1)\n"
                            "bool(undo_model[2].weight.isnan().any())")
    assert nan == [True] * 4  # Adam's state too: the NaN went through a step
    ip.run_line_magic("taco_cluster", "undo")
    out = capsys.readouterr().out
    assert re.search(r"^\[taco\] undo: ranks 0-3 back to before the last cell \(\d+ tensors \+ \d+ optimizers?( \+ "
                     r"\d+ elastic States?)?, [\d.]+ [kM]B each\)", out, re.M), out
    assert "nothing moved" not in out
    assert _gathered_equal(ip.run_cell_magic("taco_run", "--gather", STATE), before)
    ip.run_line_magic("taco_cluster", "undo")  # the last cell, the gather, changed nothing: said so
    assert "that cell had changed none of it, so nothing moved" in capsys.readouterr().out
    assert _gathered_equal(ip.run_cell_magic("taco_run", "--gather", STATE), before)
    ip.run_cell_magic("taco_run", "", "undo_train(1)")  # training goes on from there, the replicas agree
    assert ip.run_cell_magic("taco_run", "--gather", "taco.check_replicas(undo_model, undo_opt).ok") == [True] * 4


@pytest.mark.cluster
def test_undo_when_it_was_off_or_no_cluster_runs_is_a_usage_error_naming_why(ip, shared_cluster, capsys) -> None:
    ip.run_cell_magic("taco_run", "", TRAIN)
    try:
        ip.run_cell_magic("taco_run", "", "import taco_notebook.engine.undo as u\nu.MEMORY_FRACTION = 1e-12")
        capsys.readouterr()
        ip.run_cell_magic("taco_run", "", "undo_train(1)")
        ip.run_cell_magic("taco_run", "", "undo_train(1)")
        err = capsys.readouterr().err
        assert err.count("undo is off for this cell: one copy of the") == 1, err  # rank 0, once per size
        with pytest.raises(UsageError, match=r"nothing to undo, no rank was changed; ranks 0-3: undo was off for "
                                             r"the last cell: one copy of the [\d.]+ [kM]B taco trains here would not "
                                             r"fit comfortably in"):
            ip.run_line_magic("taco_cluster", "undo")
    finally:
        ip.run_cell_magic("taco_run", "", "import taco_notebook.engine.undo as u\nu.MEMORY_FRACTION = 0.25")
    try:
        ip.run_cell_magic("taco_run", "", "import os\nos.environ['TACO_UNDO'] = '0'")
        ip.run_cell_magic("taco_run", "", "undo_train(1)")
        with pytest.raises(UsageError, match=r"ranks 0-3: undo is off on this rank: TACO_UNDO=0"):
            ip.run_line_magic("taco_cluster", "undo")
    finally:
        ip.run_cell_magic("taco_run", "", "import os\nos.environ.pop('TACO_UNDO', None)")
    with pytest.raises(UsageError, match=r"%taco_cluster undo needs a running cluster; no cluster named 'nosuch'"):
        ip.run_line_magic("taco_cluster", "undo --cluster nosuch")


@pytest.mark.cluster
def test_only_the_ranks_of_a_targets_cell_are_put_back(ip, shared_cluster, capsys) -> None:
    ip.run_cell_magic("taco_run", "", TRAIN)
    before = ip.run_cell_magic("taco_run", "--gather", f"undo_train(1)\n{STATE}")  # the copies are from before it
    ip.run_cell_magic("taco_run", "--targets 1", "with torch.no_grad():\n    undo_model[0].bias.fill_(float('nan'))")
    # rank 1 goes back to before the NaN; the others, had they been put back too, to before undo_train(1)
    ip.run_line_magic("taco_cluster", "undo")
    assert "[taco] undo: rank 1 back to before the last cell" in capsys.readouterr().out
    assert _gathered_equal(ip.run_cell_magic("taco_run", "--gather", STATE), before)
