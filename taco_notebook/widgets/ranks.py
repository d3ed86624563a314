"""The throughput plot's per-rank series: one line per rank up to :data:`MAX_RANK_LINES` ranks, a band beyond.

* Lines: rank 0's is the widest and lowest, each next rank's narrower and drawn over it, so lines that coincide
  (synchronous training gives every rank the same rate) show as nested stripes of every rank's colour rather
  than as the last rank's line alone.
* Band: the ranks' min to max, shaded, and their median (columns :data:`BAND_COLUMNS`), on an axis of its own;
  the min edge is labelled with the rank of the lowest rate at the plot's end, the max edge with the highest
  (:func:`name_extremes`; "lowest", not "slowest": the step-time bars call the tallest bar that). Sixteen lines in
  one band showed only the last one drawn, in colours that repeat after ten, under a legend taller than the plot.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from bokeh.core.property.vectorization import value
from bokeh.models import ColumnDataSource, DataRange1d, LinearAxis, NumeralTickFormatter
from bokeh.models.renderers import GlyphRenderer
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

from .legend import fit_legend, legend_items

__all__ = ["MAX_RANK_LINES", "BAND_COLUMNS", "rank_column", "uses_band", "rank_series_columns", "line_widths",
           "draw_ranks", "band_points", "name_extremes", "ALIKE"]  # fmt: skip

MAX_RANK_LINES = 8  # more ranks make a band
BAND_COLUMNS = ("ranks_min", "ranks_median", "ranks_max")
NARROWEST_PX = 3.0  # the last rank's line: wider than the total's (2 px) drawn over it, so a rim shows
WIDEST_PX = 12.0
BAND_COLOUR = "#1f77b4"
ALIKE = 0.005  # ranks within 0.5% of each other are alike: no lowest or highest to name


def rank_column(rank: int) -> str:
    """The throughput source's column for one rank: ``rank_column(3) == "rank_3"``."""
    return f"rank_{rank}"


def uses_band(count: int) -> bool:
    return count > MAX_RANK_LINES


def rank_series_columns(ranks: Sequence[int]) -> list[str]:
    """The source's per-rank columns: ``rank_N`` for each rank, or :data:`BAND_COLUMNS` for many."""
    return list(BAND_COLUMNS) if uses_band(len(ranks)) else [rank_column(r) for r in ranks]


def line_widths(count: int) -> list[float]:
    """Nested widths, rank order: ``line_widths(4) == [12.0, 9.0, 6.0, 3.0]``; each rim at least 0.5 px."""
    if count <= 1:
        return [NARROWEST_PX] * count
    step = min(3.0, (WIDEST_PX - NARROWEST_PX) / (count - 1))
    return [NARROWEST_PX + step * (count - 1 - i) for i in range(count)]


def draw_ranks(fig: figure, source: ColumnDataSource, ranks: Sequence[int]) -> list[GlyphRenderer]:
    """Draw the per-rank series of ``source`` (:func:`rank_series_columns`) on ``fig``; returns their renderers,
    bottom first."""
    if uses_band(len(ranks)):
        return _draw_band(fig, source, len(ranks))
    lines = []
    for i, (rank, width) in enumerate(zip(ranks, line_widths(len(ranks)), strict=True)):
        lines.append(fig.line("time", rank_column(rank), source=source, color=Category10_10[i % 10],
                              line_width=width, legend_label=f"rank {rank}", name=rank_column(rank)))  # fmt: skip
    return lines


def _draw_band(fig: figure, source: ColumnDataSource, count: int) -> list[GlyphRenderer]:
    """The band on an axis of its own (right, in the band's blue): one rank's rate is 1/count of the total's, a
    sliver at the bottom of the total's axis."""
    label = f"{count} ranks: median, min-max"  # one legend item for the band and its median
    band = fig.varea("time", "ranks_min", "ranks_max", source=source, y_range_name="ranks", fill_color=BAND_COLOUR,
                     fill_alpha=0.18, legend_label=label, name="ranks_band")  # fmt: skip
    low = fig.line("time", "ranks_min", source=source, y_range_name="ranks", color="#d62728", line_width=1.5,
                   legend_label="lowest rank", name="ranks_min")  # fmt: skip
    high = fig.line("time", "ranks_max", source=source, y_range_name="ranks", color="#2ca02c", line_width=1.5,
                    legend_label="highest rank", name="ranks_max")  # fmt: skip
    median = fig.line("time", "ranks_median", source=source, y_range_name="ranks", color=BAND_COLOUR, line_width=2,
                      legend_label=label, name="ranks_median")  # fmt: skip
    # headroom: the band's top under the total's (the two axes would otherwise put both maxima at the top)
    ranks_range = DataRange1d(renderers=[band, low, high, median], start=0, range_padding=0.6)
    fig.extra_y_ranges = {**fig.extra_y_ranges, "ranks": ranks_range}
    axis = LinearAxis(y_range_name="ranks", axis_label="per rank", name="ranks_axis", axis_label_text_color=BAND_COLOUR,
                      major_label_text_color=BAND_COLOUR, axis_line_color=BAND_COLOUR)  # fmt: skip
    axis.formatter = NumeralTickFormatter(format="0,0.[0]")  # type: ignore[assignment]  # stub too narrow
    fig.add_layout(axis, "right")
    return [band, low, high, median]  # the median over the edges: alike ranks show as one blue line


def band_points(per_rank: Mapping[int, Sequence[float]]) -> dict[str, list[float]]:
    """:data:`BAND_COLUMNS` over the ranks' series (NaN, a rank not heard of yet, left out)."""
    if not per_rank:
        return {name: [] for name in BAND_COLUMNS}
    values = np.array([list(series) for series in per_rank.values()], dtype=float)
    known = ~np.isnan(values).all(axis=0)
    out = {name: np.full(values.shape[1], np.nan) for name in BAND_COLUMNS}
    if known.any():
        out["ranks_min"][known] = np.nanmin(values[:, known], axis=0)
        out["ranks_median"][known] = np.nanmedian(values[:, known], axis=0)
        out["ranks_max"][known] = np.nanmax(values[:, known], axis=0)
    return {name: [float(v) for v in column] for name, column in out.items()}


def name_extremes(fig: figure, last: Mapping[int, float]) -> tuple[int, int] | None:
    """Label the band's edges with the ranks of the lowest and highest rate ``last`` (the plot's last point);
    alike ranks (within :data:`ALIKE`) name none. Returns (lowest, highest), None when alike or unknown."""
    rates = {rank: rate for rank, rate in last.items() if not math.isnan(rate)}
    edges = {"ranks_min": "lowest", "ranks_max": "highest"}
    items = {edges[r.name]: item for item in legend_items(fig) for r in item.renderers if r.name in edges}
    if len(items) < 2:
        return None
    named: tuple[int, int] | None = None
    if rates and max(rates.values()) - min(rates.values()) > ALIKE * max(rates.values()):
        named = (min(rates, key=lambda r: (rates[r], r)), max(rates, key=lambda r: (rates[r], -r)))
    labels = (f"lowest: rank {named[0]}", f"highest: rank {named[1]}") if named else (
        "lowest rank (all alike)", "highest rank (all alike)")  # fmt: skip
    changed = False
    for item, label in zip((items["lowest"], items["highest"]), labels, strict=True):
        if getattr(item.label, "value", item.label) != label:
            item.label = value(label)  # a plain str would name a column
            changed = True
    if changed:
        fit_legend(fig)
    return named
