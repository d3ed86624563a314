"""The link heatmaps' numbers: bytes/s per rank pair and per node pair, since the cell started and over each rank's
last interval, from the ranks' latest snapshots (the summary's link rates are the same numbers); the heatmaps that
show them are :mod:`.heatmaps`'."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

__all__ = ["link_rates", "link_rates_between"]

Snapshot = Mapping[str, Any]


def _int_keys(mapping: Mapping[Any, int] | None) -> dict[int, int]:
    """Peer -> bytes with int keys (a JSON round trip turns them into strings)."""
    return {int(k): int(v) for k, v in (mapping or {}).items()}


def link_rates(latest: Mapping[int, Snapshot]) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """Bytes/s since the cell started, ``(by rank pair, by node pair)``: the heatmaps' colours and the summary's
    link rates alike. A rank's bytes count over its own elapsed seconds; a node pair's bytes (all its ranks')
    over its longest-running rank's."""
    by_rank: dict[tuple[int, int], float] = {}
    node_bytes: defaultdict[tuple[int, int], int] = defaultdict(int)
    node_seconds: defaultdict[tuple[int, int], float] = defaultdict(float)
    for rank, snap in latest.items():
        seconds = float(snap["elapsed_seconds"])
        if seconds <= 0:
            continue
        for peer, nbytes in _int_keys(snap.get("sent_by_rank")).items():
            by_rank[rank, peer] = nbytes / seconds
        if snap.get("node") is None:
            continue
        for node, nbytes in _int_keys(snap.get("sent_by_node")).items():
            key = (int(snap["node"]), node)
            node_bytes[key] += nbytes
            node_seconds[key] = max(node_seconds[key], seconds)
    return by_rank, {key: node_bytes[key] / node_seconds[key] for key in node_bytes}


def link_rates_between(
    previous: Mapping[int, Snapshot],
    latest: Mapping[int, Snapshot],
) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """Bytes/s of each rank's last interval (between its two latest snapshots), by rank pair and by node pair."""
    by_rank: dict[tuple[int, int], float] = {}
    by_node: defaultdict[tuple[int, int], float] = defaultdict(float)
    for rank, snap in latest.items():
        before = previous.get(rank)
        if before is None or snap["elapsed_seconds"] <= before["elapsed_seconds"]:
            continue
        seconds = snap["elapsed_seconds"] - before["elapsed_seconds"]
        sent = _int_keys(before.get("sent_by_rank"))
        for peer, nbytes in _int_keys(snap.get("sent_by_rank")).items():
            by_rank[rank, peer] = (nbytes - sent.get(peer, 0)) / seconds
        sent = _int_keys(before.get("sent_by_node"))
        if snap.get("node") is not None:
            for node, nbytes in _int_keys(snap.get("sent_by_node")).items():
                by_node[int(snap["node"]), node] += (nbytes - sent.get(node, 0)) / seconds
    return by_rank, dict(by_node)

