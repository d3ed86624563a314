"""The dashboard's text: a few lines for a notebook without widgets, saying what the plots show.

The figures are the plotted series' last values (``MetricsStream.last_point``), the heatmaps' rates and the
bars' straggler, so the text and the picture say the same. A finished run's series end at its last step
(:meth:`.series.SeriesBook.final_end`): its rate is that of its last steps, not of the idle time after them.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from .figures import format_bytes, format_rate, plural
from .interval import int_keys
from .links import link_rates
from .steps import straggler

# what the lines are read from: a .stream.MetricsStream (not imported: the stream imports this module)
MetricsStream = Any

__all__ = ["summary_text", "gpu_text"]


def gpu_text(gpu: Mapping[str, Any]) -> str:
    """``NVIDIA H100: 1.2 GB in use, peak 3.4 GB, 87% busy`` for a snapshot's ``gpu`` field (utilization in
    percent; left out when None)."""
    text = (
        f"{gpu.get('name') or 'GPU'}: {format_bytes(float(gpu.get('memory_bytes') or 0))} in use, "
        f"peak {format_bytes(float(gpu.get('peak_bytes') or 0))}"
    )
    if gpu.get("utilization") is not None:
        text += f", {float(gpu['utilization']):.0f}% busy"
    return text


def _throughput_line(stream: MetricsStream) -> str:
    point = stream.last_point
    window = f"{stream.book.window:g} s" + (" up to the last step" if stream.finished else "")
    if not point:
        return "throughput: no record yet"
    if stream.unit == "samples":
        line = (f"throughput: {point['average']:,.1f} samples/s total since training began, "
                f"{point['total']:,.1f} over the last {window}")  # fmt: skip
    else:  # no batch size given: steps/s of the slowest rank
        line = (f"step rate: {point['average']:,.2f} steps/s since training began, {point['total']:,.2f} over "
                f"the last {window} (give the optimizer samples_per_step for samples/s)")  # fmt: skip
    if stream.tokens_shown:
        line += f", {point['tokens']:,.0f} tokens/s over the last {window}"
    return line


def _link_totals(latest: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """``node 0->1 1.0 MB (2.0 MB/s)`` for every node link that carried bytes: since the run started, at the
    rate the node heatmap shows (:func:`link_rates`)."""
    totals: defaultdict[tuple[int, int], int] = defaultdict(int)
    for snap in latest.values():
        if snap.get("node") is None:
            continue
        for dst, nbytes in int_keys(snap.get("sent_by_node")).items():
            totals[int(snap["node"]), dst] += nbytes
    rates = link_rates(latest)[1]
    return [
        f"node {s}->{d}{' (intra)' if s == d else ''} {format_bytes(n)} ({format_rate(rates.get((s, d), 0.0))})"
        for (s, d), n in sorted(totals.items())
        if n > 0
    ]


def _compression_line(stream: MetricsStream) -> str:
    raw = sum(s.get("raw_bytes", 0) for s in stream.latest.values())
    wire = sum(s.get("wire_bytes", 0) for s in stream.latest.values())
    ratio = stream.last_point.get("ratio", math.nan)
    saved = stream.last_point.get("saved_bytes", float(raw - wire))
    overall = raw / wire if wire else math.nan
    return (
        f"compression: {ratio:.2f}x over the last {stream.book.window:g} s ({overall:.2f}x since the start), "
        f"{format_bytes(saved)} saved ({format_bytes(wire)} on the wire)"
    )


def _slowest_line(stream: MetricsStream) -> str | None:
    """The straggler as the bars show it: the tallest bar (:func:`straggler`), its parts, and the median bar."""
    splits = stream.step_split
    rank = straggler({r: sum(s) for r, s in splits.items()}, {r: s[0] for r, s in splits.items()})
    if rank is None or not stream.plots.step_time.figure.visible:
        return None
    compute, comm, wait = splits[rank]
    median = statistics.median(sum(split) for split in splits.values())
    return (f"slowest rank: {rank} ({compute + comm + wait:.3f} s/step: compute {compute:.3f} s,"
            f" overlapped communication {comm:.3f} s, wait {wait:.3f} s; median {median:.3f} s)")  # fmt: skip


def summary_text(stream: MetricsStream) -> str:
    """Throughput, bytes per node link, compression, the slowest rank and the GPUs, a line each."""
    if not stream.latest:
        return "taco metrics: no snapshot yet"
    snaps = stream.latest.values()
    elapsed = max(s["elapsed_seconds"] for s in snaps)
    nodes = {s.get("node") for s in snaps}
    steps = min(s.get("steps", 0) for s in snaps)
    lines = [
        f"taco metrics: {plural(len(stream.latest), 'rank')} on {plural(len(nodes), 'node')}, {elapsed:.1f} s, "
        f"{plural(steps, 'optimizer step')}",  # the slowest rank's
        _throughput_line(stream),
    ]
    links = _link_totals(stream.latest)
    if links:
        lines.append("links: " + ", ".join(links))
    if stream.book.compressed():
        lines.append(_compression_line(stream))
    slowest = _slowest_line(stream)
    if slowest:
        lines.append(slowest)
    gpus = [f"rank {r} {gpu_text(s['gpu'])}" for r, s in sorted(stream.latest.items()) if s.get("gpu")]
    if gpus:
        lines.append("gpu: " + "; ".join(gpus))
    return "\n".join(lines)
