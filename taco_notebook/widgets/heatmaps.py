"""The link heatmaps: src×dst grids of bytes/s, built for a cluster layout and filled from :mod:`.links`' rates.

A cell carries its value in colour (0 B/s in the palette's lightest colour), its exact rates on hover, and a text
label only where one fits: BokehJS measures the labels against the cells as drawn (:data:`FIT_LABELS_JS`, on
every resize and data change) and shows them only if the widest fits; a silent link has no label. Beyond
:data:`MAX_LABELLED` rows no label could fit on any page, so there is no label glyph at all; beyond
:data:`MAX_DENSE_CELLS` possible cells the source holds only the links that carried bytes (256 ranks make 65,536
cells, mostly silent, every poll).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from bokeh.models import ColumnDataSource, CustomJS, HoverTool, LinearColorMapper
from bokeh.models.annotations import ColorBar
from bokeh.palettes import Blues256, Greens256

from .figures import Plot, bytes_formatter, format_rate, new_figure, rank_axis, rank_range

__all__ = ["HeatmapPlot", "node_heatmap", "rank_heatmap", "rank_heatmap_across", "fill_heatmap", "MAX_LABELLED",
           "MAX_DENSE_CELLS", "LABEL_FONT", "INTER_PALETTE", "INTRA_PALETTE"]  # fmt: skip

MAX_LABELLED = 16  # rows: above this a heatmap shows colours only (a 1000 px page gives a cell < 20 px)
MAX_NAMED_CELLS = 8  # rows named on the axes (every 2nd of 16): a third of the page fits 8 two-digit names
MAX_DENSE_CELLS = 4096  # a source with more possible cells holds only those that carried bytes
LABEL_FONT = "9pt"
CELL_COLUMNS = ("src", "dst", "x", "y", "bps", "label", "text", "last", "last_label")
# light to dark: 0 B/s is the page's own near-white, the busiest link the darkest cell
INTER_PALETTE = Blues256[::-1]
INTRA_PALETTE = Greens256[::-1]

# Show the labels only when the widest one (measured in the glyph's font) fits a cell as drawn, with a margin.
FIT_LABELS_JS = """
const cell_w = fig.inner_width / count, cell_h = fig.inner_height / count;
const texts = source.data.text || [];
const ctx = document.createElement('canvas').getContext('2d');
ctx.font = font + ' helvetica, arial, sans-serif';
let widest = 0;
for (const text of texts) if (text) widest = Math.max(widest, ctx.measureText(text).width);
const fits = widest > 0 && widest + 6 <= cell_w && 16 <= cell_h;
if (labels.visible !== fits) labels.visible = fits;
"""


@dataclass(frozen=True)
class HeatmapPlot(Plot):
    """A link heatmap: its axis ``names`` (rank or node numbers, top down and left to right), which ``(src, dst)``
    pairs it shows (``shows``), and whether its source holds only the links that carried bytes (``sparse``)."""

    names: tuple[str, ...] = ()
    shows: Callable[[int, int], bool] = lambda src, dst: True
    sparse: bool = False


def _columns(plot: HeatmapPlot, cells: Sequence[tuple[int, int]]) -> dict[str, list[object]]:
    position = {int(name): i for i, name in enumerate(plot.names)}
    return {"src": [str(s) for s, _ in cells], "dst": [str(d) for _, d in cells],
            "x": [position[d] for _, d in cells], "y": [position[s] for s, _ in cells],
            **{name: [0.0] * len(cells) if name in ("bps", "last") else [""] * len(cells)
               for name in ("bps", "label", "text", "last", "last_label")}}  # fmt: skip


def _link_heatmap(names: Sequence[str], shows: Callable[[int, int], bool], title: str, unit: str, *,
                  palette: Sequence[str], scale: str, high: float | None = None, name: str) -> HeatmapPlot:  # fmt: skip
    """A src×dst grid of bytes/s since the cell started (the title's "since start", short enough for a third of
    the page; the last interval's rate on hover) over the pairs ``shows`` admits, one colour scale (0 in its
    lightest colour, ``high`` pinning its top, else the busiest link) and one colour bar.

    The figure stays hidden until a link of it carried bytes (``stream.py``): no panel of zeros. One source
    ``"links"``: ``src``, ``dst`` (names), ``x``, ``y`` (their positions), ``bps``, ``label`` (its rate),
    ``text`` (the label drawn in the cell: empty on a silent link), ``last``, ``last_label`` (the last interval).
    """
    count = len(names)
    ids = [int(n) for n in names]
    pairs = [(s, d) for s in ids for d in ids if shows(s, d)]
    sparse = len(pairs) > MAX_DENSE_CELLS
    fig = new_figure(title, x_range=rank_range(count), y_range=rank_range(count, reversed_=True), visible=False,
                     name=name)  # fmt: skip
    plot = HeatmapPlot(fig, {}, tuple(names), shows, sparse)
    source = ColumnDataSource(data=_columns(plot, [] if sparse else pairs), name=f"taco-{name}")
    plot.sources["links"] = source
    fig.xaxis.axis_label, fig.yaxis.axis_label = f"to {unit}", f"from {unit}"
    rank_axis([*fig.xaxis, *fig.yaxis], names, most=MAX_NAMED_CELLS)
    fig.grid.grid_line_color = None
    mapper = LinearColorMapper(palette=list(palette), low=0, high=high, name=f"{name}_mapper")
    cells = fig.rect("x", "y", width=1, height=1, source=source, line_color="white" if count <= 32 else None,
                     name="cells", fill_color={"field": "bps", "transform": mapper})  # fmt: skip
    if count <= MAX_LABELLED:
        labels = fig.text("x", "y", text="text", source=source, text_align="center", text_baseline="middle",
                          text_font_size=LABEL_FONT, color="black", background_fill_color="white",
                          background_fill_alpha=0.7,  # type: ignore[call-arg]  # readable on any cell colour
                          name="labels")  # fmt: skip
        fit = CustomJS(args={"fig": fig, "source": source, "labels": labels, "count": count, "font": LABEL_FONT},
                       code=FIT_LABELS_JS)  # fmt: skip
        fig.js_on_change("inner_width", fit)
        fig.js_on_change("inner_height", fit)
        source.js_on_change("data", fit)
    fig.add_tools(HoverTool(renderers=[cells], tooltips=[
        (unit, "@src → @dst"), ("since the cell started", "@label"), ("last interval", "@last_label")]))  # fmt: skip
    fig.add_layout(ColorBar(color_mapper=mapper, title=scale, width=8, formatter=bytes_formatter("/s"),
                            name="scale"), "right")  # fmt: skip
    return plot


def node_heatmap(nodes: Sequence[int], *, capacity_bps: float | None = None) -> HeatmapPlot:
    """Node→node bytes/s between nodes since the cell started (traffic within a node is :func:`rank_heatmap`'s,
    on its own scale: shared memory is far faster than the network); ``capacity_bps`` (the NIC's bytes/s) pins
    the scale's top so a saturated link reads as saturated rather than as "the brightest cell"."""
    scale = "bytes/s" if capacity_bps is None else f"bytes/s (max = capacity {format_rate(capacity_bps)})"
    return _link_heatmap([str(n) for n in nodes], lambda s, d: s != d, "Node links (since start)",
                         "node", palette=INTER_PALETTE, scale=scale, high=capacity_bps, name="node-links")  # fmt: skip


def rank_heatmap(node_of_rank: Mapping[int, int]) -> HeatmapPlot:
    """Rank→rank bytes/s since the cell started between ranks of the same node (shared memory, NVLink)."""
    names = [str(r) for r in sorted(node_of_rank)]
    return _link_heatmap(names, lambda s, d: s != d and node_of_rank[s] == node_of_rank[d],
                         "Rank links within nodes (since start)", "rank", palette=INTRA_PALETTE,
                         scale="bytes/s", name="rank-links")  # fmt: skip


def rank_heatmap_across(node_of_rank: Mapping[int, int], *, capacity_bps: float | None = None) -> HeatmapPlot:
    """Rank→rank bytes/s since the cell started between ranks of different nodes (the network)."""
    names = [str(r) for r in sorted(node_of_rank)]
    scale = "bytes/s" if capacity_bps is None else f"bytes/s (max = capacity {format_rate(capacity_bps)})"
    return _link_heatmap(names, lambda s, d: node_of_rank[s] != node_of_rank[d],
                         "Rank links across nodes (since start)", "rank", palette=INTER_PALETTE,
                         scale=scale, high=capacity_bps, name="rank-links-across")  # fmt: skip


def fill_heatmap(plot: Plot, bps: Mapping[tuple[int, int], float], last: Mapping[tuple[int, int], float]) -> None:
    """Set every cell of a link heatmap (rate since the start, the last interval's on hover; a label only on a
    link that carried bytes); show the figure once one of its links did."""
    source = plot.sources["links"]
    if isinstance(plot, HeatmapPlot) and plot.sparse:
        cells = sorted(key for key, value in bps.items() if value > 0 and plot.shows(*key))
        if [(int(s), int(d)) for s, d in zip(source.data["src"], source.data["dst"], strict=True)] != cells:
            source.data = _columns(plot, cells)
    keys = [(int(src), int(dst)) for src, dst in zip(source.data["src"], source.data["dst"], strict=True)]
    values = [bps.get(key, 0.0) for key in keys]
    recent = [last.get(key, 0.0) for key in keys]
    labels = [format_rate(v) for v in values]
    texts = [text if v > 0 else "" for v, text in zip(values, labels, strict=True)]
    source.data.update(bps=values, label=labels, text=texts, last=recent,
                       last_label=[format_rate(v) for v in recent])  # fmt: skip
    if any(v > 0 for v in values):
        plot.figure.visible = True
