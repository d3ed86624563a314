"""The compression advisor: ``taco.tune`` on real ranks (restore between trials, the table, ``auto``, the DDP path,
bad input; checks in tests/mpi/tune.py), and its decision rules on measured numbers (pure, no ranks)."""

from __future__ import annotations

import re

import pytest

from taco_notebook.comm.training.advisor import PAYS, SLOPE_KEPT, Trial, advise, slope

from ..support.mpirun import run_mpi


def test_tune_restores_the_commit_between_trials_and_fills_the_table(mpiexec):
    result = run_mpi(mpiexec, 2, "tune.py", {"LIGHT_INTRA_SIZE": "1"}, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(re.findall(r"OK (\d+)", result.stdout)) == ["0", "1"], result.stdout + result.stderr


def trial(name: str, seconds: float, wire: float, losses: tuple[float, ...] = (2.0, 1.8, 1.6)) -> Trial:
    return Trial(name, seconds, wire, 1e8, losses, slope(losses))


def test_the_fastest_candidate_that_keeps_the_loss_is_recommended() -> None:
    result = advise([trial("none", 1.0, 100e6), trial("fp16", 0.6, 50e6), trial("topk:0.01", 0.3, 2e6,
                                                                                 (2.0, 1.99, 1.98)),
                     trial("powersgd:4", 0.5, 5e6, (2.0, 1.82, 1.64))], ranks=4, nodes=2, steps=3)
    verdicts = {t.candidate: t.verdict for t in result.trials}
    assert result.best == "powersgd:4" and verdicts["powersgd:4"] == "pays"
    assert verdicts["topk:0.01"].startswith("loss falls slower (0.05 of none's)")
    assert verdicts["fp16"] == "pays" and verdicts["none"] == "baseline"
    assert "2.00x faster than none" in result.reason
    assert [t.candidate for t in result.trials] == ["none", "fp16", "topk:0.01", "powersgd:4"]
    assert "* pays" in result.table() and "recommends powersgd:4" in str(result)


def test_nothing_pays_on_fast_links_and_the_reason_says_so() -> None:
    result = advise([trial("none", 1.0, 100e6), trial("fp16", 1.0 / (PAYS - 0.05), 50e6),
                     trial("bf16", 1.3, 50e6)], ranks=4, nodes=2)
    assert result.best == "none"
    assert "compression does not pay here: communication is not the bottleneck" in result.reason
    assert {t.candidate: t.verdict for t in result.trials} == {"none": "baseline", "fp16": "no faster",
                                                               "bf16": "slower"}


def test_one_node_one_rank_and_dense_tensors_never_pay() -> None:
    result = advise([trial("none", 1.0, 100e6), trial("topk:0.01", 0.5, 99e6)], ranks=2, nodes=1)
    assert result.best == "none" and "one node" in result.reason
    assert result.trials[1].verdict == "sends as much as none (tensors under its threshold go dense)"
    alone = advise([trial("none", 1.0, 0), trial("fp16", 0.5, 0)], ranks=1, nodes=1)
    assert alone.best == "none" and "one rank" in alone.reason
    assert alone.trials[1].verdict == "nothing crosses the network" and "on 1 rank, 1 node;" in str(alone)


def test_a_loss_that_does_not_fall_is_not_judged_and_a_diverging_one_is_refused() -> None:
    flat = (2.0, 2.0, 2.0)
    result = advise([trial("none", 1.0, 100e6, flat), trial("fp16", 0.5, 50e6, flat),
                     trial("bf16", 0.4, 50e6, (2.0, float("nan"), 3.0))], nodes=2)
    assert result.trials[1].verdict == "pays (loss not judged)" and result.trials[1].relative_slope is None
    assert result.trials[2].verdict == "loss not finite" and result.best == "fp16"
    assert 0 < SLOPE_KEPT < 1


def test_a_step_that_diverges_without_compression_gets_no_recommendation() -> None:
    nan = (-1.2e8, float("nan"), float("nan"))
    result = advise([trial("none", 1.0, 100e6, nan), trial("fp16", 0.5, 50e6, nan),
                     trial("topk:0.01", 0.4, 2e6, nan)], ranks=4, nodes=2, steps=3)
    assert result.diverged and [t.verdict for t in result.trials] == ["loss not finite"] * 3
    said = "recommends nothing: the step itself diverges: no candidate, none included, kept a finite loss"
    assert said in str(result)
    assert "not the bottleneck" not in str(result) and "* " not in result.table()
    assert str(result).endswith("--compression auto is unchanged: fix the step, then tune again.")
    rescued = advise([trial("none", 1.0, 100e6, nan), trial("fp16", 0.5, 50e6)], nodes=2)
    assert rescued.diverged and "only fp16 kept a finite one" in rescued.reason


@pytest.mark.parametrize("values, expected", [((3.0, 2.0, 1.0), -1.0), ((1.0,), 0.0), ((1.0, 1.5, 2.0, 2.5), 0.5)])
def test_slope_is_least_squares(values, expected) -> None:
    assert slope(values) == pytest.approx(expected)
