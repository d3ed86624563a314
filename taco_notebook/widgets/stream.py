"""Turn successive batches of per-rank metric snapshots into the dashboard's plots and its text summary.

Snapshots (:func:`taco_notebook.comm.diagnostics.metrics.snapshot`, one dict per rank) hold cumulative counters
and each rank's recorded series; :class:`MetricsStream` keeps the previous batch, detects a new run (counters that
went backwards: history is dropped), differences batches into an :class:`~.interval.Interval` (:mod:`.interval`),
and updates the bokeh sources of :class:`~taco_notebook.widgets.plots.DashboardPlots`.

Example::

    stream = MetricsStream.from_snapshots(first_batch, capacity_bps=3.1e9)   # 25 Gbit NIC
    ...                                                                      # lay out stream.plots
    stream.push(next_batch)                                                  # every poll
    print(stream.summary())                                                  # the text fallback
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from bokeh.models.annotations import Title

from .figures import set_note
from .heatmaps import fill_heatmap
from .interval import NAN, Interval, Snapshot, interval_between, is_new_run
from .legend import show_series
from .links import link_rates, link_rates_between
from .plots import STEP_PARTS, STRAGGLER_OUTLINE, build_plots
from .ranks import band_points, name_extremes, rank_column, uses_band
from .series import SeriesBook
from .steps import step_split, straggler
from .summary import gpu_text, summary_text

__all__ = [
    "Interval",
    "MetricsStream",
    "interval_between",
    "is_new_run",
    "straggler",
    "gpu_text",
    "link_rates",
    "link_rates_between",
]

# A step part (overlapped communication, waiting) below this share of the tallest bar is a hairline of 1-3 px on
# the page: until some rank's reaches it, the part has no bars and no legend entry (_show_step_parts).
STEP_PART_SEEN = 0.02
MIN_RATE_POINTS = 3  # fewer points draw no line worth the name: the plot says "not enough steps" instead


def _gpu_label(gpu: Mapping[str, Any]) -> str:
    name = str(gpu.get("name") or "GPU").removeprefix("NVIDIA ")
    return name if gpu.get("utilization") is None else f"{name} · {float(gpu['utilization']):.0f}% busy"


class MetricsStream:
    """Feeds metric snapshot batches into a :class:`DashboardPlots`; keeps each rank's series (:mod:`.series`) and
    its two latest snapshots (for the heatmaps' last interval and the step-time bars).

    ``rollover`` caps the points the time-series sources keep (the grid also coarsens past ``series.MAX_POINTS``).
    A plot shows once it has something to say: compression once something was compressed, the link heatmaps
    once their links carried bytes, the step-time bars once a rank communicated, GPU memory once a rank used CUDA;
    the throughput plot and the bars say "not enough steps" until they have a line or a bar to draw.
    """

    def __init__(self, node_of_rank: Mapping[int, int], *, capacity_bps: float | None = None, rollover: int = 600):
        if rollover < 1:
            raise ValueError(f"rollover must be a positive number of points, got {rollover!r}")
        self.node_of_rank = dict(node_of_rank)
        self.capacity_bps = capacity_bps
        self.rollover = rollover
        self.plots = build_plots(self.node_of_rank, capacity_bps=capacity_bps)
        self.book = SeriesBook()
        self.latest: dict[int, Snapshot] = {}
        self.previous: dict[int, Snapshot] = {}  # each rank's snapshot before its latest one
        self.last_interval: Interval | None = None
        self.last_point: dict[str, float] = {}  # the plotted series' values at their last time: what summary() says
        self.drawn_until = 0.0
        self.new_runs = 0  # how many times counters went backwards and history was dropped
        self.unit = "steps"  # throughput in steps/s until some rank reports samples (a batch size)
        self.tokens_shown = False
        self.step_parts_shown: set[str] = set()  # the step-time parts above zero on some rank at some point
        self.step_split: dict[int, tuple[float, float, float]] = {}  # rank -> what its bar shows (compute, comm, wait)
        self.finished = False  # finish() was called: the series end at the run's last step

    @classmethod
    def from_snapshots(cls, snapshots: Iterable[Snapshot], **kwargs: Any) -> MetricsStream:
        """A stream laid out for the ranks and nodes of a first batch, which it then pushes."""
        batch = list(snapshots)
        stream = cls({int(s["rank"]): int(s["node"]) for s in batch if s.get("rank") is not None}, **kwargs)
        stream.push(batch)
        return stream

    def push(self, snapshots: Iterable[Snapshot]) -> Interval | None:
        """Add one batch (one snapshot per reporting rank); returns the interval (rates) it closed, if any. The time
        series grow by the records the batch brought, up to the time every rank has reached; each reporting
        rank's bar is its recent steps' median (:func:`.steps.step_split`)."""
        current = {int(s["rank"]): s for s in snapshots if s.get("rank") is not None}
        if any(is_new_run(self.latest[r], s) for r, s in current.items() if r in self.latest):
            self.clear()
            self.new_runs += 1
        for rank, snap in current.items():
            before = self.latest.get(rank)
            if before is not None and snap["elapsed_seconds"] > before["elapsed_seconds"]:
                self.previous[rank] = before
            self.book.add(rank, snap.get("series"))
            split = step_split(snap.get("recent_steps"))
            if split is not None:
                self.step_split[rank] = split
        interval = interval_between(self.latest, current)
        self.latest.update(current)
        self._render_gpu()
        self._render_series()
        self._render_links()
        self._render_steps()
        if interval is not None:
            self.last_interval = interval
        return interval

    def finish(self) -> None:
        """The run ended: draw the series up to the run's last step (the final picture's last point; what follows,
        an evaluation or the cell's end, has no step to measure a rate by), list the step parts the final bars
        show."""
        self.finished = True
        self._render_series(final=True)
        self._render_steps()
        self._show_step_parts(final=True)

    def clear(self) -> None:
        """Drop all history: empty the time series, blank the heatmaps and bars."""
        self.latest.clear()
        self.previous.clear()
        self.book.clear()
        self.last_interval = None
        self.last_point = {}
        self.drawn_until = 0.0
        self.finished = False
        for plot in (self.plots.throughput, self.plots.compression):
            for source in plot.sources.values():
                source.data = {name: [] for name in source.data}
        for plot in (self.plots.node_links, self.plots.rank_links, self.plots.rank_links_across):
            fill_heatmap(plot, {}, {})
        bars = self.plots.step_time.sources["step_time"]
        n = len(bars.data["rank"])
        bars.data.update(compute=[0.0] * n, comm=[0.0] * n, wait=[0.0] * n, total=[0.0] * n, note=[""] * n,
                         outline=[None] * n)  # fmt: skip
        self.step_split.clear()

    def _use_units(self) -> bool:
        """Switch the throughput plot to samples/s once a rank reports samples, and show tokens/s once reported;
        True when the unit changed (the drawn series are then redrawn in the new one)."""
        fig = self.plots.throughput.figure
        unit = self.book.unit()
        changed = unit != self.unit
        self.unit = unit
        assert isinstance(fig.title, Title)  # figure(title=str) makes one
        name = "Throughput" if unit == "samples" else "Step rate"
        fig.title.text = f"{name} ({unit}/s, smoothed over {self.book.window:g} s)"
        fig.yaxis[0].axis_label = f"{unit}/s"
        if not self.tokens_shown and any(s.get("tokens", 0) > 0 for s in self.latest.values()):
            self.tokens_shown = True
            show_series(fig, "tokens")
            for axis in fig.select(name="tokens_axis"):
                axis.visible = True  # type: ignore[attr-defined]  # select() is typed as Model
        return changed

    def _render_series(self, final: bool = False) -> None:
        """Draw the grid points the records now cover (:meth:`SeriesBook.points`); all of them again when the unit
        changed, the grid coarsened, or the final picture ends before what was drawn live."""
        redraw = self._use_units()
        while self.book.needs_coarser_grid(self.drawn_until):
            self.book.grid *= 2
            redraw = True
        redraw = redraw or (final and self.drawn_until > self.book.final_end() + 1e-9)
        after = 0.0 if redraw else self.drawn_until
        times = self.book.times(after, final)
        throughput = self.plots.throughput.sources["throughput"]
        compression = self.plots.compression.sources["compression"]
        if redraw:
            for source in (throughput, compression):
                source.data = {name: [] for name in source.data}
        if len(times) > 0:
            self._stream_points(self.book.points(times, sorted(self.node_of_rank)))
            self.drawn_until = float(times[-1])
        self.plots.compression.figure.visible = self.plots.compression.figure.visible or self.book.compressed()
        # a finished run shorter than the smoothing window never had a full window of steps to measure a rate by
        short = final and self.drawn_until - self.book.began() < self.book.window
        enough = len(throughput.data["time"]) >= MIN_RATE_POINTS and not short
        set_note(self.plots.throughput.figure, None if enough else self._not_enough())

    def _stream_points(self, points: dict[str, list[float]]) -> None:
        """Append ``points`` to the throughput and compression sources; many ranks as a band named by its ends."""
        ranks = sorted(self.node_of_rank)
        if uses_band(len(ranks)):
            per_rank = {rank: points.pop(rank_column(rank)) for rank in ranks}
            points.update(band_points(per_rank))
            name_extremes(self.plots.throughput.figure, {r: values[-1] for r, values in per_rank.items()})
        keep = self.rollover
        throughput = self.plots.throughput.sources["throughput"]
        compression = self.plots.compression.sources["compression"]
        throughput.stream({name: points[name][-keep:] for name in throughput.data}, rollover=keep)
        sent = [i for i, ratio in enumerate(points["ratio"]) if not math.isnan(ratio)][-keep:]  # no gap, no NaN
        if sent:
            compression.stream({name: [points[name][i] for i in sent] for name in compression.data}, rollover=keep)
        self.last_point = {name: values[-1] for name, values in points.items()}  # what the summary quotes

    def _not_enough(self) -> str:
        return "not enough steps" if self.finished else "not enough steps yet"

    def _render_links(self) -> None:
        by_rank, by_node = link_rates(self.latest)
        last_rank, last_node = link_rates_between(self.previous, self.latest)
        for plot in (self.plots.rank_links, self.plots.rank_links_across):
            fill_heatmap(plot, by_rank, last_rank)
        fill_heatmap(self.plots.node_links, by_node, last_node)
        if any(s.get("raw_bytes", 0) > 0 for s in self.latest.values()):
            self.plots.step_time.figure.visible = True

    def _render_steps(self) -> None:
        """Draw every rank's bar (:attr:`step_split`: a rank that did not report keeps its last) and mark the
        straggler (:func:`straggler`: the tallest bar) with an outline and "slowest"; a note while no rank has a
        timed step."""
        bars = self.plots.step_time.sources["step_time"]
        ranks = [int(name) for name in bars.data["rank"]]
        split = [self.step_split.get(rank, (0.0, 0.0, 0.0)) for rank in ranks]
        splits = self.step_split
        slowest = straggler({r: sum(s) for r, s in splits.items()}, {r: s[0] for r, s in splits.items()})
        bars.data.update(
            compute=[s[0] for s in split], comm=[s[1] for s in split], wait=[s[2] for s in split],
            total=[sum(s) for s in split], note=["slowest" if rank == slowest else "" for rank in ranks],
            outline=[STRAGGLER_OUTLINE if rank == slowest else None for rank in ranks],
        )  # fmt: skip
        set_note(self.plots.step_time.figure, None if slowest is not None else self._not_enough())
        self._show_step_parts()

    def _show_step_parts(self, final: bool = False) -> None:
        """Give a step part (overlapped communication, waiting) its bars and legend entry once some rank's is seen
        (:data:`STEP_PART_SEEN`), and keep them while the run goes on (no entry coming and going with each update);
        the final picture (``final``) lists only the parts its bars show: none that stayed ~zero throughout."""
        bars = self.plots.step_time.sources["step_time"].data
        seen = STEP_PART_SEEN * max(bars["total"], default=0.0)
        fig = self.plots.step_time.figure
        for part in STEP_PARTS:
            shows = any(value > 0 and value >= seen for value in bars[part])
            if shows and part not in self.step_parts_shown:
                self.step_parts_shown.add(part)
                show_series(fig, f"step_{part}")
            elif final and not shows and part in self.step_parts_shown:
                self.step_parts_shown.discard(part)
                show_series(fig, f"step_{part}", shown=False)

    def _render_gpu(self) -> None:
        """GPU memory per rank from the latest snapshots; the figure shows once some rank reports a GPU."""
        gpus: dict[int, Mapping[str, Any]] = {r: snap["gpu"] for r, snap in self.latest.items() if snap.get("gpu")}
        if not gpus:
            return
        plot = self.plots.gpu
        source = plot.sources["gpu"]
        ranks = [int(name) for name in source.data["rank"]]
        source.data.update(
            memory=[float(gpus[r].get("memory_bytes") or 0) if r in gpus else NAN for r in ranks],
            peak=[float(gpus[r].get("peak_bytes") or 0) if r in gpus else NAN for r in ranks],
            label=[_gpu_label(gpus[r]) if r in gpus else "" for r in ranks],
        )  # fmt: skip
        plot.figure.visible = True

    def summary(self) -> str:
        """A few lines for a notebook without widgets (:func:`.summary.summary_text`): the plots' last values."""
        return summary_text(self)
