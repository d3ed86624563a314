"""The dashboard's pure parts: real bokeh figures fed with hand-made snapshots of 4 ranks on 2 nodes.

Counters grow linearly in time (``counter = rate * elapsed``), so every expected rate is the rate written here:
rank 0 sends rank 2 (the other node) 2 MB/s, i.e. 1,000,000 bytes per 0.5 s interval. Each snapshot carries the
series the rank would have recorded (one record per 0.05 s, the latest ``SERIES_SENT`` of them), as
``metrics.snapshot()`` does.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any

import pytest
from bokeh.core.validation import check_integrity
from bokeh.embed import json_item
from bokeh.models import GlyphRenderer

from taco_notebook.comm.diagnostics.metrics import RECORD_S, SERIES_FIELDS, SERIES_SENT, STEPS_SENT
from taco_notebook.model import cell_progress, slowest_rank
from taco_notebook.widgets import MetricsStream, build_plots, interval_between
from taco_notebook.widgets.dashboard import (
    CellDashboard,
    Dashboard,
    aggregate_progress,
    dashboard_mode,
    last_dashboard,
)
from taco_notebook.widgets.legend import FIGURE_PX, LEGEND_WIDTH_PX, legend_labels, legend_width
from taco_notebook.widgets.plots import format_bytes, format_rate, rank_column
from taco_notebook.widgets.series import SeriesBook
from taco_notebook.widgets.stream import is_new_run

NODE_OF_RANK = {0: 0, 1: 0, 2: 1, 3: 1}
LINK_BPS = {(0, 1): 1e5, (0, 2): 2e6, (1, 0): 1e5, (1, 3): 5e5, (2, 3): 4e5, (3, 2): 4e5, (2, 0): 3e5}
SAMPLES_PER_S = 120.0  # every rank: 6 samples per record
STEPS_PER_S = 4.0  # 0.25 s steps
WAIT_PER_STEP = {0: 0.05, 1: 0.05, 2: 0.05, 3: 0.0}  # rank 3 is the straggler: nobody waits less than it
RAW_BPS, WIRE_BPS = 8e6, 2e6  # per rank: ratio 4
CAPACITY = 3.125e9  # a 25 Gbit/s NIC


def snapshot(rank: int, elapsed: float) -> dict[str, Any]:
    """What ``metrics.snapshot()`` would return on ``rank`` after ``elapsed`` seconds of the run above."""
    sent = {dst: int(bps * elapsed) for (src, dst), bps in LINK_BPS.items() if src == rank}
    by_node: defaultdict[int, int] = defaultdict(int)
    for peer, nbytes in sent.items():
        by_node[NODE_OF_RANK[peer]] += nbytes
    steps = int(STEPS_PER_S * elapsed)
    raw, wire = int(RAW_BPS * elapsed), int(WIRE_BPS * elapsed)
    times = [round(k * RECORD_S, 4) for k in range(int(round(elapsed / RECORD_S)) + 1)]
    records = [[t, int(STEPS_PER_S * t), 0, round(SAMPLES_PER_S * t), 0, round(RAW_BPS * t), round(WIRE_BPS * t)]
               for t in times]  # fmt: skip
    first = max(len(records) - SERIES_SENT, 0)
    return {
        "rank": rank,
        "node": NODE_OF_RANK[rank],
        "steps": steps,
        "elapsed_seconds": elapsed,
        "collectives": steps,
        "comm_seconds": 0.1 * elapsed,
        "wait_seconds": WAIT_PER_STEP[rank] * steps,
        "samples": round(SAMPLES_PER_S * elapsed),
        "samples_per_s": SAMPLES_PER_S,
        "raw_bytes": raw,
        "wire_bytes": wire,
        "compression_ratio": raw / wire,
        "bytes_saved": raw - wire,
        "sent_by_rank": sent,
        "sent_by_node": dict(by_node),
        "last_step": {"seconds": 0.25, "compute_seconds": 0.25 - WAIT_PER_STEP[rank], "wait_seconds": 0.05},
        # every step but the first (it also timed the setup): 0.25 s, 0.025 s in collectives, the rank's wait
        "recent_steps": [[0.25, 0.025, WAIT_PER_STEP[rank]]] * min(max(steps - 1, 0), STEPS_SENT),
        "series": {"fields": list(SERIES_FIELDS), "first": first, "records": records[first:]},
    }


def batch(elapsed: float, ranks: tuple[int, ...] = (0, 1, 2, 3)) -> list[dict[str, Any]]:
    return [snapshot(r, elapsed) for r in ranks]


def cell(plot: Any, src: int, dst: int, column: str = "bps") -> Any:
    """What a link heatmap shows for src -> dst (``bps``: since the start; ``last``, ``label``, ``last_label``)."""
    data = plot.sources["links"].data
    for i, (s, d) in enumerate(zip(data["src"], data["dst"], strict=True)):
        if (s, d) == (str(src), str(dst)):
            return data[column][i]
    raise KeyError((src, dst))


def renderer_names(fig: Any) -> set[str]:
    return {r.name for r in fig.renderers if isinstance(r, GlyphRenderer)}


@pytest.fixture
def stream() -> MetricsStream:
    return MetricsStream(NODE_OF_RANK, capacity_bps=CAPACITY, rollover=3)


def test_builders_return_figures_with_their_renderers_and_sources() -> None:
    plots = build_plots(NODE_OF_RANK, capacity_bps=CAPACITY)

    throughput = plots.throughput
    names = {"total", "raw", "average", "tokens", "rank_0", "rank_1", "rank_2", "rank_3"}
    assert renderer_names(throughput.figure) == names
    assert set(throughput.sources["throughput"].data) == {"time"} | names
    assert throughput.sources["throughput"].name == "taco-throughput"  # found by name in the browser
    assert not next(r for r in throughput.figure.renderers if r.name == "tokens").visible  # until reported

    nodes = plots.node_links.sources["links"].data
    assert list(zip(nodes["src"], nodes["dst"], strict=True)) == [("0", "1"), ("1", "0")]  # between nodes only
    within = plots.rank_links.sources["links"].data
    assert list(zip(within["src"], within["dst"], strict=True)) == [("0", "1"), ("1", "0"), ("2", "3"), ("3", "2")]
    across = plots.rank_links_across.sources["links"].data
    assert len(across["bps"]) == 8 and ("0", "1") not in zip(across["src"], across["dst"], strict=True)
    for plot in (plots.node_links, plots.rank_links, plots.rank_links_across):
        assert {"cells", "labels"} == renderer_names(plot.figure)
        assert len(plot.figure.right) == 1  # one colour scale, one colour bar
        assert plot.figure.right[0].color_mapper.low == 0
        palette = plot.figure.right[0].color_mapper.palette
        assert _lightness(palette[0]) > 0.9 > _lightness(palette[-1])  # 0 B/s in the lightest colour
        assert not plot.figure.visible  # until one of its links carried bytes
    colour_bar = plots.node_links.figure.right[0]
    assert colour_bar.color_mapper.high == CAPACITY and "capacity 3.1 GB/s" in colour_bar.title
    assert plots.rank_links.figure.right[0].color_mapper.high is None  # shared memory: its own, automatic scale

    compression = plots.compression
    assert {"ratio", "saved_bytes"} <= renderer_names(compression.figure)
    saved = next(r for r in compression.figure.renderers if r.name == "saved_bytes")
    assert saved.y_range_name == "saved" and "saved" in compression.figure.extra_y_ranges
    assert not compression.figure.visible  # until something was compressed

    steps = plots.step_time
    assert steps.sources["step_time"].data["rank"] == ["0", "1", "2", "3"]
    stacked = [r for r in steps.figure.renderers if r.glyph.__class__.__name__ == "VBar"]
    assert len(stacked) == 3  # compute, overlapped communication, waiting


def _lightness(colour: str) -> float:
    return sum(int(colour[i : i + 2], 16) for i in (1, 3, 5)) / (3 * 255)


def test_heatmap_without_capacity_autoscales_and_says_nothing_of_capacity() -> None:
    plots = build_plots(NODE_OF_RANK)
    colour_bar = plots.rank_links_across.figure.right[0]
    assert colour_bar.color_mapper.high is None and "capacity" not in colour_bar.title


def test_the_first_batch_draws_the_history_its_records_hold(stream: MetricsStream) -> None:
    stream = MetricsStream(NODE_OF_RANK)
    assert stream.push(batch(1.0)) is None  # no interval for the bars yet
    throughput = stream.plots.throughput.sources["throughput"].data
    assert len(throughput["time"]) == 20 and throughput["time"][-1] == pytest.approx(1.0)  # a point per 0.05 s
    assert throughput["total"][-1] == pytest.approx(4 * SAMPLES_PER_S)
    assert throughput["average"] == pytest.approx([4 * SAMPLES_PER_S] * 20)
    assert cell(stream.plots.node_links, 0, 1) == pytest.approx(2.5e6)  # since the start: 0->2 and 1->3
    assert "4 ranks on 2 nodes" in stream.summary()


def test_series_are_smoothed_rates_on_one_grid_and_heatmaps_rates_since_the_start(stream: MetricsStream) -> None:
    stream = MetricsStream(NODE_OF_RANK)
    stream.push(batch(1.0))
    interval = stream.push(batch(1.5))
    assert interval is not None

    throughput = stream.plots.throughput.sources["throughput"].data
    assert throughput["time"] == pytest.approx([0.05 * k for k in range(1, 31)])  # continuous: no gap, no repeat
    assert throughput["total"][-1] == pytest.approx(4 * SAMPLES_PER_S)
    assert throughput[rank_column(2)] == pytest.approx([SAMPLES_PER_S] * 30)
    assert not any(math.isnan(v) for column in throughput.values() for v in column)

    # since the start: 1,000,000 bytes from rank 0 to rank 2 per 0.5 s; rank 1 -> rank 3 adds 0.5 MB/s to node 0 -> 1
    assert cell(stream.plots.rank_links_across, 0, 2) == pytest.approx(2e6)
    assert cell(stream.plots.rank_links_across, 0, 2, "last") == pytest.approx(2e6)  # the last interval, on hover
    assert cell(stream.plots.node_links, 0, 1) == pytest.approx(2.5e6)
    assert cell(stream.plots.node_links, 1, 0) == pytest.approx(3e5)
    assert cell(stream.plots.rank_links, 2, 3) == pytest.approx(4e5)  # within node 1: its own panel and scale
    assert cell(stream.plots.rank_links_across, 3, 0) == 0.0  # a silent link is 0, the lightest colour
    assert cell(stream.plots.rank_links_across, 0, 2, "label") == "2.0 MB/s"
    assert all(p.figure.visible for p in (stream.plots.node_links, stream.plots.rank_links,
                                          stream.plots.rank_links_across))  # fmt: skip

    compression = stream.plots.compression.sources["compression"].data
    assert stream.plots.compression.figure.visible
    assert compression["ratio"][-1] == pytest.approx(4.0)
    assert compression["saved_bytes"][-1] == pytest.approx(4 * (12_000_000 - 3_000_000))

    bars = stream.plots.step_time.sources["step_time"].data
    # 0.025 s of communication per step: hidden in the 0.05 s wait on ranks 0-2, overlapping compute on rank 3
    assert bars["compute"] == pytest.approx([0.20, 0.20, 0.20, 0.225])
    assert bars["comm"] == pytest.approx([0.0, 0.0, 0.0, 0.025])
    assert bars["wait"] == pytest.approx([0.05, 0.05, 0.05, 0.0])
    assert bars["note"] == ["", "", "", "slowest"]


def test_a_step_rate_change_shows_within_the_window_and_the_raw_rate_at_once() -> None:
    book = SeriesBook()
    # 10 steps/s for 2 s, then 30 steps/s: a record per 0.05 s
    records = [[t, 10 * t if t <= 2 else 20 + 30 * (t - 2), 0, 0, 0, 0, 0] for t in (k * 0.05 for k in range(81))]
    book.add(0, {"fields": SERIES_FIELDS, "first": 0, "records": records})
    points = book.points(book.times(0.0), [0])
    at = {round(t, 2): i for i, t in enumerate(points["time"])}
    assert points["total"][at[2.0]] == pytest.approx(10) and points["raw"][at[2.1]] == pytest.approx(30)
    assert points["total"][at[2.5]] == pytest.approx(20)  # half the 1 s window at each rate
    assert points["total"][at[4.0]] == pytest.approx(30) and points["average"][at[4.0]] == pytest.approx(20)


def test_a_payload_missed_costs_nothing_while_the_ring_reaches_back(stream: MetricsStream) -> None:
    stream = MetricsStream(NODE_OF_RANK)
    stream.push(batch(1.0))
    stream.push(batch(3.0))  # the snapshots at 1.5 .. 2.5 s never arrived; 3.0 s carries the last 64 records
    times = stream.plots.throughput.sources["throughput"].data["time"]
    assert times == pytest.approx([0.05 * k for k in range(1, 61)])
    assert stream.book.ranks[0].next == 61


def test_the_grid_coarsens_to_keep_a_long_run_cheap() -> None:
    stream = MetricsStream({0: 0})
    for elapsed in range(1, 80):  # 80 s at 20 records a second
        stream.push([snapshot(0, float(elapsed))])
    times = stream.plots.throughput.sources["throughput"].data["time"]
    assert len(times) <= 600 and times[0] == pytest.approx(stream.book.grid) and stream.book.grid > 0.05
    assert times[-1] == pytest.approx(79.0) and all(b > a for a, b in zip(times, times[1:], strict=False))


def test_rollover_keeps_only_the_latest_points(stream: MetricsStream) -> None:
    for elapsed in (1.0, 1.5):
        stream.push(batch(elapsed))
    assert stream.plots.throughput.sources["throughput"].data["time"] == pytest.approx([1.4, 1.45, 1.5])
    assert stream.plots.compression.sources["compression"].data["time"] == pytest.approx([1.4, 1.45, 1.5])


def test_a_rank_that_has_not_reported_holds_the_lines_back_not_the_heatmaps(stream: MetricsStream) -> None:
    stream = MetricsStream(NODE_OF_RANK)
    stream.push(batch(1.0))
    stream.push(batch(2.0, ranks=(0, 2, 3)))
    throughput = stream.plots.throughput.sources["throughput"].data
    assert throughput["time"][-1] == pytest.approx(1.0)  # rank 1's counts are known up to 1.0 s only
    assert cell(stream.plots.rank_links, 1, 0) == pytest.approx(1e5)  # its row keeps its rate: no grey row
    stream.push(batch(2.0))
    assert throughput["time"][-1] == pytest.approx(2.0) and len(throughput["time"]) == 40
    assert throughput[rank_column(1)] == pytest.approx([SAMPLES_PER_S] * 40)  # one continuous line


def test_counters_going_backwards_start_a_new_run(stream: MetricsStream) -> None:
    for elapsed in (1.0, 1.5, 2.0):
        stream.push(batch(elapsed))
    assert is_new_run(snapshot(0, 2.0), snapshot(0, 0.5))

    assert stream.push(batch(0.5)) is None  # the new run's first snapshot
    assert stream.new_runs == 1
    assert stream.plots.throughput.sources["throughput"].data["time"] == pytest.approx([0.4, 0.45, 0.5])
    bars = stream.plots.step_time.sources["step_time"].data  # the new run's own steps, none of the old run's
    assert bars["note"] == ["", "", "", "slowest"] and bars["total"] == pytest.approx([0.25] * 4)
    assert stream.step_split.keys() == {0, 1, 2, 3}
    assert cell(stream.plots.rank_links_across, 0, 2) == pytest.approx(2e6)


def test_a_repeated_batch_draws_nothing_new(stream: MetricsStream) -> None:
    stream.push(batch(1.0))
    stream.push(batch(1.5))
    assert stream.push(batch(1.5)) is None
    assert stream.plots.throughput.sources["throughput"].data["time"][-1] == pytest.approx(1.5)
    assert stream.new_runs == 0


def test_finish_draws_up_to_the_last_record_of_every_rank() -> None:
    stream = MetricsStream(NODE_OF_RANK)
    stream.push([snapshot(0, 2.0), snapshot(1, 1.5), snapshot(2, 2.0), snapshot(3, 2.0)])  # rank 1 ended early
    assert stream.plots.throughput.sources["throughput"].data["time"][-1] == pytest.approx(1.5)
    stream.finish()
    data = stream.plots.throughput.sources["throughput"].data
    assert data["time"][-1] == pytest.approx(2.0)
    assert data[rank_column(1)][-1] == pytest.approx(SAMPLES_PER_S / 2)  # it stopped at 1.5 s: half the window
    assert data["average"][-1] == pytest.approx((3 * 240 + 180) / 2.0)


def test_interval_without_traffic_has_nan_ratio_and_string_keys_are_read() -> None:
    before, after = snapshot(0, 1.0), snapshot(0, 2.0)
    after = json.loads(json.dumps(after))  # as if it crossed a JSON boundary: peer keys become strings
    after["raw_bytes"], after["wire_bytes"] = before["raw_bytes"], before["wire_bytes"]
    interval = interval_between({0: before}, {0: after})
    assert interval is not None
    assert math.isnan(interval.compression_ratio)
    assert interval.rank_bps[0, 2] == pytest.approx(2e6)
    assert interval.node_bps[0, 1] == pytest.approx(2e6)


def test_figures_serialise_for_bokehjs_without_a_cdn(stream: MetricsStream) -> None:
    stream.push(batch(1.0))
    stream.push(batch(1.5))
    stream.push(batch(2.0, ranks=(0, 2, 3)))  # NaNs in the sources must serialise too
    for plot in stream.plots.all():
        item = json_item(plot.figure)
        text = json.dumps(item)
        assert item["doc"]["roots"] and "cdn.bokeh.org" not in text
        issues = check_integrity([plot.figure])  # e.g. a glyph on a y range the figure lacks
        assert not issues.error and not issues.warning, issues


def test_summary_has_the_key_figures_and_they_are_the_plots_last_values(stream: MetricsStream) -> None:
    assert stream.summary() == "taco metrics: no snapshot yet"
    stream.push(batch(1.0))
    stream.push(batch(2.0))
    stream.finish()
    text = stream.summary()
    throughput = stream.plots.throughput.sources["throughput"].data
    assert f"{throughput['average'][-1]:,.1f} samples/s total since training began" in text
    assert f"{throughput['total'][-1]:,.1f} over the last 1 s" in text and "480.0 samples/s" in text
    assert f"({cell(stream.plots.node_links, 0, 1, 'label')})" in text  # the heatmap's rate since the start
    assert "node 0->1 5.0 MB (2.5 MB/s)" in text and "node 1->1 (intra) 1.6 MB" in text
    saved = format_bytes(stream.plots.compression.sources["compression"].data["saved_bytes"][-1])
    assert f"compression: 4.00x over the last 1 s (4.00x since the start), {saved} saved" in text
    assert saved == "48.0 MB"  # 4 ranks x (16 - 4) MB
    assert "slowest rank: 3 (0.250 s/step: compute 0.225 s, overlapped communication 0.025 s, wait 0.000 s" in text
    no_samples = MetricsStream(NODE_OF_RANK)
    no_samples.push([_without_samples(snap) for snap in batch(2.0)])
    # training began at the last record before the first step (0.2 s; step 1 closes at 0.25 s): 8 steps in 1.8 s
    assert "step rate: 4.44 steps/s since training began" in no_samples.summary()


def _without_samples(snap: dict[str, Any]) -> dict[str, Any]:
    records = [[*r[:3], 0, *r[4:]] for r in snap["series"]["records"]]
    return {**snap, "samples": 0, "series": {**snap["series"], "records": records}}


def test_a_loop_that_sends_nothing_shows_its_step_rate_and_nothing_else() -> None:
    board = Dashboard({0: 0, 1: 0})
    for elapsed, n in ((0.5, 50), (1.0, 100)):
        series = {"fields": SERIES_FIELDS, "first": 0,
                  "records": [[k * 0.05, 0, 5 * k, 0, 0, 0, 0] for k in range(int(elapsed / 0.05) + 1)]}  # fmt: skip
        payload = {r: {"metrics": {"rank": r, "node": 0, "steps": 0, "iterations": n, "elapsed_seconds": elapsed,
                                   "series": series},
                       "progress": {"n": n, "total": 600, "desc": "", "elapsed_seconds": elapsed}}
                   for r in (0, 1)}  # fmt: skip
        board.update(payload, running=2, elapsed=elapsed)
    board.finish("finished", elapsed=1.1)
    plots = board.stream.plots
    shown = [p for p in plots.all() if p.figure.visible]
    assert shown == [plots.throughput]
    assert [row.visible for row in board.layout.children] == [True, False, False]
    assert plots.throughput.figure.title.text.startswith("Step rate (steps/s")
    assert plots.throughput.sources["throughput"].data["total"][-1] == pytest.approx(100)
    assert " · step 100 · " in board.status.value and "100/600" in board.bar_text.value  # one step, everywhere


def test_from_snapshots_lays_out_the_ranks_it_sees() -> None:
    stream = MetricsStream.from_snapshots(batch(1.0, ranks=(0, 1)))
    assert stream.plots.step_time.sources["step_time"].data["rank"] == ["0", "1"]
    assert stream.latest.keys() == {0, 1}
    with pytest.raises(ValueError, match="rollover must be a positive number"):
        MetricsStream(NODE_OF_RANK, rollover=0)


def test_formatting() -> None:
    assert format_bytes(2e6) == "2.0 MB" and format_bytes(512) == "512 B" and format_bytes(float("nan")) == "-"
    assert format_rate(3.125e9) == "3.1 GB/s"


def test_without_samples_throughput_is_steps_per_second_and_tokens_appear_when_reported() -> None:
    stream = MetricsStream(NODE_OF_RANK)
    stream.push([_without_samples(snap) for snap in batch(1.0)])
    stream.push([_without_samples(snap) for snap in batch(1.5)])
    fig = stream.plots.throughput.figure
    assert stream.unit == "steps" and fig.title.text == "Step rate (steps/s, smoothed over 1 s)"
    assert stream.plots.throughput.sources["throughput"].data["total"][-1] == pytest.approx(STEPS_PER_S)

    with_tokens = batch(2.0)
    for snap in with_tokens:
        snap["tokens"] = 2000
        snap["series"]["records"] = [[*r[:4], 1000 * r[0], *r[5:]] for r in snap["series"]["records"]]
    stream.push(with_tokens)
    data = stream.plots.throughput.sources["throughput"].data
    assert stream.unit == "samples" and fig.yaxis[0].axis_label == "samples/s"
    assert data["time"][0] == pytest.approx(0.2) and len(data["time"]) == 37  # from the first step, at 0.25 s
    assert data["total"][-1] == pytest.approx(4 * 240)  # redrawn in samples/s: samples since 1.5 s
    assert next(r for r in fig.renderers if r.name == "tokens").visible
    assert data["tokens"][-1] == pytest.approx(4 * 2000)  # tokens since 1.5 s, over the 1 s window



def _assert_legends_fit_below(plots: Any) -> None:
    """Every legend sits under its plot (not over the data) and fits the width a plot beside another gets."""
    for plot in plots.all():
        fig = plot.figure
        if not fig.legend:
            continue  # the heatmaps: a colour bar, no legend
        legend = fig.legend[0]
        assert legend in fig.below and legend not in fig.center and legend.location == "center"
        assert legend.orientation == "horizontal" and isinstance(legend.ncols, int)
        assert legend_width(fig) <= LEGEND_WIDTH_PX, (fig.title.text, legend.ncols, legend_labels(fig))
        rows = math.ceil(len(legend_labels(fig)) / legend.ncols)
        assert fig.height >= FIGURE_PX and (rows > 1) == (fig.height > FIGURE_PX)  # the plot keeps its height


def test_legends_list_only_series_with_data_and_fit_under_their_plot() -> None:
    """The throughput legend stays within the figure on both sides and lists no greyed "tokens/s (total)"
    for a model that reports no tokens; once tokens are reported, their series joins the legend."""
    stream = MetricsStream(NODE_OF_RANK, capacity_bps=CAPACITY)
    stream.push(batch(1.0))
    stream.push(batch(1.5))
    plots = stream.plots
    fig = plots.throughput.figure
    assert stream.plots.throughput.sources["throughput"].data["total"][-1] > 0
    series = ["raw", "total (smoothed)", "average since training began"]
    ranks = [f"rank {r}" for r in sorted(NODE_OF_RANK)]
    assert legend_labels(fig) == [*series, *ranks]
    tokens_item = next(i for i in fig.legend[0].items if i.label.value == "tokens/s (total)")
    assert not tokens_item.visible and not tokens_item.renderers[0].visible
    assert legend_labels(plots.compression.figure) == ["ratio", "bytes saved"]
    assert legend_labels(plots.step_time.figure) == ["compute", "communication (overlapped)",
                                                     "waiting for communication"]  # fmt: skip
    _assert_legends_fit_below(plots)

    with_tokens = batch(2.0)
    for snap in with_tokens:
        snap["tokens"] = 2000
        snap["series"]["records"] = [[*r[:4], 1000 * r[0], *r[5:]] for r in snap["series"]["records"]]
    stream.push(with_tokens)
    assert legend_labels(fig) == [*series, "tokens/s (total)", *ranks]
    assert tokens_item.visible and tokens_item.renderers[0].visible
    _assert_legends_fit_below(plots)
    issues = check_integrity([fig])  # bokeh's own validation of the figure the page gets
    assert not issues.error and not issues.warning, issues


def test_a_step_part_that_stays_zero_is_neither_drawn_nor_listed() -> None:
    """The step-time legend lists no "communication (overlapped)" for a loop whose communication never
    overlapped compute; the part joins the legend (and its bars show) once some rank's is visible (2% of the
    tallest bar: ``stream.STEP_PART_SEEN``), and stays while the run goes on; the final picture lists the parts
    its bars show."""
    stream = MetricsStream(NODE_OF_RANK, capacity_bps=CAPACITY)

    def overlapped(elapsed: float, overlap: float) -> list[dict[str, Any]]:
        snaps = batch(elapsed)
        for snap in snaps:  # the recent steps: in collectives for the wait and, besides, `overlap` seconds
            wait = WAIT_PER_STEP[snap["rank"]]
            snap["recent_steps"] = [[0.25, wait + overlap, wait]] * len(snap["recent_steps"])
        return snaps

    stream.push(overlapped(1.0, 0.0))
    stream.push(overlapped(1.5, 0.0))
    fig = stream.plots.step_time.figure
    comm_bars = next(r for r in fig.renderers if r.name == "step_comm")
    assert fig.visible and max(stream.plots.step_time.sources["step_time"].data["wait"]) > 0
    assert legend_labels(fig) == ["compute", "waiting for communication"] and not comm_bars.visible
    _assert_legends_fit_below(stream.plots)

    stream.push(overlapped(2.0, 5e-6))  # overlapped, but a sliver no one sees next to a 0.25 s step
    assert 0 < max(stream.plots.step_time.sources["step_time"].data["comm"]) < 1e-4
    assert legend_labels(fig) == ["compute", "waiting for communication"] and not comm_bars.visible

    stream.push(overlapped(2.5, 0.025))
    every = ["compute", "communication (overlapped)", "waiting for communication"]
    assert legend_labels(fig) == every and comm_bars.visible
    stream.push(overlapped(3.0, 0.0))  # no overlap in the recent steps: the part is zero again, its entry stays
    assert max(stream.plots.step_time.sources["step_time"].data["comm"]) == 0
    assert legend_labels(fig) == every and comm_bars.visible
    _assert_legends_fit_below(stream.plots)
    stream.finish()  # the final picture lists what its bars show
    assert legend_labels(fig) == ["compute", "waiting for communication"] and not comm_bars.visible


def test_a_legend_of_many_ranks_names_a_band_wraps_into_rows_and_the_figure_grows_by_them() -> None:
    """16 ranks: a band (median, min to max) and its two edges in the legend, not 16 lines of repeating colours."""
    plots = build_plots({rank: rank // 8 for rank in range(16)})
    assert legend_labels(plots.throughput.figure) == ["raw", "total (smoothed)", "average since training began",
                                                      "16 ranks: median, min-max", "lowest rank",
                                                      "highest rank"]  # fmt: skip
    _assert_legends_fit_below(plots)
    assert plots.throughput.figure.height > FIGURE_PX


# ---------------------------------------------------------------- the dashboard (real ipywidgets and jupyter_bokeh)

def payloads(elapsed: float, n: int, total: int | None = 60) -> dict[int, dict[str, Any]]:
    return {r: {"metrics": snapshot(r, elapsed),
                "progress": {"n": n - (r == 3), "total": total, "desc": "train", "elapsed_seconds": elapsed}}
            for r in NODE_OF_RANK}  # fmt: skip  (rank 3 is one iteration behind)


def test_progress_of_many_ranks_is_the_slowest_one() -> None:
    view = aggregate_progress({r: p["progress"] for r, p in payloads(2.0, 30).items()})
    assert view is not None and (view.n, view.total, view.desc) == (29, 60, "train")
    assert view.text() == "train: 29/60 (48%) · 14.50 it/s · 2.0 s in the loop · ETA 2.1 s"
    unknown = aggregate_progress({0: {"n": 7, "total": None, "desc": "", "elapsed_seconds": 1.0}})
    assert unknown is not None and unknown.text() == "7 it · 7.00 it/s · 1.0 s in the loop"
    assert aggregate_progress({0: {}, 1: {}}) is None


def test_cell_progress_is_the_slowest_rank_with_the_largest_total_and_summed_samples() -> None:
    batch = payloads(2.0, 30)  # rank 3 is one iteration behind; every rank 128 samples/s
    assert cell_progress(batch) == {"step": 29, "total": 60, "samples_per_s": pytest.approx(4 * SAMPLES_PER_S)}
    assert slowest_rank(batch) == 3
    batch[1]["progress"] = {**batch[1]["progress"], "total": 80}  # a rank with a longer loop
    assert cell_progress(batch)["total"] == 80
    # no taco.progress loop anywhere: the slowest rank's optimizer steps, no total
    steps = {r: {"metrics": {**snapshot(r, 2.0), "steps": 8 - r}} for r in NODE_OF_RANK}
    assert cell_progress(steps) == {"step": 5, "total": None, "samples_per_s": pytest.approx(4 * SAMPLES_PER_S)}
    # a rank that reports nothing yet does not hold the others back; nothing at all is step 0
    assert cell_progress({0: {"progress": {"n": 4, "total": None}}, 1: {"progress": None, "metrics": None}}) == {
        "step": 4, "total": None, "samples_per_s": None}
    assert cell_progress({}) == {"step": 0, "total": None, "samples_per_s": None} and slowest_rank({}) is None


def test_dashboard_bar_and_status_use_cell_progress() -> None:
    board = Dashboard(NODE_OF_RANK)
    batch = payloads(1.5, 30)
    batch[2]["metrics"] = {**batch[2]["metrics"], "steps": 4}  # rank 2's optimizer is two steps behind
    board.update(batch, running=4, elapsed=1.5)
    assert board.progress is not None and board.progress.n == cell_progress(batch)["step"] == 29
    assert " · step 29 · " in board.status.value  # the slowest rank's loop position, as the bar and sidebar say


def test_dashboard_updates_bar_status_and_plots_then_freezes() -> None:
    from bokeh.models import ColumnDataSource
    from ipywidgets import VBox
    from jupyter_bokeh import BokehModel

    board = Dashboard(NODE_OF_RANK, title="cluster 'x'")
    view = board.widget()  # displayed before data arrives, as under a cell
    assert isinstance(view, VBox) and "taco-dashboard" in view._dom_classes
    plots = view.children[-1]
    assert isinstance(plots, BokehModel)
    sent: list[Any] = []
    plots.send = lambda content, buffers=None: sent.append(content)  # what would go to the browser

    board.update(payloads(1.0, 20), running=4, elapsed=1.0)
    board.update(payloads(1.5, 30), running=4, elapsed=1.5)
    assert (board.bar.value, board.bar.max) == (29, 60)
    assert board.bar_text.value.startswith("train: 29/60 (48%)")
    assert "running · 4/4 ranks running on 2 nodes · step 29 · 1.5 s since the cell started" in board.status.value
    throughput = board.layout.select_one({"type": ColumnDataSource, "name": "taco-throughput"})
    assert len(throughput.data["time"]) == 30 and throughput.data["time"][-1] == pytest.approx(1.5)
    assert sent and all(c["msg"] == "patch" for c in sent)  # the live view received the change

    board.update(payloads(2.0, 60), running=0, elapsed=2.0)
    board.finish("finished", elapsed=2.1)
    assert board.bar.bar_style == "success" and board.bar.value == 59
    assert "finished · 4 ranks on 2 nodes" in board.status.value
    again = board.widget()  # taco.dashboard(): a new view that starts from the current picture
    assert "taco-throughput" in str(again.children[-1].render_bundle["docs_json"])


def test_dashboard_summary_is_the_text_fallback() -> None:
    board = Dashboard(NODE_OF_RANK)
    board.update(payloads(1.0, 10), running=4, elapsed=1.0)
    board.update(payloads(1.5, 15), running=4, elapsed=1.5)
    board.finish("failed: rank 2 raised", elapsed=1.6)
    text = board.summary()
    assert text.splitlines()[0] == ("taco dashboard: failed: rank 2 raised · 4 ranks on 2 nodes · step 14 · "
                                 "1.6 s since the cell started")
    assert "progress: train: 14/60 (23%)" in text and "throughput:" in text and "compression: 4.00x" in text
    assert board.bar.bar_style == "danger"


def test_cell_dashboard_waits_for_training_and_rejects_unknown_modes() -> None:
    cell = CellDashboard(NODE_OF_RANK, "text")
    cell.update({r: {"metrics": {**snapshot(r, 0.1), "steps": 0}, "progress": None} for r in NODE_OF_RANK}, [0])
    assert cell.dashboard is None  # nothing trained yet: nothing to show
    cell.update(payloads(1.0, 5), [0, 1, 2, 3])
    assert cell.dashboard is not None and last_dashboard() is cell.dashboard
    with pytest.raises(ValueError, match="mode must be 'widget' or 'text'"):
        CellDashboard(NODE_OF_RANK, "html")
    with pytest.raises(ValueError, match="TACO_DASHBOARD must be one of auto, widget, text, off"):
        dashboard_mode("fancy")
    assert dashboard_mode() == "text"  # no kernel, no widget frontend here


def test_the_compression_line_starts_at_the_first_bytes_and_has_no_gap() -> None:
    stream = MetricsStream({0: 0})
    # 1 s of setup without communication, then 4:1 compression, with a 1.5 s pause in communication at 2-3.5 s
    records = []
    raw = 0.0
    for k in range(81):
        t = k * 0.05
        if 1.0 < t <= 2.0 or t > 3.5:
            raw += 4e5
        records.append([t, k, 0, 0, 0, raw, raw / 4])
    stream.push([{**snapshot(0, 4.0), "series": {"fields": SERIES_FIELDS, "first": 0, "records": records}}])
    data = stream.plots.compression.sources["compression"].data
    assert data["time"][0] == pytest.approx(1.05)  # nothing was compressed before
    assert data["ratio"] == pytest.approx([4.0] * len(data["time"]))  # the pause reads the ratio since the start
    assert data["time"] == pytest.approx([0.05 * k for k in range(21, 81)])


def test_the_plots_begin_where_the_ranks_began_to_work() -> None:
    """Seconds of model building before the first step are left out of the lines and of the average."""
    stream = MetricsStream({0: 0})
    records = [[0.0, 0, 0, 0, 0, 0, 0], [2.0, 0, 0, 0, 0, 0, 0]]  # taco.progress marked its start at 2.0 s
    records += [[2.0 + k * 0.05, k, k, 10 * k, 0, 0, 0] for k in range(1, 21)]
    stream.push([{**snapshot(0, 3.0), "series": {"fields": SERIES_FIELDS, "first": 0, "records": records}}])
    data = stream.plots.throughput.sources["throughput"].data
    assert data["time"][0] == pytest.approx(2.0) and data["time"][-1] == pytest.approx(3.0)
    assert data["total"][-1] == pytest.approx(200) and data["average"][-1] == pytest.approx(200)
