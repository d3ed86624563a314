"""Cheap per-rank counters of where communication time and bytes go, as plain data.

Every collective adds its wall time, its raw and wire bytes, and the bytes this rank sent to each peer (from
the algorithm's schedule: ring neighbour, node peers, cross-node peer). ``step(samples=…)`` closes a training
step; ``DistributedOptimizer`` calls it for you. ``snapshot()`` returns a dict the dashboard (and anyone)
can read: totals since ``reset()``, the last step, and per-link bytes by rank and by node.

Recording is a few dict updates per collective (never per element), so it stays on in the hot path.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

__all__ = ["record", "add_wait", "step", "snapshot", "reset"]


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
        self.started = self.step_started = time.perf_counter()


_metrics = _Metrics()


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
        _metrics.total.add(current)
        _metrics.current = _Counters()
        _metrics.steps += 1
        _metrics.step_started = now


def snapshot() -> dict[str, Any]:
    """Everything recorded since ``reset()``, as plain data (JSON-serialisable but for int dict keys)."""
    from .bootstrap import state

    with _metrics.lock:
        total = _Counters()
        total.add(_metrics.total)
        total.add(_metrics.current)
        elapsed = time.perf_counter() - _metrics.started
        last = dict(_metrics.last)
        steps = _metrics.steps
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
        "last_step": last,
    }


def reset() -> None:
    """Start counting afresh (for example at the start of a benchmark)."""
    with _metrics.lock:
        _metrics.reset()
