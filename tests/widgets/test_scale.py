"""The dashboard at 4, 16, 64 and 256 ranks: rank lines that coincide stay distinguishable, many ranks make a band
with its lowest and highest rank named, legends stay short, heatmap labels only on links that carried bytes,
axes that name every few ranks. Synthetic runs (``synthetic.py``); what the page draws is the browser test's."""

from __future__ import annotations

import math
import time

import pytest
from bokeh.models import FixedTicker, SingleIntervalTicker

from taco_notebook.widgets import MetricsStream, build_plots
from taco_notebook.widgets.heatmaps import FIT_LABELS_JS, HeatmapPlot
from taco_notebook.widgets.legend import FIGURE_PX, LEGEND_ROW_PX, LEGEND_WIDTH_PX, legend_labels, legend_width
from taco_notebook.widgets.ranks import BAND_COLUMNS, line_widths

from .synthetic import SyntheticRun


def replay(run: SyntheticRun) -> MetricsStream:
    stream = MetricsStream(run.node_of_rank)
    for batch in run.batches():
        stream.push(batch.values())
    stream.finish()
    return stream


def legend_rows(fig) -> int:
    return math.ceil(len(legend_labels(fig)) / fig.legend[0].ncols)


def test_rank_lines_that_coincide_nest_with_the_lowest_rank_widest_underneath() -> None:
    """Four ranks at one rate drew one line, rank 3's: now rank 0's is widest and lowest, each next one narrower
    on top, every rim at least half a pixel each side, and the total (drawn over them) narrower than the last."""
    stream = replay(SyntheticRun(ranks=4, ranks_per_node=2))
    fig = stream.plots.throughput.figure
    data = stream.plots.throughput.sources["throughput"].data
    assert data["rank_0"] == data["rank_3"]  # this run's ranks coincide
    lines = [r for r in fig.renderers if r.name.startswith("rank_")]
    assert [r.name for r in lines] == ["rank_0", "rank_1", "rank_2", "rank_3"]  # drawn bottom up
    widths = [r.glyph.line_width for r in lines]
    rims = [wide - narrow for wide, narrow in zip(widths[:-1], widths[1:], strict=True)]
    assert widths == line_widths(4) and min(rims) >= 1.0
    assert len({r.glyph.line_color for r in lines}) == 4
    total = next(r for r in fig.renderers if r.name == "total")
    assert total.glyph.line_width < widths[-1] and fig.renderers.index(total) > fig.renderers.index(lines[-1])
    assert legend_labels(fig)[3:] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert legend_width(fig) <= LEGEND_WIDTH_PX and legend_rows(fig) <= 3
    eight = line_widths(8)
    assert all(wide - narrow >= 1.0 for wide, narrow in zip(eight[:-1], eight[1:], strict=True)) and max(eight) <= 12


@pytest.mark.parametrize("ranks", [16, 64])
def test_many_ranks_make_a_band_with_the_slowest_and_fastest_rank_named(ranks: int) -> None:
    """Higher ranks get smaller batches here: the band runs from the last rank's rate to rank 0's, the median
    between, and the legend names both ends, in three rows at most (16 lines made nine and hid all but one)."""
    run = SyntheticRun(ranks=ranks, ranks_per_node=8, uneven=0.25)
    stream = replay(run)
    fig = stream.plots.throughput.figure
    data = stream.plots.throughput.sources["throughput"].data
    assert set(BAND_COLUMNS) <= set(data) and not any(name.startswith("rank_") for name in data)
    low, median, high = (data[name][-1] for name in BAND_COLUMNS)
    assert 0 < low < median < high
    assert high / low == pytest.approx(run.samples_of(0) / run.samples_of(ranks - 1), rel=1e-3)
    slowest = min(range(ranks), key=lambda r: (run.samples_of(r), r))  # the lowest of the smallest batches
    assert legend_labels(fig) == ["raw", "total (smoothed)", "average since training began",
                                  f"{ranks} ranks: median, min-max", f"lowest: rank {slowest}",
                                  "highest: rank 0"]  # fmt: skip
    assert legend_width(fig) <= LEGEND_WIDTH_PX and legend_rows(fig) <= 3
    assert legend_rows(fig) * LEGEND_ROW_PX < FIGURE_PX / 2  # never taller than the plot above it

    alike = replay(SyntheticRun(ranks=ranks, ranks_per_node=8))
    assert legend_labels(alike.plots.throughput.figure)[-2:] == ["lowest rank (all alike)", "highest rank (all alike)"]


def test_no_figure_aligns_its_frame_with_a_neighbour() -> None:
    """Bokeh aligns the frames of plots in a row: a taller legend under one squeezed the frame of the other (the
    compression plot shrank to ~20 px beside a 19-entry legend)."""
    plots = build_plots({rank: rank // 8 for rank in range(16)})
    assert all(plot.figure.frame_align is False for plot in plots.all())


def test_heatmap_labels_only_on_links_that_carried_bytes_and_only_where_they_fit() -> None:
    """16 ranks: every cell carries its rate in colour and on hover; the in-cell text is empty on a silent link,
    and BokehJS shows the texts only where the widest fits a cell as drawn (``FIT_LABELS_JS``)."""
    stream = replay(SyntheticRun(ranks=16, ranks_per_node=8))
    for plot in (stream.plots.rank_links, stream.plots.rank_links_across, stream.plots.node_links):
        data = plot.sources["links"].data
        silent = [i for i, bps in enumerate(data["bps"]) if bps == 0]
        assert silent or plot is stream.plots.node_links
        assert all(data["text"][i] == "" and data["label"][i] == "0 B/s" for i in silent)  # hover still says 0
        shown = zip(data["text"], data["label"], data["bps"], strict=True)
        assert all(text == label for text, label, bps in shown if bps > 0)
        fig = plot.figure
        labels = next(r for r in fig.renderers if r.name == "labels")
        assert labels.glyph.text == "text"
        for event in ("change:inner_width", "change:inner_height"):
            (callback,) = fig.js_property_callbacks[event]
            assert callback.code == FIT_LABELS_JS and callback.args["labels"] is labels
            assert callback.args["count"] == len(plot.names)
    assert stream.plots.rank_links.names == tuple(str(r) for r in range(16))


@pytest.mark.parametrize("ranks, named_every, labelled", [(4, 1, True), (16, 2, True), (64, 8, False)])
def test_heatmap_axes_name_every_few_ranks_and_big_ones_have_no_labels(ranks: int, named_every: int,
                                                                        labelled: bool) -> None:  # fmt: skip
    plots = build_plots({rank: rank // 8 for rank in range(ranks)})
    fig = plots.rank_links_across.figure
    ticker = fig.xaxis[0].ticker
    if named_every == 1:
        assert isinstance(ticker, FixedTicker) and list(ticker.ticks) == list(range(ranks))
    else:
        assert isinstance(ticker, SingleIntervalTicker) and ticker.interval == named_every
    assert any(r.name == "labels" for r in fig.renderers) == labelled
    bars = plots.step_time.figure.xaxis[0].ticker  # a whole row wide: up to 16 names
    assert (isinstance(bars, FixedTicker) and ranks <= 16) or (isinstance(bars, SingleIntervalTicker)
                                                               and ranks / bars.interval <= 16)  # fmt: skip


def test_256_ranks_hold_only_the_links_that_carried_bytes() -> None:
    """65,536 possible rank pairs, a few hundred used: the sources hold those, not a grid of zeros every poll."""
    run = SyntheticRun(ranks=256, ranks_per_node=8)
    started = time.perf_counter()
    stream = MetricsStream(run.node_of_rank)
    built = time.perf_counter() - started
    across = stream.plots.rank_links_across
    assert isinstance(across, HeatmapPlot) and across.sparse and len(across.sources["links"].data["bps"]) == 0
    for t in (1.0, 1.5):
        stream.push(run.batch(t).values())
    data = across.sources["links"].data
    used = {(r, peer) for r in range(256) for peer in run.peers(r) if run.node_of_rank[peer] != run.node_of_rank[r]}
    assert {(int(s), int(d)) for s, d in zip(data["src"], data["dst"], strict=True)} == used
    assert len(data["bps"]) == 256 and all(bps > 0 for bps in data["bps"])
    assert not stream.plots.rank_links.sparse  # within nodes: 32 x 56 cells, dense
    assert built < 10, f"building the plots for 256 ranks took {built:.1f} s"
