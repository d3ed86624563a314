"""Each rank's recorded history (``snapshot()["series"]``, :mod:`taco_notebook.comm.diagnostics.metrics`) and the
time series the dashboard plots from it, on one grid, by one definition shared with the text summary.

Ranks record cumulative counters at a fixed cadence and send the latest records with every snapshot;
:class:`SeriesBook` merges them by record number (a payload the notebook missed costs nothing while a later one
still carries its records). :meth:`SeriesBook.points` reads the counters on a grid of times, each rank's
counters linearly interpolated between its records and held after its last one, and turns them into rates:

- ``total``: all ranks' samples (or the slowest rank's steps, without samples) over the ``window`` before ``t``;
- ``raw``: the same over one grid step (drawn faint behind ``total``);
- ``average``: since training started (the first record before any rank moved: the model building and
  data loading before the loop are not counted), ``count(t) / (t - start)`` (over one grid step at least):
  what the summary calls the throughput;
- ``rank_N``: rank N's own rate over the window;
- ``ratio``: raw over wire bytes of the window (since the start where the window sent nothing; NaN before anything
  went on the wire: the compression plot starts at the first bytes); ``saved_bytes``: since the start.

Example::

    book = SeriesBook()
    book.add(snapshot["rank"], snapshot["series"])      # every payload
    points = book.points(book.times(after=0.0))         # {"time": [...], "total": [...], ...}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["RankSeries", "SeriesBook", "FIELDS", "GRID_S", "WINDOW_S", "MAX_POINTS", "LAG_S"]

FIELDS = ("t", "steps", "iterations", "samples", "tokens", "raw_bytes", "wire_bytes")
GRID_S = 0.05  # the plots' first grid step; doubled whenever a series would pass MAX_POINTS
WINDOW_S = 1.0  # the smoothing window's least width (it grows with the grid: 10 steps)
MAX_POINTS = 600  # points per series at most: a long run's plot stays cheap to send and draw
MAX_RECORDS = 4000  # records kept per rank: beyond, every other old one goes (the cadence halves)
LAG_S = 5.0  # a rank this far behind the latest one is taken as stopped (finished, or gone): its counts hold


class RankSeries:
    """One rank's records, in order, as columns (``FIELDS``)."""

    def __init__(self) -> None:
        self.next = 0  # the number of the next record this rank will send
        self.moved_at: float | None = None  # the last record's time before its first step, loop turn or sample
        self.columns: dict[str, list[float]] = {name: [] for name in FIELDS}

    def add(self, first: int, records: Sequence[Sequence[float]], fields: Sequence[str] = FIELDS) -> int:
        """Take the records numbered from ``first`` that are new; returns how many were."""
        index = {name: fields.index(name) for name in FIELDS if name in fields}
        added = 0
        for number, record in enumerate(records, start=first):
            if number < self.next:
                continue
            times = self.columns["t"]
            if times and record[index["t"]] <= times[-1]:
                self.next = number + 1
                continue  # same instant (or a clock that went back): one value per time
            for name in FIELDS:
                self.columns[name].append(float(record[index[name]]) if name in index else 0.0)
            if self.moved_at is None and any(self.columns[n][-1] for n in ("steps", "iterations", "samples")):
                self.moved_at = times[-2] if len(times) > 1 else times[-1]
            self.next = number + 1
            added += 1
        if len(self.columns["t"]) > MAX_RECORDS:
            for name, column in self.columns.items():
                self.columns[name] = column[:-1][::2] + column[-1:]  # keep the first and the latest
        return added

    @property
    def end(self) -> float:
        return self.columns["t"][-1] if self.columns["t"] else 0.0

    def at(self, name: str, times: np.ndarray) -> np.ndarray:
        """The cumulative counter ``name`` at ``times``: interpolated, 0 before the first record, then held."""
        t = self.columns["t"]
        if not t:
            return np.zeros_like(times)
        return np.interp(times, t, self.columns[name], left=0.0, right=self.columns[name][-1])


class SeriesBook:
    """Every rank's :class:`RankSeries`, and the plotted series derived from them."""

    def __init__(self) -> None:
        self.ranks: dict[int, RankSeries] = {}
        self.grid = GRID_S

    def clear(self) -> None:
        self.ranks.clear()
        self.grid = GRID_S

    def add(self, rank: int, series: Mapping[str, Any] | None) -> int:
        """Merge one snapshot's ``series`` of ``rank``; returns how many records were new."""
        if not series:
            return 0
        fields = tuple(series.get("fields") or FIELDS)
        return self.ranks.setdefault(rank, RankSeries()).add(int(series.get("first", 0)), series["records"], fields)

    @property
    def window(self) -> float:
        return max(WINDOW_S, 10 * self.grid)

    def unit(self) -> str:
        """``samples`` once any rank counted samples, else ``steps``."""
        return (
            "samples"
            if any(s.columns["samples"] and s.columns["samples"][-1] > 0 for s in self.ranks.values())
            else "steps"
        )

    def position_field(self) -> str:
        """A rank's position: its ``taco.progress`` turns where any rank runs such a loop, else its optimizer steps
        (as :func:`taco_notebook.model.cell_progress` counts the step the status line shows)."""
        loops = any(s.columns["iterations"] and s.columns["iterations"][-1] > 0 for s in self.ranks.values())
        return "iterations" if loops else "steps"

    def end(self, final: bool = False) -> float:
        """The latest time every rank's counts are known at: the slowest running rank's last record (ranks
        ``LAG_S`` behind the latest are taken as stopped); with ``final``, the latest record of all."""
        ends = [s.end for s in self.ranks.values() if s.columns["t"]]
        if not ends:
            return 0.0
        latest = max(ends)
        return latest if final else min(e for e in ends if e >= latest - LAG_S)

    def start(self) -> float | None:
        """Where the plots begin: the last record before any rank's first step, loop turn or sample (the model
        building before it is no news), one grid step earlier; None while nothing moved."""
        starts = [s.moved_at for s in self.ranks.values() if s.moved_at is not None]
        return max(min(starts) - self.grid, 0.0) if starts else None

    def began(self) -> float:
        """When training began: the last record before the first rank's first step, loop turn or sample (0.0
        while nothing moved). The average counts from here: a cell that builds its model for 15 s and then trains
        at 12,500 samples/s averages 12,500, not a fraction of it."""
        starts = [s.moved_at for s in self.ranks.values() if s.moved_at is not None]
        return min(starts) if starts else 0.0

    def moved_until(self) -> float | None:
        """When the count the plot shows last moved: the end of the run's last step (or loop turn, or sample); None
        while none moved. What follows (an evaluation, the cell's end) has no step to measure a rate by."""
        field = "samples" if self.unit() == "samples" else self.position_field()
        reached = []
        for series in self.ranks.values():
            values = series.columns[field]
            if values and values[-1] > 0:
                reached.append(series.columns["t"][values.index(values[-1])])
        return max(reached) if reached else None

    def times(self, after: float, final: bool = False) -> np.ndarray:
        """Grid times after ``after`` (and after :meth:`start`) up to :meth:`end`; with ``final`` the grid closes at
        the run's last step (:meth:`moved_until`), or at the end where nothing moved."""
        start = self.start()
        if start is None:
            return np.zeros(0)
        after = max(after, start)
        end = self.final_end() if final else self.end()
        first = (np.floor(after / self.grid + 1e-9) + 1) * self.grid
        grid = np.arange(first, end + 1e-9, self.grid)
        if final and end > after and (not len(grid) or grid[-1] < end - 1e-9):
            grid = np.append(grid, end)
        return grid

    def final_end(self) -> float:
        """Where the final picture ends: the run's last step, or the latest record where nothing moved."""
        moved = self.moved_until()
        return self.end(final=True) if moved is None else min(moved, self.end(final=True))

    def needs_coarser_grid(self, after: float) -> bool:
        """Whether the grid up to the current end passes MAX_POINTS (then the caller doubles it and redraws)."""
        return self.end(final=True) / self.grid > MAX_POINTS

    def cumulative(self, name: str, times: np.ndarray) -> np.ndarray:
        return sum((s.at(name, times) for s in self.ranks.values()), np.zeros_like(times))

    def points(self, times: np.ndarray, ranks: Sequence[int]) -> dict[str, list[float]]:
        """The plotted columns at ``times`` (see the module docstring); ``rank_N`` for each of ``ranks``."""
        before = np.maximum(times - self.window, 0.0)
        span = np.maximum(times - before, 1e-9)
        step_before = np.maximum(times - self.grid, 0.0)
        step_span = np.maximum(times - step_before, 1e-9)
        unit = self.unit()
        per_rank = {r: s for r, s in self.ranks.items() if s.columns["t"]}
        if unit == "samples":

            def count(ts: np.ndarray) -> np.ndarray:
                return self.cumulative("samples", ts)

            def rank_count(series: RankSeries, ts: np.ndarray) -> np.ndarray:
                return series.at("samples", ts)
        else:
            field = self.position_field()

            def count(ts: np.ndarray) -> np.ndarray:  # the slowest rank's position: what "step N" says
                if not per_rank:
                    return np.zeros_like(ts)
                return np.min([s.at(field, ts) for s in per_rank.values()], axis=0)

            def rank_count(series: RankSeries, ts: np.ndarray) -> np.ndarray:
                return series.at(field, ts)

        now = count(times)
        began = self.began()
        safe_t = np.maximum(times - began, self.grid)  # not a spike where training just began
        columns: dict[str, Any] = {
            "time": times,
            "total": (now - count(before)) / span,
            "raw": (now - count(step_before)) / step_span,
            "average": now / safe_t,
            "tokens": (self.cumulative("tokens", times) - self.cumulative("tokens", before)) / span,
        }
        for rank in ranks:
            series = per_rank.get(rank)
            columns[f"rank_{rank}"] = (
                (rank_count(series, times) - rank_count(series, before)) / span
                if series is not None
                else np.full_like(times, np.nan)
            )
        raw_total, wire_total = self.cumulative("raw_bytes", times), self.cumulative("wire_bytes", times)
        raw = raw_total - self.cumulative("raw_bytes", before)
        wire = wire_total - self.cumulative("wire_bytes", before)
        with np.errstate(divide="ignore", invalid="ignore"):
            since_start = np.where(wire_total > 0, raw_total / np.where(wire_total > 0, wire_total, 1), np.nan)
            # under a byte is rounding (counters of 1e9 bytes read a hair past a record), not traffic
            columns["ratio"] = np.where(wire >= 1, raw / np.where(wire >= 1, wire, 1), since_start)
        columns["saved_bytes"] = raw_total - wire_total
        return {name: [float(v) for v in values] for name, values in columns.items()}

    def compressed(self) -> bool:
        """Whether any rank put fewer bytes on the wire than it was asked to reduce."""
        return any(
            s.columns["wire_bytes"] and s.columns["wire_bytes"][-1] < s.columns["raw_bytes"][-1]
            for s in self.ranks.values()
        )
