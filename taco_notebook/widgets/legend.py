"""The dashboard's legends: below their plot, wrapped into rows that fit, listing only the series that are shown.

Bokeh neither wraps nor shrinks a legend: it clips it at the figure's edges. So a legend goes under its plot in
as many columns as fit :data:`LEGEND_WIDTH_PX`, the figure growing by the rows added, and an item is listed only
while its series is shown (a hidden series has no data yet: tokens before any rank reports them; or it stayed
~zero: a step-time part no bar shows).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from bokeh.models.annotations import Legend, LegendItem
from bokeh.plotting import figure

__all__ = ["FIGURE_PX", "LEGEND_WIDTH_PX", "legend_below", "fit_legend", "legend_labels", "legend_width",
           "legend_items", "show_series"]

FIGURE_PX = 290  # a figure's height with a one-row legend; each further legend row adds LEGEND_ROW_PX
# A legend below a plot wraps into rows that fit LEGEND_WIDTH_PX: bokeh neither wraps nor shrinks a legend, it
# clips it at the figure's edges, and the page's width is unknown here. 440 px is a plot beside another in a
# ~1000 px notebook output; a wider page shows the same rows with room to spare.
LEGEND_WIDTH_PX = 440
LEGEND_ROW_PX = 22  # a 20 px glyph and the row gap
LABEL_CHAR_PX = 6.5  # 13 px sans-serif runs about 6 px a character; the estimate errs toward a row more


def _legend(fig: figure) -> Legend:
    legend = fig.select_one({"type": Legend})
    assert isinstance(legend, Legend), f"{fig.title} has no legend"
    return legend


def _items(legend: Legend) -> list[LegendItem]:
    return [item for item in legend.items if isinstance(item, LegendItem)]  # figure() makes LegendItems only


def legend_items(fig: figure) -> list[LegendItem]:
    """Every item of the legend of ``fig``, shown or not."""
    return _items(_legend(fig))


def legend_below(fig: figure) -> None:
    """Move the legend under the plot, in rows that fit :data:`LEGEND_WIDTH_PX` (inside it would cover the data it
    explains); an item lists its series only while the series is shown (a hidden one has no data yet)."""
    legend = _legend(fig)
    fig.center.remove(legend)
    legend.orientation = "horizontal"
    legend.location = "center"
    for item in _items(legend):
        item.visible = all(renderer.visible for renderer in item.renderers)
    fig.add_layout(legend, "below")
    fit_legend(fig)


def _label_text(item: LegendItem) -> str:
    label = item.label
    return str(getattr(label, "value", label) or "")  # legend_label="raw" makes Value("raw")


def _legend_px(legend: Legend, labels: Sequence[str], ncols: int) -> float:
    """The width BokehJS gives a legend of ``labels`` laid out ``ncols`` to a row: a CSS grid whose columns are
    as wide as their widest item (glyph, standoff, label), ``spacing`` apart, inside ``padding`` and a border."""
    items = [legend.glyph_width + legend.label_standoff + LABEL_CHAR_PX * len(text) for text in labels]
    columns = [max(items[c::ncols]) for c in range(min(ncols, len(items)))]
    padding = legend.padding if isinstance(legend.padding, int) else 10
    return sum(columns) + legend.spacing * (len(columns) - 1) + 2 * padding + 2


def legend_labels(fig: figure) -> list[str]:
    """The labels the legend of ``fig`` lists, in order: those of its visible items."""
    return [_label_text(item) for item in _items(_legend(fig)) if item.visible]


def legend_width(fig: figure) -> float:
    """The width (px, estimated) of the legend of ``fig`` as :func:`fit_legend` laid it out."""
    legend = _legend(fig)
    return _legend_px(legend, legend_labels(fig), legend.ncols if isinstance(legend.ncols, int) else 1)


def fit_legend(fig: figure) -> int:
    """Lay the legend below ``fig`` out in as many columns as fit :data:`LEGEND_WIDTH_PX`, counting only the items
    it shows, and make the figure taller by the rows added so the plot keeps its height; returns the rows."""
    legend = _legend(fig)
    labels = legend_labels(fig)
    fitting = [n for n in range(1, len(labels) + 1) if _legend_px(legend, labels, n) <= LEGEND_WIDTH_PX]
    ncols = max(fitting, default=1)
    legend.ncols = ncols
    rows = max(math.ceil(len(labels) / ncols), 1)
    fig.height = FIGURE_PX + LEGEND_ROW_PX * (rows - 1)
    return rows


def show_series(fig: figure, name: str, shown: bool = True) -> None:
    """Show (or, ``shown=False``, hide) the renderer ``name`` of ``fig`` (a series that now has data) and its legend
    item, and refit the legend: ``show_series(throughput.figure, "tokens")`` once a rank reports tokens."""
    for item in _items(_legend(fig)):
        for renderer in item.renderers:
            if renderer.name == name:
                renderer.visible = item.visible = shown
    fit_legend(fig)
