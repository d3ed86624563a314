"""Step time from the steps themselves, the straggler as the bars show it, the end-of-run rate, and plots with too
few steps: real ``metrics`` on a fake clock, and synthetic Horovod-style runs (``synthetic.py``)."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
from bokeh.models.annotations import Label, Legend

from taco_notebook.comm.diagnostics import metrics
from taco_notebook.widgets import MetricsStream
from taco_notebook.widgets.steps import step_split, straggler

from .synthetic import SyntheticRun

STEP_S = 1 / 11.5  # 11.5 steps/s, as the user's run


def note(fig: Any) -> str | None:
    """The "not enough steps" note a figure shows, None when hidden; its legend must be hidden exactly then."""
    label = next(a for a in fig.center if isinstance(a, Label) and a.name == "too_few")
    legend = next(a for a in fig.below if isinstance(a, Legend))
    assert legend.visible != label.visible, (label.text, legend.visible)
    return label.text if label.visible else None


def replay(run: SyntheticRun, finish: bool = True) -> MetricsStream:
    stream = MetricsStream(run.node_of_rank)
    for batch in run.batches():
        stream.push(batch.values())
    if finish:
        stream.finish()
    return stream


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_rank_records_each_steps_time_and_the_end_of_its_last_step(monkeypatch) -> None:
    """Epochs of 20 steps of 87 ms, an evaluation of 1.5 s after each: the rank's recent steps hold 87 ms but for
    the one step that also timed an evaluation, and its series ends at its last step, not at the snapshot."""
    clock = Clock()
    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=clock))
    metrics.reset()
    clock.t += 2.0  # building the model: no loop marked its start, so the first step is not timed
    last_step = 0.0
    for _epoch in range(3):
        for _ in range(20):
            clock.t += STEP_S
            metrics.record(0.01, 1000, 500, {1: 500})  # 10 ms in collectives, 4 ms of it blocked on them
            metrics.add_wait(0.004)
            metrics.step(samples=32)
            last_step = clock.t
        clock.t += 1.5  # evaluation: no step
    snap = metrics.snapshot()
    metrics.reset()

    recent = snap["recent_steps"]
    assert len(recent) == metrics.STEPS_SENT and tuple(metrics.STEP_FIELDS) == ("seconds", "comm_seconds",
                                                                                  "wait_seconds")  # fmt: skip
    long = [r for r in recent if r[0] > 1.0]
    assert len(long) == 1 and long[0][0] == pytest.approx(1.5 + STEP_S)  # the first step of the last epoch
    assert all(r == pytest.approx([STEP_S, 0.01, 0.004], abs=1e-6) for r in recent if r[0] < 1.0)
    assert step_split(recent) == pytest.approx((STEP_S - 0.01, 0.006, 0.004), abs=1e-6)

    records = snap["series"]["records"]
    assert records[-1][:2] == [pytest.approx(last_step - 1000.0, abs=1e-3), 60]  # the last step's end
    assert snap["elapsed_seconds"] == pytest.approx(last_step + 1.5 - 1000.0)

    stream = MetricsStream({0: 0})
    stream.push([{**snap, "rank": 0, "node": 0}])
    stream.finish()
    bars = stream.plots.step_time.sources["step_time"].data
    assert bars["total"] == pytest.approx([STEP_S], abs=1e-6)  # 87 ms, not (87 ms x 20 + 1.5 s) / 20
    assert "slowest rank: 0 (0.087 s/step" in stream.summary()
    quoted = re.search(r"([\d,.]+) over the last 1 s up to the last step", stream.summary())
    rate = float(quoted.group(1).replace(",", ""))
    assert 11 * 32 <= rate <= 12 * 32  # 11.5 steps/s of 32 samples, not the 0 of the evaluation after them


def test_the_bars_show_the_steps_not_the_evaluation_after_them() -> None:
    """A Horovod-style run at 11.5 steps/s: every bar is 87 ms at every poll, the polls during and after the
    evaluations included (0.45-1.6 s/step came from counting those seconds as step time)."""
    run = SyntheticRun(ranks=4, ranks_per_node=2)
    stream = MetricsStream(run.node_of_rank)
    seen = []
    for batch in run.batches():
        stream.push(batch.values())
        totals = stream.plots.step_time.sources["step_time"].data["total"]
        if any(totals):
            seen.append(totals)
    stream.finish()
    assert len(seen) >= 30 and all(t == pytest.approx([STEP_S] * 4, abs=1e-5) for t in seen)
    assert stream.plots.step_time.sources["step_time"].data["total"] == pytest.approx([STEP_S] * 4, abs=1e-5)


def test_slowest_is_the_tallest_bar_for_the_outline_the_label_and_the_summary() -> None:
    """Rank 1 computes longest, but rank 2's step is longest: rank 2 is the slowest, everywhere."""
    steps = {0: [0.10, 0.05, 0.05], 1: [0.10, 0.0, 0.0], 2: [0.12, 0.06, 0.06], 3: [0.10, 0.05, 0.05]}
    run = SyntheticRun(ranks=4, ranks_per_node=2, epochs=1)
    batch = run.batch(2.0)
    for rank, step in steps.items():
        batch[rank]["recent_steps"] = [step] * 10
    stream = MetricsStream(run.node_of_rank)
    stream.push(batch.values())
    bars = stream.plots.step_time.sources["step_time"].data
    assert bars["total"] == pytest.approx([0.10, 0.10, 0.12, 0.10])
    assert max(range(4), key=lambda r: bars["compute"][r]) == 1  # the most compute ...
    assert bars["note"] == ["", "", "slowest", ""]  # ... but the tallest bar is rank 2's
    assert bars["outline"] == [None, None, "black", None]
    assert "slowest rank: 2 (0.120 s/step: compute 0.060 s" in stream.summary()
    # bars of one height (synchronous training): the one with the most compute, which its peers wait for
    assert straggler({0: 0.1, 1: 0.1, 2: 0.1}, {0: 0.05, 1: 0.09, 2: 0.05}) == 1
    assert straggler({0: 0.1, 1: 0.1}) == 0 and straggler({0: 0.0}) is None and step_split([]) is None


def test_the_summary_of_a_finished_run_quotes_the_rate_of_its_last_steps() -> None:
    """The run ends with an evaluation: the 1 s window before the cell's end holds no step (it read 0.00); the
    final picture and its summary end at the last step, at the rate of the steps before it."""
    run = SyntheticRun(ranks=4, ranks_per_node=2)
    last = run.step_ends[-1]
    in_last_second = sum(1 for end in run.step_ends if last - 1 < end <= last)
    stream = replay(run)
    data = stream.plots.throughput.sources["throughput"].data
    assert data["time"][-1] == pytest.approx(last, abs=1e-4)  # not the cell's end, 1.5 s later
    total = data["total"][-1]
    assert total == pytest.approx(in_last_second * 4 * 32, abs=4 * 32)  # every rank, 32 samples a step
    assert f"{total:,.1f} over the last 1 s up to the last step" in stream.summary()

    no_samples = SyntheticRun(ranks=4, ranks_per_node=2, samples_per_step=0)
    text = replay(no_samples).summary()
    rate = float(re.search(r"steps/s since training began, ([\d.]+) over the last 1 s up to", text).group(1))
    assert rate == pytest.approx(in_last_second, abs=1)  # steps/s of the slowest rank, not 0.00


def test_a_five_step_cell_says_not_enough_steps_instead_of_empty_plots() -> None:
    """Five steps in 50 ms: no rate over a 1 s window can be drawn (the final plot says so, no legend of four ranks
    over nothing); the bars say so until a rank has a timed step, then show the steps."""
    run = SyntheticRun(ranks=4, ranks_per_node=2, epochs=1, steps_per_epoch=5, steps_per_s=100, eval_s=0.2)
    stream = MetricsStream(run.node_of_rank)
    first, *rest = run.batches()
    stream.push(first.values())  # one step each: its time includes the setup, so it is not timed
    plots = stream.plots
    assert plots.step_time.figure.visible and note(plots.step_time.figure) == "not enough steps yet"
    for batch in rest:
        stream.push(batch.values())
    stream.finish()
    assert note(plots.throughput.figure) == "not enough steps"
    assert note(plots.step_time.figure) is None
    assert plots.step_time.sources["step_time"].data["total"] == pytest.approx([0.01] * 4)

    long_run = replay(SyntheticRun(ranks=4, ranks_per_node=2))
    assert note(long_run.plots.throughput.figure) is None and note(long_run.plots.step_time.figure) is None
    stream = MetricsStream({0: 0})
    lone = {**first[0]["series"], "records": first[0]["series"]["records"][-1:]}
    stream.push([{**first[0], "node": 0, "series": lone}])
    assert len(stream.plots.throughput.sources["throughput"].data["time"]) < 3  # a lone record: a point, no line
    assert note(stream.plots.throughput.figure) == "not enough steps yet"
