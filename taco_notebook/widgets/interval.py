"""Rates between two batches of per-rank metric snapshots: :func:`interval_between` differences them rank by rank
(each rank over its own ``elapsed_seconds``, so clocks need not agree) into an :class:`Interval`. Step times come
from the steps themselves, not from here (:mod:`.steps`): an interval also holds time in which no step ran."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Interval", "Snapshot", "interval_between", "is_new_run", "int_keys", "NAN"]

Snapshot = Mapping[str, Any]
COUNTERS = ("elapsed_seconds", "samples", "steps", "raw_bytes", "wire_bytes", "wait_seconds", "comm_seconds")
NAN = float("nan")


@dataclass(frozen=True)
class Interval:
    """Rates between two snapshot batches, for the ranks that reported in both with time between them."""

    time: float  # elapsed seconds of the run at the interval's end (the latest rank's clock)
    node_of_rank: dict[int, int]
    samples_per_s: dict[int, float]
    steps_per_s: dict[int, float]
    tokens_per_s: dict[int, float]
    rank_bps: dict[tuple[int, int], float]  # (src rank, dst rank) -> bytes/s
    node_bps: dict[tuple[int, int], float]  # (src node, dst node) -> bytes/s; (n, n) is intra-node
    raw_bytes: int  # this interval, all ranks
    wire_bytes: int
    bytes_saved: int  # since the run started, all ranks

    @property
    def total_samples_per_s(self) -> float:
        """Samples/s of every reporting rank together."""
        return sum(self.samples_per_s.values())

    @property
    def compression_ratio(self) -> float:
        """Raw over wire bytes of this interval; NaN when nothing was communicated."""
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else NAN

    @property
    def total_steps_per_s(self) -> float:
        """Steps/s of the slowest reporting rank (in synchronous training all ranks step together)."""
        return min(self.steps_per_s.values(), default=NAN)

    @property
    def total_tokens_per_s(self) -> float:
        return sum(self.tokens_per_s.values())


def is_new_run(previous: Snapshot, current: Snapshot) -> bool:
    """True when a cumulative counter went backwards: ``metrics.reset()`` or a new run started in between."""
    return any(current.get(k, 0) < previous.get(k, 0) for k in COUNTERS)


def int_keys(mapping: Mapping[Any, int] | None) -> dict[int, int]:
    """Peer -> bytes with int keys (a JSON round trip turns them into strings)."""
    return {int(k): int(v) for k, v in (mapping or {}).items()}


def interval_between(previous: Mapping[int, Snapshot], current: Mapping[int, Snapshot]) -> Interval | None:
    """Rates from ``previous`` to ``current`` (both ``{rank: snapshot}``); None when no rank has an interval.

    A rank missing from either batch, or whose clock did not advance, is left out rather than reported as 0.
    """
    node_of_rank = {r: int(s["node"]) for r, s in current.items() if s.get("node") is not None}
    samples: dict[int, float] = {}
    steps: dict[int, float] = {}
    tokens: dict[int, float] = {}
    rank_bps: defaultdict[tuple[int, int], float] = defaultdict(float)
    node_bps: defaultdict[tuple[int, int], float] = defaultdict(float)
    raw = wire = 0
    for rank, cur in current.items():
        prev = previous.get(rank)
        dt = cur["elapsed_seconds"] - prev["elapsed_seconds"] if prev is not None else 0.0
        if prev is None or dt <= 0:
            continue
        samples[rank] = (cur.get("samples", 0) - prev.get("samples", 0)) / dt
        steps[rank] = (cur.get("steps", 0) - prev.get("steps", 0)) / dt
        tokens[rank] = (cur.get("tokens", 0) - prev.get("tokens", 0)) / dt
        before = int_keys(prev.get("sent_by_rank"))
        for peer, nbytes in int_keys(cur.get("sent_by_rank")).items():
            rank_bps[rank, peer] += (nbytes - before.get(peer, 0)) / dt
        before = int_keys(prev.get("sent_by_node"))
        for node, nbytes in int_keys(cur.get("sent_by_node")).items():
            node_bps[node_of_rank[rank], node] += (nbytes - before.get(node, 0)) / dt
        raw += cur.get("raw_bytes", 0) - prev.get("raw_bytes", 0)
        wire += cur.get("wire_bytes", 0) - prev.get("wire_bytes", 0)
    if not samples:
        return None
    return Interval(
        time=max(s["elapsed_seconds"] for s in current.values()),
        node_of_rank=node_of_rank,
        samples_per_s=samples,
        steps_per_s=steps,
        tokens_per_s=tokens,
        rank_bps=dict(rank_bps),
        node_bps=dict(node_bps),
        raw_bytes=raw,
        wire_bytes=wire,
        bytes_saved=sum(s.get("raw_bytes", 0) - s.get("wire_bytes", 0) for s in current.values()),
    )

