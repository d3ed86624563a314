"""Synthetic metric snapshots of a Horovod-style run on any number of ranks, as ``metrics.snapshot()`` writes them.

Epochs of steps, then an evaluation with no step; every rank steps together (synchronous training). Per rank
per step: compute alone, communication that overlapped it, and the wait; one rank (``straggler``) computes
longest and so waits least. Ranks talk in a ring within their node and to the same local rank on the next node
(compressed 2:1 across nodes); with ``uneven`` higher ranks get smaller batches. Snapshots come every ``send_s``
and carry what a rank would send: cumulative counters, the latest ``SERIES_SENT`` series records (one per
``RECORD_S``) and its ``recent_steps``.

Example::

    run = SyntheticRun(ranks=16, ranks_per_node=8)
    for batch in run.batches():          # [{rank: snapshot}, ...] every 0.25 s of the run
        stream.push(batch.values())
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from taco_notebook.comm.diagnostics.metrics import SERIES_FIELDS, SERIES_SENT, STEPS_SENT

__all__ = ["SyntheticRun"]


@dataclass
class SyntheticRun:
    ranks: int = 16
    ranks_per_node: int = 8
    steps_per_s: float = 11.5
    epochs: int = 2
    steps_per_epoch: int = 40
    eval_s: float = 1.5  # after each epoch: no step, no optimizer traffic
    setup_s: float = 0.5  # before the first step: model building
    samples_per_step: int = 32
    uneven: float = 0.0  # the last rank's batch is this much smaller than rank 0's, the others in between
    bytes_per_step: int = 400_000  # each rank to each of its peers, before compression
    overlapped_s: float = 0.01  # per step, every rank
    straggler: int = 3
    send_s: float = 0.25
    step_ends: list[float] = field(init=False)

    def __post_init__(self) -> None:
        step = 1.0 / self.steps_per_s
        t, ends = self.setup_s, []
        for _ in range(self.epochs):
            for _ in range(self.steps_per_epoch):
                t += step
                ends.append(round(t, 6))
            t += self.eval_s
        self.step_ends = ends

    @property
    def end_s(self) -> float:
        """The run's end: the last evaluation over."""
        return self.step_ends[-1] + self.eval_s

    @property
    def node_of_rank(self) -> dict[int, int]:
        return {r: r // self.ranks_per_node for r in range(self.ranks)}

    def compute_s(self, rank: int) -> float:
        """Compute alone per step: the straggler's is the longest; the others a little apart, in rank order."""
        step = 1.0 / self.steps_per_s
        return 0.8 * step if rank == self.straggler else 0.55 * step + 0.005 * (rank % 5) / self.steps_per_s

    def peers(self, rank: int) -> dict[int, int]:
        """Bytes per step to each peer (wire bytes): the next rank of its node, the same local rank next node."""
        node, local = divmod(rank, self.ranks_per_node)
        nodes = -(-self.ranks // self.ranks_per_node)
        out: dict[int, int] = {}
        same_node = [r for r in range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node) if r < self.ranks]
        if len(same_node) > 1:
            out[same_node[(same_node.index(rank) + 1) % len(same_node)]] = self.bytes_per_step
        if nodes > 1:
            other = ((node + 1) % nodes) * self.ranks_per_node + local
            if other < self.ranks and other != rank:
                out[other] = out.get(other, 0) + self.bytes_per_step // 2  # fp16 across nodes
        return out

    def samples_of(self, rank: int) -> int:
        """Samples per step of ``rank``."""
        return round(self.samples_per_step * (1 - self.uneven * rank / max(self.ranks - 1, 1)))

    def raw_per_step(self, rank: int) -> int:
        return sum(self.bytes_per_step for _ in self.peers(rank))

    def steps_at(self, t: float) -> int:
        return bisect.bisect_right(self.step_ends, t + 1e-9)

    def step_seconds(self, k: int) -> float:
        """The wall seconds of step ``k`` (0-based) from the previous step's end (the first from the setup's)."""
        return self.step_ends[k] - (self.step_ends[k - 1] if k else 0.0)

    def record(self, rank: int, t: float) -> list[float]:
        steps = self.steps_at(t)
        wire = sum(self.peers(rank).values()) * steps
        return [round(t, 4), steps, 0, steps * self.samples_of(rank), 0, self.raw_per_step(rank) * steps, wire]

    def snapshot(self, rank: int, elapsed: float) -> dict[str, Any]:
        """What rank ``rank`` sends after ``elapsed`` seconds."""
        steps = self.steps_at(elapsed)
        compute = self.compute_s(rank)
        recent = []
        for k in range(1, steps):  # the first step (after the setup, no loop's mark) is not timed
            seconds = self.step_seconds(k)
            wait = max(seconds - compute - self.overlapped_s, 0.0)
            recent.append([round(seconds, 6), round(self.overlapped_s + wait, 6), round(wait, 6)])
        comm_s, wait_s = sum(r[1] for r in recent), sum(r[2] for r in recent)  # cumulative
        recent = recent[-STEPS_SENT:]
        sent = {peer: nbytes * steps for peer, nbytes in self.peers(rank).items()}
        by_node: defaultdict[int, int] = defaultdict(int)
        for peer, nbytes in sent.items():
            by_node[self.node_of_rank[peer]] += nbytes
        times = [0.0, *self.step_ends[:steps]]  # the origin, then each step's end (steps are >= RECORD_S apart)
        first = max(len(times) - SERIES_SENT, 0)
        records = [self.record(rank, t) for t in times[first:]]
        raw = self.raw_per_step(rank) * steps
        wire = sum(sent.values())
        return {
            "rank": rank,
            "node": self.node_of_rank[rank],
            "steps": steps,
            "iterations": 0,
            "elapsed_seconds": elapsed,
            "collectives": steps,
            "comm_seconds": comm_s,
            "wait_seconds": wait_s,
            "samples": steps * self.samples_of(rank),
            "raw_bytes": raw,
            "wire_bytes": wire,
            "bytes_saved": raw - wire,
            "sent_by_rank": sent,
            "sent_by_node": dict(by_node),
            "tokens": 0,
            "last_step": {},
            "recent_steps": recent,
            "gpu": None,
            "series": {"fields": list(SERIES_FIELDS), "first": first, "records": records},
        }

    def batch(self, elapsed: float) -> dict[int, dict[str, Any]]:
        return {rank: self.snapshot(rank, elapsed) for rank in range(self.ranks)}

    def times(self) -> list[float]:
        """The send times: every ``send_s`` from the first step to the run's end, and the end itself."""
        first = self.step_ends[0]
        out, t = [], first
        while t < self.end_s - 1e-9:
            out.append(round(t, 6))
            t += self.send_s
        return [*out, round(self.end_s, 6)]

    def batches(self) -> list[dict[int, dict[str, Any]]]:
        return [self.batch(t) for t in self.times()]
