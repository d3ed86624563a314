"""The live training dashboard's pure parts: bokeh plots and the stream that turns metric snapshots into them.

``widgets`` never talks to engines: it renders the snapshot dicts it is handed
(:func:`taco_notebook.comm.diagnostics.metrics.snapshot`).
"""

from __future__ import annotations

from .interval import Interval, interval_between
from .plots import DashboardPlots, Plot, build_plots
from .stream import MetricsStream

__all__ = ["DashboardPlots", "Interval", "MetricsStream", "Plot", "build_plots", "interval_between"]
