"""Cheap per-rank counters of where communication time and bytes go, as plain data.

Every collective adds its wall time, its raw and wire bytes, and the bytes this rank sent to each peer (from
the algorithm's schedule: ring neighbour, node peers, cross-node peer). ``step(samples=…)`` closes a training
step; ``DistributedOptimizer`` calls it for you. ``snapshot()`` returns a dict the dashboard (and anyone)
can read: totals since ``reset()``, the last step, the durations of the recent steps, and per-link bytes by rank
and by node.

Recording is a few dict updates per collective (never per element), so it stays on in the hot path.

The *series* is what the dashboard plots: at most every ``RECORD_S`` seconds, as a step closes or a
``taco.progress`` loop turns (``iteration()``), the rank appends one record of its cumulative counters
(``SERIES_FIELDS``: elapsed seconds, steps, loop iterations, samples, tokens, raw and wire bytes) to a ring of
the last ``SERIES_SENT``. Every snapshot carries that ring with the number of its first record, so the notebook
rebuilds each rank's history at a fixed cadence whatever the sends' timing, and a payload it missed (only the
latest one is kept on its side) costs nothing as long as a later one arrives within the ring's reach.

A *sender* (``set_sender``) is how snapshots leave the rank while a cell runs: ``step()`` and
``taco.progress`` call it at most once per interval with ``{"metrics": snapshot(), "progress": ...}``. Under
``%%taco_run`` the engine installs one that sends the payload to the notebook (ipyparallel's datapub, see
:mod:`taco_notebook.engine.calls`); under plain ``mpiexec`` there is none and nothing is sent. ``sender()``, ``steps()``
and ``progress_state()`` tell that engine side (and ``taco.progress``) what it needs without reaching in here.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

from .gpu import gpu_snapshot

__all__ = [
    "record",
    "add_wait",
    "step",
    "iteration",
    "mark",
    "snapshot",
    "reset",
    "gpu_snapshot",
    "steps",
    "Sender",
    "set_sender",
    "sender",
    "set_progress",
    "progress_state",
    "send",
    "maybe_send",
    "SERIES_FIELDS",
    "RECORD_S",
    "SERIES_SENT",
    "STEP_FIELDS",
    "STEPS_SENT",
]

# One series record, in this order: cumulative since reset() (``t`` is the rank's elapsed seconds).
SERIES_FIELDS = ("t", "steps", "iterations", "samples", "tokens", "raw_bytes", "wire_bytes")
RECORD_S = 0.05  # 20 records a second at most: a 5 s, 120-step cell gets ~100, a slower loop one per step
SERIES_SENT = 64  # records each snapshot carries: 3 s at full cadence, 8 sends' worth at the default interval
# A recent step: wall seconds since the previous step's end; of those, inside collectives, and blocked on them.
# The dashboard's step time is their median: an evaluation between two steps does not make the rank look slow.
STEP_FIELDS = ("seconds", "comm_seconds", "wait_seconds")
STEPS_SENT = 32  # the latest steps each snapshot carries


class _Counters:
    __slots__ = ("comm_s", "wait_s", "raw", "wire", "collectives", "samples", "tokens", "sent")

    def __init__(self) -> None:
        self.comm_s = 0.0  # inside collectives (overlaps compute when they run in the background)
        self.wait_s = 0.0  # the training loop blocked on communication (synchronize)
        self.raw = 0  # bytes the collectives were asked to reduce
        self.wire = 0  # bytes that actually left this rank after compression
        self.collectives = 0
        self.samples = 0
        self.tokens = 0
        self.sent: defaultdict[int, int] = defaultdict(int)  # peer rank -> bytes sent

    def add(self, other: _Counters) -> None:
        for name in ("comm_s", "wait_s", "raw", "wire", "collectives", "samples", "tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for peer, nbytes in other.sent.items():
            self.sent[peer] += nbytes


class _Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # collectives are recorded from the communication thread
        self.reset()

    def reset(self) -> None:
        self.total = _Counters()
        self.current = _Counters()
        self.last: dict[str, Any] = {}
        self.steps = 0
        self.iterations = 0  # taco.progress turns, all loops together: a position that never goes back
        self.started = self.step_started = time.perf_counter()
        self.step_timed = False  # step_started is a step's start (a step's end, or a loop's start): not the cell's
        self.recent_steps: deque[list[float]] = deque(maxlen=STEPS_SENT)
        self.series: deque[list[float]] = deque(maxlen=SERIES_SENT)
        self.records = 0  # records made since reset (the number of the next one)
        self.recorded_at = self.started
        self.append_record(self.started)  # the origin: every counter at zero when the cell started

    def append_record(self, now: float, with_current: bool = True) -> None:
        """One series record of the counters now (caller holds the lock); ``with_current=False``: as they were
        before the open step's collectives."""
        total = _Counters()
        total.add(self.total)
        if with_current:
            total.add(self.current)
        self.series.append(
            [
                round(now - self.started, 4),
                self.steps,
                self.iterations,
                total.samples,
                total.tokens,
                total.raw,
                total.wire,
            ]
        )
        self.records += 1
        self.recorded_at = now

    def record_last_step(self) -> None:
        """A record at the last step's end where none holds it yet: what follows is no step's time in the series."""
        if self.series and self.series[-1][1] != self.steps and self.step_started > self.recorded_at:
            self.append_record(self.step_started, with_current=False)

    def maybe_record(self, now: float) -> None:
        if now - self.recorded_at >= RECORD_S:
            self.append_record(now)


_metrics = _Metrics()
Sender = Callable[[dict[str, Any]], None]


class _Sending:
    """Who receives snapshots, how often, and what the progress bar (``taco.progress``) last said."""

    __slots__ = ("sender", "interval", "last", "progress")

    def __init__(self) -> None:
        self.sender: Sender | None = None
        self.interval = 0.25  # seconds: the dashboard redraws at 2-4 Hz, faster would only cost the ranks
        self.last = 0.0
        self.progress: dict[str, Any] | None = None


_sending = _Sending()


def record(seconds: float, raw_bytes: int, wire_bytes: int, sent: dict[int, int]) -> None:
    """One collective: its duration, raw/wire bytes and the bytes sent to each peer rank."""
    with _metrics.lock:
        current = _metrics.current
        current.comm_s += seconds
        current.raw += raw_bytes
        current.wire += wire_bytes
        current.collectives += 1
        for peer, nbytes in sent.items():
            current.sent[peer] += nbytes


def add_wait(seconds: float) -> None:
    """Time the training loop spent blocked waiting for communication to finish."""
    with _metrics.lock:
        _metrics.current.wait_s += seconds


def step(samples: int = 0, tokens: int = 0) -> None:
    """Close a training step that processed ``samples`` (and ``tokens``) on this rank."""
    now = time.perf_counter()
    with _metrics.lock:
        if _metrics.step_started - _metrics.recorded_at >= RECORD_S:
            # the counters as the previous step closed (a record throttled then): this step's samples are spread
            # over this step, not over the steps before it
            _metrics.append_record(_metrics.step_started, with_current=False)
        current = _metrics.current
        current.samples += samples
        current.tokens += tokens
        seconds = max(now - _metrics.step_started, 1e-9)
        _metrics.last = {
            "seconds": seconds,
            "comm_seconds": current.comm_s,
            "wait_seconds": current.wait_s,
            "compute_seconds": max(seconds - current.wait_s, 0.0),
            "samples": current.samples,
            "samples_per_s": current.samples / seconds,
            "tokens_per_s": current.tokens / seconds,
            "raw_bytes": current.raw,
            "wire_bytes": current.wire,
            "compression_ratio": current.raw / current.wire if current.wire else 1.0,
            "sent": dict(current.sent),
        }
        if _metrics.step_timed:  # the first step after reset() without a loop's mark() also timed the setup
            _metrics.recent_steps.append([round(seconds, 6), round(current.comm_s, 6), round(current.wait_s, 6)])
        _metrics.total.add(current)
        _metrics.current = _Counters()
        _metrics.steps += 1
        _metrics.step_started = now
        _metrics.step_timed = True
        _metrics.maybe_record(now)
    if _sending.sender is not None and now - _sending.last >= _sending.interval:
        send()


def mark(now: float | None = None) -> None:
    """Record the counters now (at the series' cadence): a loop starts, and what it does counts from here, not
    from the model building before it (``taco.progress`` calls it)."""
    now = now or time.perf_counter()
    with _metrics.lock:
        _metrics.maybe_record(now)
        if _metrics.steps == 0:
            _metrics.step_started = max(_metrics.step_started, now)
            _metrics.step_timed = True


def iteration(now: float | None = None) -> None:
    """One turn of a ``taco.progress`` loop: counted, recorded at the series' cadence, sent at the interval."""
    now = now or time.perf_counter()
    with _metrics.lock:
        _metrics.iterations += 1
        _metrics.maybe_record(now)
    if _sending.sender is not None and now - _sending.last >= _sending.interval:
        send()


def snapshot() -> dict[str, Any]:
    """Everything recorded since ``reset()``, as plain data (JSON-serialisable but for int dict keys).

    ``series`` holds the latest records (``{"fields": SERIES_FIELDS, "first": number of the first record,
    "records": [[t, steps, ...], ...]}``); the end of a loop or a cell adds one for the state at that moment, after
    one for the last step's end if no record holds it yet (the time after the last step is no step's).
    ``recent_steps``: the latest steps, ``[[seconds, comm_seconds, wait_seconds], ...]`` (``STEP_FIELDS``).
    """
    from ..state import state

    with _metrics.lock:
        now = time.perf_counter()
        _metrics.record_last_step()
        if _metrics.series and _record_changed(_metrics):
            _metrics.append_record(now)
        total = _Counters()
        total.add(_metrics.total)
        total.add(_metrics.current)
        elapsed = now - _metrics.started
        last = dict(_metrics.last)
        steps = _metrics.steps
        iterations = _metrics.iterations
        series = {"fields": SERIES_FIELDS, "first": _metrics.records - len(_metrics.series),
                  "records": [list(r) for r in _metrics.series]}  # fmt: skip
        recent_steps = [list(r) for r in _metrics.recent_steps]
    topology = state.topology
    by_node: defaultdict[int, int] = defaultdict(int)
    if topology is not None:
        node_of = {r: n for n, ranks in enumerate(topology.node_ranks) for r in ranks}
        for peer, nbytes in total.sent.items():
            by_node[node_of[peer]] += nbytes
    return {
        "rank": topology.rank if topology else None,
        "node": topology.node if topology else None,
        "steps": steps,
        "iterations": iterations,
        "elapsed_seconds": elapsed,
        "collectives": total.collectives,
        "comm_seconds": total.comm_s,
        "wait_seconds": total.wait_s,
        "samples": total.samples,
        "samples_per_s": total.samples / elapsed if elapsed > 0 else 0.0,
        "raw_bytes": total.raw,
        "wire_bytes": total.wire,
        "compression_ratio": total.raw / total.wire if total.wire else 1.0,
        "bytes_saved": total.raw - total.wire,
        "sent_by_rank": dict(total.sent),
        "sent_by_node": dict(by_node),
        "tokens": total.tokens,
        "last_step": last,
        "recent_steps": recent_steps,
        "gpu": gpu_snapshot(state.device),
        "series": series,
    }


def _record_changed(m: _Metrics) -> bool:
    """Whether a counter the series records moved since its last record (a snapshot then records the moment)."""
    last = m.series[-1]
    total, current = m.total, m.current
    return (
        last[1] != m.steps
        or last[2] != m.iterations
        or last[3] != total.samples + current.samples
        or last[5] != total.raw + current.raw
    )


def reset() -> None:
    """Start counting afresh (for example at the start of a benchmark). ``%%taco_run`` does it before each cell."""
    with _metrics.lock:
        _metrics.reset()
    _sending.progress = None


def steps() -> int:
    """Training steps closed since ``reset()`` (what ``snapshot()["steps"]`` says, without building one)."""
    with _metrics.lock:
        return _metrics.steps


def set_sender(sender: Sender | None, interval: float = 0.25) -> None:
    """Send ``{"metrics": snapshot(), "progress": …}`` to ``sender`` at most every ``interval`` seconds
    (from ``step()`` and ``taco.progress``); ``None`` stops sending."""
    if not interval > 0:
        raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
    _sending.sender = sender
    _sending.interval = interval
    _sending.last = 0.0


def sender() -> Sender | None:
    """The sender set by ``set_sender`` (None: nothing leaves this rank, as under plain ``mpiexec``)."""
    return _sending.sender


def set_progress(state: dict[str, Any] | None) -> None:
    """What ``taco.progress`` reports: ``{"n", "total", "desc", "elapsed_seconds"}`` (sent with metrics)."""
    _sending.progress = state


def progress_state() -> dict[str, Any] | None:
    """The progress dict last set by ``set_progress``, itself, not a copy: a running ``taco.progress`` loop
    updates its count in place (a dict update per iteration), and the next send reads it."""
    return _sending.progress


def maybe_send(now: float | None = None) -> None:
    """Send if a sender is set and the interval has passed: cheap enough to call every iteration."""
    if _sending.sender is None:
        return
    if (now or time.perf_counter()) - _sending.last >= _sending.interval:
        send()


def send() -> None:
    """Send now (no-op without a sender): the end of a loop or a cell must not wait for the interval."""
    sender = _sending.sender
    if sender is None:
        return
    _sending.last = time.perf_counter()
    progress = _sending.progress
    sender({"metrics": snapshot(), "progress": dict(progress) if progress is not None else None})
