"""The dashboard fed by real engines: what ``%%taco_run`` shows while and after a training cell runs."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from IPython.core.error import UsageError

import taco_notebook
from taco_notebook.cluster.cells.run import CellOptions, run_cell
from taco_notebook.errors import RankFailedError, TacoError
from taco_notebook.plan.output import RankOutput
from taco_notebook.widgets import dashboard as dashboard_module
from taco_notebook.widgets.legend import LEGEND_WIDTH_PX, legend_labels, legend_width

pytestmark = pytest.mark.cluster

TRAIN = """\
import time
model = torch.nn.Linear(64, 1)
opt = taco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                samples_per_step=32)
for step in taco.progress(range({steps}), desc="train"):
    x = torch.randn(32, 64)
    opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()
    time.sleep({sleep})
    {fail}
"""


def train(steps: int = 30, sleep: float = 0.02, fail: str = "") -> str:
    return TRAIN.format(steps=steps, sleep=sleep, fail=fail)


class Recorder:
    """A real monitor that keeps what the wait loop handed it."""

    wants_metrics = True

    def __init__(self) -> None:
        self.updates: list[tuple[dict[int, Any], list[int]]] = []
        self.outcome: str | None = None

    def update(self, payloads: Mapping[int, Mapping[str, Any]], running: Sequence[int]) -> None:
        self.updates.append(({r: dict(p) for r, p in payloads.items()}, list(running)))

    def finish(self, outcome: str) -> None:
        self.outcome = outcome


def test_engines_publish_at_least_twice_a_second_and_the_final_state(shared_cluster):
    recorder = Recorder()
    run_cell(shared_cluster, train(steps=90, sleep=0.03), CellOptions(monitors=[recorder]), RankOutput())
    progress = [min(p["progress"]["n"] for p in payloads.values() if p.get("progress"))
                for payloads, _ in recorder.updates if payloads]  # fmt: skip
    assert len(set(progress)) >= 5, progress  # 90 x 30 ms ≈ 3 s of loop: ≥ 2 distinct updates per second
    final, running = recorder.updates[-1]
    assert sorted(final) == [0, 1, 2, 3] and running == []
    assert all(p["progress"]["n"] == 90 and p["metrics"]["steps"] == 90 for p in final.values())
    assert final[0]["metrics"]["samples"] == 90 * 32 and final[0]["metrics"]["collectives"] > 0
    assert recorder.outcome == "finished"


def test_text_summary_at_the_end_without_a_widget_frontend(ip, shared_cluster, capsys):
    ip.run_cell_magic("taco_run", "", train())
    out = capsys.readouterr().out
    summary = out[out.index("taco dashboard:"):].splitlines()
    assert summary[0].startswith("taco dashboard: cluster 'default' · finished · 4 ranks on 1 node · step 30 ·")
    assert summary[1].startswith("progress: train: 30/30 (100%)")
    assert summary[2].startswith("throughput: ") and "samples/s total" in summary[2]
    assert any(line.startswith("links: node 0->0 (intra)") for line in summary)
    assert taco_notebook.dashboard() is dashboard_module.last_dashboard()
    assert taco_notebook.dashboard().bar.value == 30


def test_a_cell_that_trains_nothing_shows_nothing(ip, shared_cluster, capsys):
    ip.run_cell_magic("taco_run", "", "x = 1")
    assert "taco dashboard" not in capsys.readouterr().out


def test_no_dashboard_prints_nothing_and_ranks_publish_nothing(ip, shared_cluster, capsys):
    ip.run_cell_magic("taco_run", "--no-dashboard", train(steps=5, sleep=0))
    assert "taco dashboard" not in capsys.readouterr().out
    publisher = ip.run_cell_magic("taco_run", "--no-dashboard --gather", "taco.metrics.sender()")
    assert publisher == [None] * 4


def test_widget_dashboard_holds_the_runs_data(ip, shared_cluster, monkeypatch, capsys):
    monkeypatch.setenv("TACO_DASHBOARD", "widget")
    monkeypatch.setenv("TACO_LINK_GBITS", "25")
    # a cluster of its own: two emulated nodes would restart the shared one under the other tests
    ip.run_cell_magic("taco_run", "-np 4 --cluster twonode --compression fp16 --intra-size 2",
                      train(steps=80, sleep=0.03))
    board = taco_notebook.dashboard()
    out = capsys.readouterr().out
    # the widget, not the text mode's print: a terminal shows the live view's repr, then the final picture's
    # text/plain (the summary), once (the final picture replaces the live view)
    assert "VBox(" in out and out.count("taco dashboard:") == 1
    throughput = board.stream.plots.throughput.sources["throughput"].data
    # 80 steps of 30 ms: the ranks' records draw a point every 0.05 s, whatever reached the notebook when
    assert len(throughput["time"]) >= 40 and throughput["total"][-1] > 0
    assert all(b > a for a, b in zip(throughput["time"], throughput["time"][1:], strict=False))
    assert not any(math.isnan(v) for name in ("total", "rank_0", "rank_3") for v in throughput[name])
    compression = board.stream.plots.compression.sources["compression"].data
    ratios = [r for r in compression["ratio"] if not math.isnan(r)]
    assert len(ratios) >= 20 and ratios[-1] == pytest.approx(2.0, rel=0.2)  # fp16 halves what crosses nodes
    summary = board.summary()  # the text says what the plots end on
    assert f"{throughput['average'][-1]:,.1f} samples/s total since training began" in summary
    assert f"{throughput['total'][-1]:,.1f} over the last 1 s" in summary
    assert f"compression: {compression['ratio'][-1]:.2f}x over the last 1 s" in summary
    assert all(p.figure.visible for p in (board.stream.plots.compression, board.stream.plots.node_links,
                                          board.stream.plots.step_time))  # fmt: skip
    assert board.nodes == 2 and board.bar.bar_style == "success" and "finished" in board.status.value
    colour_bar = board.stream.plots.node_links.figure.right[0]
    assert colour_bar.color_mapper.high == 25e9 / 8 and "capacity 3.1 GB/s" in colour_bar.title


def test_a_loop_that_sends_nothing_gets_its_progress_and_step_rate_only(ip, shared_cluster, monkeypatch, capsys):
    monkeypatch.setenv("TACO_DASHBOARD", "widget")
    ip.run_cell_magic("taco_run", "", "import time\nfor i in taco.progress(range(100)):\n    time.sleep(0.01)\n")
    capsys.readouterr()
    board = taco_notebook.dashboard()
    plots = board.stream.plots
    assert [p for p in plots.all() if p.figure.visible] == [plots.throughput]
    assert plots.throughput.figure.title.text.startswith("Step rate (steps/s")
    rate = plots.throughput.sources["throughput"].data["total"]
    assert len(rate) >= 15 and rate[-1] > 0  # ~1 s of loop: a point per 0.05 s
    assert " · step 100 · " in board.status.value and "100/100" in board.bar_text.value


TOKENS_LATER = """\
import time
for step in taco.progress(range(120)):
    time.sleep(0.02)
    taco.metrics.step(samples=32, tokens=4096 if step >= 60 else 0)  # a model that reports tokens after a while
"""


def test_the_throughput_legend_of_a_recorded_run_lists_tokens_once_they_are_reported(shared_cluster):
    """From what real ranks recorded: no greyed "tokens/s (total)" while no rank reports tokens, the
    entry once they do, and the legend under the plot within the width a plot beside another gets."""
    recorder = Recorder()
    run_cell(shared_cluster, TOKENS_LATER, CellOptions(monitors=[recorder]), RankOutput())
    board = dashboard_module.Dashboard({r: 0 for r in range(4)})
    fig = board.stream.plots.throughput.figure
    seen = []
    for payloads, running in recorder.updates:
        board.update(payloads, running=len(running), elapsed=0.0)
        seen.append(legend_labels(fig))
        assert fig.legend[0] in fig.below and legend_width(fig) <= LEGEND_WIDTH_PX, seen[-1]
    before = [labels for labels in seen if "tokens/s (total)" not in labels]
    assert before and before[-1] == ["raw", "total (smoothed)", "average since training began",
                                     "rank 0", "rank 1", "rank 2", "rank 3"]  # fmt: skip
    assert seen[-1] == [*before[-1][:3], "tokens/s (total)", *before[-1][3:]]
    assert seen.index(seen[-1]) == len(before)  # once it shows, it stays
    assert board.stream.plots.throughput.sources["throughput"].data["tokens"][-1] > 0


def test_a_failing_rank_freezes_the_dashboard_with_the_failure(ip, shared_cluster, capsys):
    fail = "if step == 10 and taco.rank() == 1: raise ValueError('bad batch')"
    with pytest.raises(RankFailedError):
        ip.run_cell_magic("taco_run", "", train(steps=30, sleep=0.01, fail=fail))
    out = capsys.readouterr().out
    assert "taco dashboard: cluster 'default' · failed: rank 1 raised" in out


@pytest.mark.parametrize("name, value, message", [
    ("TACO_DASHBOARD", "fancy", "TACO_DASHBOARD must be one of auto, widget, text, off"),
    ("TACO_LINK_GBITS", "fast", "TACO_LINK_GBITS must be a positive number of Gbit/s, got 'fast'"),
    ("TACO_LINK_GBITS", "-1", "TACO_LINK_GBITS must be a positive number of Gbit/s"),
])
def test_bad_dashboard_setting_is_a_usage_error(ip, monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=message):
        ip.run_cell_magic("taco_run", "-np 2 --cluster never", "x = 1")
    from taco_notebook.cluster.session import clusters

    assert "never" not in clusters


def test_taco_dashboard_before_any_run_says_what_makes_one(monkeypatch):
    monkeypatch.setattr(dashboard_module, "_last", None)
    with pytest.raises(TacoError, match="no dashboard yet"):
        taco_notebook.dashboard()


def test_the_registry_entry_shows_the_running_cell_and_its_step(shared_cluster):
    from taco_notebook.cluster.registry import files as registry

    seen = []

    class Peek(Recorder):
        def update(self, payloads, running):
            entry = registry.read_entry(registry.registry_dir(), shared_cluster.cluster_id)
            seen.append(entry and entry["model"]["run"])

    run_cell(shared_cluster, train(steps=60, sleep=0.03), CellOptions(monitors=[Peek()]), RankOutput())
    runs = [r for r in seen if r]
    assert runs and runs[0]["cell"] == "model = torch.nn.Linear(64, 1)" and runs[-1]["total"] == 60  # not an import
    assert max(r["step"] for r in runs) > 0 and any(r["samples_per_s"] for r in runs)
    entry = registry.read_entry(registry.registry_dir(), shared_cluster.cluster_id)
    assert entry is not None and entry["model"]["run"] is None  # cleared when the cell ended


def test_the_sidebar_and_the_dashboard_show_the_same_progress_of_real_ranks(shared_cluster, monkeypatch):
    """Ranks that run at different speeds (no collective holds them together): at every poll the registry's ``run``
    (what the sidebar shows) and the dashboard's bar both show the slowest rank's count."""
    from taco_notebook.cluster.cells import reporting
    from taco_notebook.model import cell_progress
    from taco_notebook.widgets.dashboard import CellDashboard

    cell = ("import time\nfor step in taco.progress(range(30), desc='uneven'):\n"
            "    time.sleep(0.02 if taco.rank() else 0.06)\n")
    recorder = Recorder()
    run_cell(shared_cluster, cell, CellOptions(monitors=[recorder]), RankOutput())
    monkeypatch.setattr(reporting, "WRITE_EVERY_S", 0.0)  # write the entry at every poll replayed below
    sidebar = reporting.RegistryRun(shared_cluster, cell)
    board = CellDashboard({r.rank: r.node for r in shared_cluster.ranks}, "text")
    uneven = 0
    try:
        for payloads, running in recorder.updates:
            if not any(p.get("progress") for p in payloads.values()):
                continue
            sidebar.update(payloads, running)
            board.update(payloads, running)
            counts = [p["progress"]["n"] for p in payloads.values() if p.get("progress")]
            uneven += min(counts) != max(counts)
            assert board.dashboard is not None and board.dashboard.progress is not None
            assert sidebar.run["step"] == board.dashboard.progress.n == min(counts)
            assert sidebar.run["step"] == cell_progress(payloads)["step"] and sidebar.run["total"] == 30
    finally:
        sidebar.finish("finished")
    assert uneven >= 2, "the ranks never differed: the test would not tell min from max"


def test_widget_cell_ends_with_one_static_picture_in_place_of_the_live_view(ip, shared_cluster, monkeypatch):
    """What a notebook keeps of a training cell: the live widget (and the BokehJS loader before it) are replaced,
    through their display ids, by the final picture (self-contained HTML) and the summary."""
    from IPython.core.displaypub import CapturingDisplayPublisher

    publisher = CapturingDisplayPublisher()
    monkeypatch.setattr(ip, "display_pub", publisher)
    monkeypatch.setenv("TACO_DASHBOARD", "widget")
    ip.run_cell_magic("taco_run", "", train(steps=40, sleep=0.02))
    shown = [o for o in publisher.outputs if not o["update"]]
    final = {o["transient"]["display_id"]: o["data"] for o in publisher.outputs if o["update"]}
    assert len(shown) == 2 and all(o["transient"]["display_id"] in final for o in shown)
    loader, live = shown
    assert "application/javascript" in loader["data"] and final[loader["transient"]["display_id"]] == {
        "text/plain": ""}
    assert "application/vnd.jupyter.widget-view+json" in live["data"]
    picture = final[live["transient"]["display_id"]]
    assert picture["text/plain"].startswith("taco dashboard: cluster 'default' · finished · 4 ranks on 1 node")
    assert "taco-static-dashboard" in picture["text/html"] and "40/40 (100%)" in picture["text/html"]

    monkeypatch.setenv("TACO_DASHBOARD", "text")
    ip.run_cell("taco.dashboard()")  # text mode: the summary, not a widget's repr
    assert publisher.outputs[-1]["data"] == {"text/plain": taco_notebook.dashboard().summary()}
