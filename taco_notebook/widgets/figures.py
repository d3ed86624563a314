"""What every dashboard figure shares: the :class:`Plot` pair, the figure factory, number formats, the note a plot
shows instead of an empty frame, and an axis of ranks (or nodes) that stays readable at any count.

Nothing here does I/O or names a CDN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bokeh.models import (
    Axis,
    ColumnDataSource,
    CustomJSTickFormatter,
    FixedTicker,
    Node,
    Range1d,
    SingleIntervalTicker,
)
from bokeh.models.annotations import Label, Legend
from bokeh.plotting import figure

from .legend import FIGURE_PX

__all__ = ["Plot", "new_figure", "format_bytes", "format_rate", "plural", "bytes_formatter", "add_note", "set_note",
           "rank_range", "rank_axis", "TOOLS", "MAX_NAMED_TICKS"]  # fmt: skip

TOOLS = "pan,wheel_zoom,box_zoom,reset,save"
MAX_NAMED_TICKS = 16  # an axis of up to this many ranks names each; beyond, every few (64 labels would overprint)

# Decimal bytes as format_bytes writes them ("1.5 MB"), for axis ticks and colour bars: no "1.500e+8".
_BYTES_JS = """
const units = ["B", "kB", "MB", "GB", "TB"];
let scaled = tick, i = 0;
while (Math.abs(scaled) >= 1000 && i < units.length - 1) { scaled /= 1000; i += 1; }
const text = String(Number(scaled.toFixed(2)));  // 1.5 MB, 512 B; 0.2 B only on an axis of nothing
return text + " " + units[i] + suffix;
"""
_NAME_JS = "const i = Math.round(tick); return Math.abs(tick - i) < 1e-6 && i >= 0 && i < names.length ? names[i] : '';"


@dataclass(frozen=True)
class Plot:
    """A figure and the sources that feed it, keyed by role (``"throughput"``, ``"links"``, ...)."""

    figure: figure
    sources: dict[str, ColumnDataSource]


def new_figure(title: str, **kwargs: Any) -> figure:
    """A dashboard figure: as wide as its place, :data:`FIGURE_PX` tall. Its frame is not aligned with its
    neighbours' (bokeh's default): a taller legend under the plot beside it would squeeze this plot's frame."""
    kwargs.setdefault("height", FIGURE_PX)
    return figure(title=title, sizing_mode="stretch_width", tools=TOOLS, toolbar_location="right", frame_align=False,
                  **kwargs)  # fmt: skip


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


def add_note(fig: figure) -> Label:
    """A line of text in the middle of the frame, hidden until :func:`set_note` says something."""
    note = Label(x=Node(target="frame", symbol="center"), y=Node(target="frame", symbol="center"), text="",
                 text_align="center", text_baseline="middle", text_color="#555555", text_font_size="12pt",
                 visible=False, name="too_few")  # fmt: skip
    fig.add_layout(note)
    return note


def set_note(fig: figure, text: str | None) -> None:
    """Say ``text`` in the plot (``"not enough steps yet"``) and hide its legend, or (``None``) show the legend and
    no note: a plot with too little to draw says so rather than showing an empty frame under a legend."""
    for note in fig.center:
        if isinstance(note, Label) and note.name == "too_few" and (note.visible, note.text) != (text is not None,
                                                                                                text or ""):
            note.update(visible=text is not None, text=text or "")
    for legend in fig.below:
        if isinstance(legend, Legend) and legend.visible != (text is None):
            legend.visible = text is None


def rank_range(count: int, *, reversed_: bool = False) -> Range1d:
    """Positions 0 .. count-1 with half a cell of margin (top down with ``reversed_``: a heatmap's rows)."""
    low, high = -0.5, count - 0.5
    return Range1d(start=high, end=low) if reversed_ else Range1d(start=low, end=high)


def rank_axis(axis: Axis | Sequence[Axis], names: Sequence[str], most: int = MAX_NAMED_TICKS) -> None:
    """Ticks at positions ``0 .. len(names)-1`` labelled with ``names``: each one up to ``most``, else every 2nd,
    4th, 8th, ... so that at most ``most`` show."""
    axes = [axis] if isinstance(axis, Axis) else list(axis)
    count = len(names)
    every = 1
    while count / every > most:
        every *= 2
    for one in axes:
        one.ticker = FixedTicker(ticks=list(range(count))) if every == 1 else SingleIntervalTicker(interval=every)
        one.formatter = CustomJSTickFormatter(code=_NAME_JS, args={"names": list(names)})
        one.minor_tick_line_color = None
