"""Pure bokeh builders for the live training dashboard: data in, bokeh objects out.

Each builder returns a :class:`Plot`: the figure and the ``ColumnDataSource`` objects that ``stream.py`` updates.
Column names are stable (``time``, ``total``, ``rank_3``, ``src``/``dst``/``bps``/``label``, ...), so whoever feeds
a source needs no knowledge of the figure. The link heatmaps are :mod:`.heatmaps`', the per-rank series
:mod:`.ranks`'. Nothing here does I/O, keeps global state or names a CDN: the dashboard loads BokehJS from
``bokeh.resources.INLINE`` so it works on clusters without internet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bokeh.models import ColumnDataSource, DataRange1d, HoverTool, LinearAxis, NumeralTickFormatter
from bokeh.plotting import figure

from .figures import (
    Plot,
    add_note,
    bytes_formatter,
    format_bytes,
    format_rate,
    new_figure,
    plural,
    rank_axis,
    rank_range,
)
from .heatmaps import HeatmapPlot, node_heatmap, rank_heatmap, rank_heatmap_across
from .legend import FIGURE_PX, legend_below
from .ranks import draw_ranks, rank_column, rank_series_columns

__all__ = [
    "Plot",
    "DashboardPlots",
    "build_plots",
    "throughput_plot",
    "node_heatmap",
    "rank_heatmap",
    "rank_heatmap_across",
    "compression_plot",
    "step_time_plot",
    "gpu_plot",
    "rank_column",
    "format_bytes",
    "format_rate",
    "bytes_formatter",
    "plural",
    "STEP_PARTS",
    "FIGURE_PX",
]

STEP_COLUMNS = ("rank", "x", "compute", "comm", "wait", "total", "note", "outline")
STEP_PARTS = ("compute", "comm", "wait")  # a step's stacked parts, bottom up; each bar's renderer is step_<part>
GPU_COLUMNS = ("rank", "x", "memory", "peak", "label")
STRAGGLER_OUTLINE = "black"  # the straggler's bar; the others get no outline
MAX_BAR_LABELS = 8  # ranks: above this the GPU label is on hover only (a label per bar would overprint)


@dataclass(frozen=True)
class DashboardPlots:
    """Every plot of the dashboard for one cluster layout."""

    throughput: Plot
    node_links: HeatmapPlot  # between nodes
    rank_links: HeatmapPlot  # between ranks of the same node
    rank_links_across: HeatmapPlot  # between ranks of different nodes
    compression: Plot
    step_time: Plot
    gpu: Plot

    def all(self) -> tuple[Plot, ...]:
        """The plots in display order."""
        return (
            self.throughput,
            self.compression,
            self.node_links,
            self.rank_links_across,
            self.rank_links,
            self.step_time,
            self.gpu,
        )


def throughput_plot(ranks: Sequence[int], *, title: str = "Throughput (samples/s)") -> Plot:
    """Samples/s over elapsed time (see :mod:`.series`): a thick ``total`` line (the rate over the smoothing window)
    over the ``raw`` rate of each grid step (faint), the ``average`` since training began (dashed, what the
    summary says), and the ranks' own rates under them (:mod:`.ranks`: a line each, or a band for many; click
    the legend to hide). A note in the frame says when there are too few steps for a rate.

    One source ``"throughput"`` with columns ``time``, ``total``, ``raw``, ``average``, ``tokens`` (tokens/s of all
    ranks; its line and axis stay hidden until tokens are reported) and :func:`.ranks.rank_series_columns`.
    """
    columns = ("time", "total", "raw", "average", "tokens", *rank_series_columns(ranks))
    source = ColumnDataSource(data={name: [] for name in columns}, name="taco-throughput")
    fig = new_figure(title, x_axis_label="elapsed (s)", y_axis_label="samples/s")
    raw = fig.line("time", "raw", source=source, line_width=1, color="black", alpha=0.18, legend_label="raw",
                   name="raw")  # fmt: skip
    total = fig.line("time", "total", source=source, line_width=2, color="black", legend_label="total (smoothed)",
                     name="total")  # fmt: skip
    average = fig.line("time", "average", source=source, line_width=2, color="#7f7f7f", line_dash="dashed",
                       legend_label="average since training began", name="average")  # fmt: skip
    fig.y_range = DataRange1d(renderers=[total, average, raw], start=0)
    fig.yaxis[0].formatter = NumeralTickFormatter(format="0,0.[0]")  # 12,500 rather than 1.250e+4
    # tokens/s has another scale; hidden (with its axis) until a rank reports tokens
    token_range = DataRange1d(start=0)
    fig.extra_y_ranges = {"tokens": token_range}
    tokens = fig.line("time", "tokens", source=source, y_range_name="tokens", color="#9467bd", line_dash="dotted",
                      line_width=2, legend_label="tokens/s (total)", name="tokens", visible=False)  # fmt: skip
    token_range.renderers = [tokens]
    token_axis = LinearAxis(y_range_name="tokens", axis_label="tokens/s", name="tokens_axis", visible=False)
    token_axis.formatter = NumeralTickFormatter(format="0,0.[0]")  # type: ignore[assignment]  # stub too narrow
    fig.add_layout(token_axis, "right")
    per_rank = draw_ranks(fig, source, ranks)
    fig.renderers = [raw, *per_rank, total, average, tokens]  # the ranks under the total: it is their sum or min
    fig.add_tools(HoverTool(renderers=[total], mode="vline", tooltips=[
        ("elapsed", "@time{0.0} s"), ("smoothed", "@total{0,0.0}"), ("raw", "@raw{0,0.0}"),
        ("average", "@average{0,0.0}")]))  # fmt: skip
    fig.legend.click_policy = "hide"
    legend_below(fig)
    add_note(fig)
    return Plot(fig, {"throughput": source})


def compression_plot(*, title: str = "Compression (raw / wire bytes)") -> Plot:
    """The compression ratio over the smoothing window (left axis) and the bytes saved since the cell started
    (right axis) over elapsed time; hidden until something was compressed.

    One source ``"compression"``: ``time``, ``ratio`` (NaN for a window without communication), ``saved_bytes``.
    """
    source = ColumnDataSource(data={"time": [], "ratio": [], "saved_bytes": []}, name="taco-compression")
    fig = new_figure(title, x_axis_label="elapsed (s)", y_axis_label="compression ratio", visible=False,
                  name="compression")  # fmt: skip
    ratio = fig.line("time", "ratio", source=source, line_width=2, color="#1f77b4", legend_label="ratio", name="ratio")
    saved = fig.line("time", "saved_bytes", source=source, y_range_name="saved", color="#ff7f0e", line_dash="dashed",
                     legend_label="bytes saved", name="saved_bytes")  # fmt: skip
    fig.y_range = DataRange1d(renderers=[ratio], start=0)
    fig.extra_y_ranges = {"saved": DataRange1d(renderers=[saved], start=0)}
    fig.yaxis[0].formatter = NumeralTickFormatter(format="0.[0]")
    saved_axis = LinearAxis(y_range_name="saved", axis_label="bytes saved", name="saved_axis")
    saved_axis.formatter = bytes_formatter()  # type: ignore[assignment]  # any TickFormatter works at runtime
    fig.add_layout(saved_axis, "right")
    legend_below(fig)
    return Plot(fig, {"compression": source})


def _rank_bars_figure(title: str, names: Sequence[str], y_label: str, padding: float, name: str) -> figure:
    """A figure of one bar per rank at positions 0 .. n-1, its axis naming the ranks (every few, for many)."""
    fig = new_figure(title, x_range=rank_range(len(names)), y_range=DataRange1d(start=0, range_padding=padding),
                     x_axis_label="rank", y_axis_label=y_label, visible=False, name=name)  # fmt: skip
    rank_axis(fig.xaxis[0], names)
    fig.xgrid.grid_line_color = None
    return fig


def step_time_plot(ranks: Sequence[int], *, title: str = "Step time per rank (s)") -> Plot:
    """Per-rank stacked bars of a typical recent step (the median, :mod:`.steps`): compute, communication hidden
    behind it, and waiting; the straggler's bar is outlined and labelled.

    One source ``"step_time"`` with columns ``rank`` (str), ``x`` (its bar's position), ``compute`` (compute alone),
    ``comm`` (communication that overlapped compute), ``wait`` (the loop blocked on communication), ``total``,
    ``note`` (``"slowest"`` on the straggler, else empty) and ``outline`` (its bar's outline colour). Each part's
    bars (renderer ``step_<part>``) and legend entry show once some rank's part is seen (``stream.py``): no
    "communication (overlapped)" in the legend of a loop whose communication never overlaps. The straggler is
    the tallest bar (``steps.straggler``); synchronous training evens the heights out, and then it is the one
    with the most compute, which its peers wait for. Hidden until a rank communicated (a loop that sends
    nothing has nothing to split); a note says so while no rank has a timed step.
    """
    names = [str(r) for r in ranks]
    n = len(names)
    source = ColumnDataSource(data={"rank": names, "x": list(range(n)), "compute": [0.0] * n, "comm": [0.0] * n,
                                    "wait": [0.0] * n, "total": [0.0] * n, "note": [""] * n, "outline": [None] * n},
                              name="taco-step-time")  # fmt: skip
    fig = _rank_bars_figure(title, names, "seconds per step", 0.15, "step_time")
    fig.yaxis[0].formatter = NumeralTickFormatter(format="0.[000]")
    parts = fig.vbar_stack(list(STEP_PARTS), x="x", width=0.8, source=source,
                   color=["#2ca02c", "#98df8a", "#d62728"], line_color="outline", line_width=2,
                   legend_label=["compute", "communication (overlapped)", "waiting for communication"],
                   name=[f"step_{part}" for part in STEP_PARTS], visible=False)  # fmt: skip
    fig.text("x", "total", text="note", source=source, text_align="center", text_baseline="bottom",
             text_font_size="9pt", name="note")  # fmt: skip
    fig.add_tools(HoverTool(renderers=[parts[0]], tooltips=[
        ("rank", "@rank"), ("step", "@total{0.000} s"), ("compute", "@compute{0.000} s"),
        ("overlapped communication", "@comm{0.000} s"), ("wait", "@wait{0.000} s")]))  # fmt: skip
    legend_below(fig)
    add_note(fig)
    return Plot(fig, {"step_time": source})


def gpu_plot(ranks: Sequence[int], *, title: str = "GPU memory per rank") -> Plot:
    """Per-rank GPU memory in use (bars) and its peak (a tick above), with the GPU's name and utilization as
    a label (on hover only beyond :data:`MAX_BAR_LABELS` ranks); hidden until a rank reports a GPU.

    One source ``"gpu"`` with columns ``rank`` (str), ``x`` (its bar's position), ``memory`` and ``peak`` (bytes;
    NaN for a rank without a GPU) and ``label`` (``"H100 · 87% busy"``).
    """
    names = [str(r) for r in ranks]
    n = len(names)
    nan = float("nan")
    source = ColumnDataSource(data={"rank": names, "x": list(range(n)), "memory": [nan] * n, "peak": [nan] * n,
                                    "label": [""] * n}, name="taco-gpu")  # fmt: skip
    fig = _rank_bars_figure(title, names, "GPU memory", 0.2, "gpu")
    fig.yaxis[0].formatter = bytes_formatter()
    bars = fig.vbar(x="x", top="memory", width=0.6, source=source, color="#1f77b4", legend_label="in use",
                    name="gpu_memory")  # fmt: skip
    fig.scatter(x="x", y="peak", source=source, marker="dash", size=min(30, max(6, 600 // max(n, 1))),
                line_width=3, color="#d62728", legend_label="peak", name="gpu_peak")  # fmt: skip
    if n <= MAX_BAR_LABELS:
        fig.text("x", "peak", text="label", source=source, text_align="center", text_baseline="bottom",
                 text_font_size="9pt", y_offset=-4, name="gpu_label")  # fmt: skip
    fig.add_tools(HoverTool(renderers=[bars], tooltips=[("rank", "@rank"), ("GPU", "@label"),
                                                        ("in use", "@memory{0,0} B"), ("peak", "@peak{0,0} B")]))
    legend_below(fig)
    return Plot(fig, {"gpu": source})


def build_plots(node_of_rank: Mapping[int, int], *, capacity_bps: float | None = None) -> DashboardPlots:
    """Every dashboard plot for ranks placed on nodes as ``node_of_rank`` says (``{rank: node}``)."""
    ranks = sorted(node_of_rank)
    return DashboardPlots(
        throughput=throughput_plot(ranks),
        node_links=node_heatmap(sorted(set(node_of_rank.values())), capacity_bps=capacity_bps),
        rank_links=rank_heatmap(node_of_rank),
        rank_links_across=rank_heatmap_across(node_of_rank, capacity_bps=capacity_bps),
        compression=compression_plot(),
        step_time=step_time_plot(ranks),
        gpu=gpu_plot(ranks),
    )
