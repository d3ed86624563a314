"""Pure bokeh builders for the live training dashboard: data in, bokeh objects out.

Each builder returns a :class:`Plot`: the figure and the ``ColumnDataSource`` objects that ``stream.py`` updates.
Column names are stable (``time``, ``total``, ``rank_3``, ``src``/``dst``/``bps``/``label``, ...), so whoever feeds
a source needs no knowledge of the figure. Nothing here does I/O, keeps global state or names a CDN: the dashboard
loads BokehJS from ``bokeh.resources.INLINE`` so it works on clusters without internet.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bokeh.models import (
    ColumnDataSource,
    CustomJSTickFormatter,
    DataRange1d,
    HoverTool,
    LinearAxis,
    LinearColorMapper,
    NumeralTickFormatter,
)
from bokeh.models.annotations import ColorBar
from bokeh.palettes import Blues256, Category10_10, Greens256
from bokeh.plotting import figure

from .legend import FIGURE_PX, legend_below

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
]

TOOLS = "pan,wheel_zoom,box_zoom,reset,save"
MAX_LABELLED_CELLS = 16  # above this many rows a heatmap shows colours only: numbers would overlap
CELL_COLUMNS = ("src", "dst", "bps", "label", "last", "last_label")
STEP_COLUMNS = ("rank", "compute", "comm", "wait", "total", "note", "outline")
STEP_PARTS = ("compute", "comm", "wait")  # a step's stacked parts, bottom up; each bar's renderer is step_<part>
GPU_COLUMNS = ("rank", "memory", "peak", "label")
STRAGGLER_OUTLINE = "black"  # the straggler's bar; the others get no outline
# light to dark: 0 B/s is the page's own near-white, the busiest link the darkest cell
INTER_PALETTE = Blues256[::-1]
INTRA_PALETTE = Greens256[::-1]

# Decimal bytes as format_bytes writes them ("1.5 MB"), for axis ticks and colour bars: no "1.500e+8".
_BYTES_JS = """
const units = ["B", "kB", "MB", "GB", "TB"];
let scaled = tick, i = 0;
while (Math.abs(scaled) >= 1000 && i < units.length - 1) { scaled /= 1000; i += 1; }
const text = String(Number(scaled.toFixed(2)));  // 1.5 MB, 512 B; 0.2 B only on an axis of nothing
return text + " " + units[i] + suffix;
"""


@dataclass(frozen=True)
class Plot:
    """A figure and the sources that feed it, keyed by role (``"throughput"``, ``"inter"``, ``"intra"``, ...)."""

    figure: figure
    sources: dict[str, ColumnDataSource]


@dataclass(frozen=True)
class DashboardPlots:
    """Every plot of the dashboard for one cluster layout."""

    throughput: Plot
    node_links: Plot  # between nodes
    rank_links: Plot  # between ranks of the same node
    rank_links_across: Plot  # between ranks of different nodes
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


def rank_column(rank: int) -> str:
    """The throughput source's column for one rank: ``rank_column(3) == "rank_3"``."""
    return f"rank_{rank}"


def format_bytes(nbytes: float) -> str:
    """Human-readable decimal bytes: ``format_bytes(2e6) == "2.0 MB"``; NaN (no data) reads ``"-"``."""
    if math.isnan(nbytes):
        return "-"
    value = float(nbytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def format_rate(bytes_per_s: float) -> str:
    """A bandwidth for labels: ``format_rate(2e6) == "2.0 MB/s"``."""
    return "-" if math.isnan(bytes_per_s) else f"{format_bytes(bytes_per_s)}/s"


def plural(count: int, noun: str) -> str:
    """``plural(1, "rank") == "1 rank"``, ``plural(4, "rank") == "4 ranks"``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def bytes_formatter(suffix: str = "") -> CustomJSTickFormatter:
    """Ticks in decimal bytes with a unit (``1.5 MB``, ``20 MB/s`` with ``suffix="/s"``), drawn by BokehJS."""
    return CustomJSTickFormatter(code=_BYTES_JS, args={"suffix": suffix})


def _figure(title: str, **kwargs: Any) -> figure:
    kwargs.setdefault("height", FIGURE_PX)
    return figure(title=title, sizing_mode="stretch_width", tools=TOOLS, toolbar_location="right", **kwargs)


def throughput_plot(ranks: Sequence[int], *, title: str = "Throughput (samples/s)") -> Plot:
    """Samples/s over elapsed time (see :mod:`.series`): a thick ``total`` line (the rate over the smoothing window)
    over the ``raw`` rate of each grid step (faint), the ``average`` since training began (dashed, what the
    summary says), and one line per rank (click the legend to hide).

    One source ``"throughput"`` with columns ``time``, ``total``, ``raw``, ``average``, ``tokens`` (tokens/s of all
    ranks; its line and axis stay hidden until tokens are reported) and ``rank_column(r)`` for each rank.
    """
    columns = ("time", "total", "raw", "average", "tokens", *(rank_column(r) for r in ranks))
    source = ColumnDataSource(data={name: [] for name in columns}, name="taco-throughput")
    fig = _figure(title, x_axis_label="elapsed (s)", y_axis_label="samples/s")
    raw = fig.line("time", "raw", source=source, line_width=1, color="black", alpha=0.18, legend_label="raw",
                   name="raw")  # fmt: skip
    total = fig.line("time", "total", source=source, line_width=3, color="black", legend_label="total (smoothed)",
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
    for i, rank in enumerate(ranks):
        column = rank_column(rank)
        color = Category10_10[i % len(Category10_10)]
        fig.line("time", column, source=source, color=color, legend_label=f"rank {rank}", name=column)
    fig.add_tools(HoverTool(renderers=[total], mode="vline", tooltips=[
        ("elapsed", "@time{0.0} s"), ("smoothed", "@total{0,0.0}"), ("raw", "@raw{0,0.0}"),
        ("average", "@average{0,0.0}")]))  # fmt: skip
    fig.legend.click_policy = "hide"
    legend_below(fig)
    return Plot(fig, {"throughput": source})


def _cell_source(cells: Sequence[tuple[str, str]], name: str) -> ColumnDataSource:
    n = len(cells)
    return ColumnDataSource(data={"src": [s for s, _ in cells], "dst": [d for _, d in cells], "bps": [0.0] * n,
                                  "label": [""] * n, "last": [0.0] * n, "last_label": [""] * n},
                            name=name)  # fmt: skip


def _link_heatmap(
    names: Sequence[str],
    cells: Sequence[tuple[str, str]],
    title: str,
    unit: str,
    *,
    palette: Sequence[str],
    scale: str,
    high: float | None = None,
    name: str,
) -> Plot:
    """A src×dst grid of bytes/s since the cell started (the last interval's on hover), ``cells`` only, one colour
    scale (0 in its lightest colour, ``high`` pinning its top, else the busiest link) and one colour bar.

    The figure stays hidden until a link of it carried bytes (``stream.py``): no panel of zeros. One source
    ``"links"`` with columns ``src``, ``dst``, ``bps``, ``label`` and ``last``, ``last_label`` (the last interval).
    """
    source = _cell_source(cells, f"taco-{name}")
    fig = _figure(title, x_range=list(names), y_range=list(reversed(names)), visible=False, name=name)
    fig.xaxis.axis_label, fig.yaxis.axis_label = f"to {unit}", f"from {unit}"
    fig.grid.grid_line_color = None
    mapper = LinearColorMapper(palette=list(palette), low=0, high=high, name=f"{name}_mapper")
    cells_renderer = fig.rect("dst", "src", width=1, height=1, source=source, line_color="white", name="cells",
                              fill_color={"field": "bps", "transform": mapper})  # fmt: skip
    if len(names) <= MAX_LABELLED_CELLS:
        fig.text("dst", "src", text="label", source=source, text_align="center", text_baseline="middle",
                 text_font_size="9pt", color="black", background_fill_color="white",
                 background_fill_alpha=0.7,  # type: ignore[call-arg]  # readable on any cell colour
                 name="labels")  # fmt: skip
    fig.add_tools(HoverTool(renderers=[cells_renderer], tooltips=[
        (unit, "@src → @dst"), ("since the cell started", "@label"), ("last interval", "@last_label")]))  # fmt: skip
    fig.add_layout(ColorBar(color_mapper=mapper, title=scale, width=8, formatter=bytes_formatter("/s"),
                            name="scale"), "right")  # fmt: skip
    return Plot(fig, {"links": source})


def node_heatmap(nodes: Sequence[int], *, capacity_bps: float | None = None) -> Plot:
    """Node→node bytes/s between nodes since the cell started (traffic within a node is :func:`rank_heatmap`'s,
    on its own scale: shared memory is far faster than the network); ``capacity_bps`` (the NIC's bytes/s) pins
    the scale's top so a saturated link reads as saturated rather than as "the brightest cell"."""
    names = [str(n) for n in nodes]
    scale = "bytes/s" if capacity_bps is None else f"bytes/s (max = capacity {format_rate(capacity_bps)})"
    return _link_heatmap(names, [(s, d) for s in names for d in names if s != d],
                         "Node links (rate since the cell started)", "node", palette=INTER_PALETTE, scale=scale,
                         high=capacity_bps, name="node-links")  # fmt: skip


def rank_heatmap(node_of_rank: Mapping[int, int]) -> Plot:
    """Rank→rank bytes/s since the cell started between ranks of the same node (shared memory, NVLink)."""
    ranks = sorted(node_of_rank)
    names = [str(r) for r in ranks]
    cells = [(str(a), str(b)) for a in ranks for b in ranks if a != b and node_of_rank[a] == node_of_rank[b]]
    return _link_heatmap(names, cells, "Rank links within nodes (rate since the cell started)", "rank",
                         palette=INTRA_PALETTE, scale="bytes/s", name="rank-links")  # fmt: skip


def rank_heatmap_across(node_of_rank: Mapping[int, int], *, capacity_bps: float | None = None) -> Plot:
    """Rank→rank bytes/s since the cell started between ranks of different nodes (the network)."""
    ranks = sorted(node_of_rank)
    names = [str(r) for r in ranks]
    cells = [(str(a), str(b)) for a in ranks for b in ranks if node_of_rank[a] != node_of_rank[b]]
    scale = "bytes/s" if capacity_bps is None else f"bytes/s (max = capacity {format_rate(capacity_bps)})"
    return _link_heatmap(
        names,
        cells,
        "Rank links across nodes (rate since the cell started)",
        "rank",
        palette=INTER_PALETTE,
        scale=scale,
        high=capacity_bps,
        name="rank-links-across",
    )


def compression_plot(*, title: str = "Compression (raw / wire bytes)") -> Plot:
    """The compression ratio over the smoothing window (left axis) and the bytes saved since the cell started
    (right axis) over elapsed time; hidden until something was compressed.

    One source ``"compression"``: ``time``, ``ratio`` (NaN for a window without communication), ``saved_bytes``.
    """
    source = ColumnDataSource(data={"time": [], "ratio": [], "saved_bytes": []}, name="taco-compression")
    fig = _figure(title, x_axis_label="elapsed (s)", y_axis_label="compression ratio", visible=False,
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


def step_time_plot(ranks: Sequence[int], *, title: str = "Step time per rank (s)") -> Plot:
    """Per-rank stacked bars of a step: compute, communication hidden behind it, and waiting; the straggler's bar
    is outlined and labelled.

    One source ``"step_time"`` with columns ``rank`` (str), ``compute`` (compute alone), ``comm``
    (communication that overlapped compute), ``wait`` (the loop blocked on communication), ``total``, ``note``
    (``"slowest"`` on the straggler, else empty) and ``outline`` (its bar's outline colour). Each part's bars
    (renderer ``step_<part>``) and legend entry show once some rank's part is seen (``stream.py``): no
    "communication (overlapped)" in the legend of a loop whose communication never overlaps. In synchronous
    training every rank's step lasts about as long, so bar heights hardly differ: the straggler is the rank with
    the tallest *compute* part (``stream.straggler``), the one its peers wait for. Hidden until a rank
    communicated (a loop that sends nothing has nothing to split).
    """
    names = [str(r) for r in ranks]
    n = len(names)
    source = ColumnDataSource(data={"rank": names, "compute": [0.0] * n, "comm": [0.0] * n, "wait": [0.0] * n,
                                    "total": [0.0] * n, "note": [""] * n, "outline": [None] * n},
                              name="taco-step-time")  # fmt: skip
    fig = _figure(title, x_range=names, y_range=DataRange1d(start=0, range_padding=0.15), x_axis_label="rank",
                  y_axis_label="seconds per step", visible=False, name="step_time")  # fmt: skip
    fig.yaxis[0].formatter = NumeralTickFormatter(format="0.[000]")
    fig.vbar_stack(list(STEP_PARTS), x="rank", width=0.8, source=source,
                   color=["#2ca02c", "#98df8a", "#d62728"], line_color="outline", line_width=2,
                   legend_label=["compute", "communication (overlapped)", "waiting for communication"],
                   name=[f"step_{part}" for part in STEP_PARTS], visible=False)  # fmt: skip
    fig.text("rank", "total", text="note", source=source, text_align="center", text_baseline="bottom",
             text_font_size="9pt", name="note")  # fmt: skip
    legend_below(fig)
    return Plot(fig, {"step_time": source})


def gpu_plot(ranks: Sequence[int], *, title: str = "GPU memory per rank") -> Plot:
    """Per-rank GPU memory in use (bars) and its peak (a tick above), with the GPU's name and utilization as
    a label; hidden until a rank reports a GPU (``figure.visible``).

    One source ``"gpu"`` with columns ``rank`` (str), ``memory`` and ``peak`` (bytes; NaN for a rank without
    a GPU) and ``label`` (``"H100 · 87% busy"``).
    """
    names = [str(r) for r in ranks]
    n = len(names)
    nan = float("nan")
    source = ColumnDataSource(data={"rank": names, "memory": [nan] * n, "peak": [nan] * n, "label": [""] * n},
                              name="taco-gpu")  # fmt: skip
    fig = _figure(title, x_range=names, y_range=DataRange1d(start=0, range_padding=0.2), x_axis_label="rank",
                  y_axis_label="GPU memory", visible=False, name="gpu")  # fmt: skip
    fig.yaxis[0].formatter = bytes_formatter()
    fig.vbar(x="rank", top="memory", width=0.6, source=source, color="#1f77b4", legend_label="in use",
             name="gpu_memory")  # fmt: skip
    fig.scatter(x="rank", y="peak", source=source, marker="dash", size=30, line_width=3, color="#d62728",
                legend_label="peak", name="gpu_peak")  # fmt: skip
    fig.text("rank", "peak", text="label", source=source, text_align="center", text_baseline="bottom",
             text_font_size="9pt", y_offset=-4, name="gpu_label")  # fmt: skip
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
