"""The replica check: are the parameters (and optimizer state) that taco trains still the same on every rank?

Ranks that drift apart train on silently: a rank-dependent seed before the model was built, a cell run with
``--targets`` that changed some ranks only, a non-deterministic op. So after a ``%%taco_run`` cell in which
parameters trained through taco were reduced, every rank takes a fingerprint of them, three numbers per tensor
(sum, sum of squares, a position-weighted strided sample of 16 elements), and one allgather of those numbers
tells who differs, in which tensors first, and by how much. ``taco.check_replicas(model)`` does the same by hand.
A tensor holding NaN or inf has no fingerprint to compare: the report names the ranks where it is not finite (the
training diverged there), and compares only the ranks where it is.

What is checked is registered where it is made: :class:`~.optimizer.DistributedOptimizer` (and so the Horovod
face), the DDP comm hook (the parameters of each bucket it is handed) and :class:`~.elastic.State` call
:func:`track`. References are weak: a model dropped by the notebook is no longer checked.

Cost: the sums reduce 64 Ki-element blocks in the tensor's own dtype on its own device and add the blocks in
float64, so no float64 copy of a parameter is made (benchmarks/replica_check.py times it); the collective moves
24 bytes per tensor per rank.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["FIELDS", "CAUSES", "ReplicaReport", "track", "track_state", "tracked_tensors", "compare",
           "fingerprint", "check_replicas", "begin_cell", "wanted", "after_cell"]

FIELDS = ("sum", "sum of squares", "strided sample")
_BLOCK = 1 << 16  # elements reduced in the tensor's dtype before float64 takes over
_SAMPLES = 16
_SHOWN = 5  # differing tensors named in the report
DIVERGED = ("the training diverged: a lower learning rate, gradient clipping, a loss that is bounded below, or a "
            "loss scale for fp16 usually helps")
CAUSES = ("usual causes: a rank-dependent seed or data before the model was built (taco.broadcast_parameters("
          "model) makes the start equal); a cell run with --targets that changed some ranks only; a non-"
          "deterministic op, or parameters changed outside the optimizer on some ranks. --no-check-replicas "
          "turns this check off")

_order = itertools.count()
_params: dict[int, tuple[weakref.ref[torch.Tensor], str | None, int]] = {}  # id -> (param, its name, order)
# id -> (optimizer, order): in registration order, the same on every rank (a WeakSet's order is its addresses')
_optimizers: dict[int, tuple[weakref.ref[Any], int]] = {}
_seq_at_cell: int | None = None


def track(named: Iterable[tuple[str | None, torch.Tensor]], optimizer: Any = None) -> None:
    """Check these parameters (``(name or None, tensor)``) after each cell, and ``optimizer``'s state. A name
    given once is kept; a parameter seen again keeps its place in the order."""
    for name, param in named:
        known = _params.get(id(param))
        if known is not None and known[0]() is param:
            if name is not None and known[1] is None:
                _params[id(param)] = (known[0], name, known[2])
            continue
        _params[id(param)] = (weakref.ref(param), name, next(_order))
    if optimizer is not None:
        inner = getattr(optimizer, "optimizer", optimizer)  # a DistributedOptimizer: the one it wraps
        seen = _optimizers.get(id(inner))
        if seen is None or seen[0]() is not inner:
            _optimizers[id(inner)] = (weakref.ref(inner), next(_order))


def track_state(model: Any, optimizer: Any) -> None:
    """:class:`~.elastic.State`'s registration: its model's parameters (when it has any) and its optimizer."""
    named = model.named_parameters() if hasattr(model, "named_parameters") else ()
    track(named, optimizer)


def tracked_tensors() -> list[tuple[str, torch.Tensor]]:
    """The live registered parameters, then their optimizers' state tensors, named, in registration order."""
    live = sorted(((order, name, ref()) for ref, name, order in list(_params.values())), key=lambda e: e[0])
    unnamed = itertools.count()  # the DDP hook's: a bucket knows its parameters, not their names
    params = [(name or f"unnamed parameter #{next(unnamed)} {tuple(p.shape)}", p) for _, name, p in live
              if p is not None]
    for key in [k for k, (ref, _, _) in _params.items() if ref() is None]:
        _params.pop(key, None)
    names = {id(p): name for name, p in params}
    return params + _optimizer_state(names)


def _optimizer_state(names: dict[int, str]) -> list[tuple[str, torch.Tensor]]:
    found: list[tuple[str, torch.Tensor]] = []
    for key in [k for k, (ref, _) in _optimizers.items() if ref() is None]:
        _optimizers.pop(key, None)
    for ref, _ in sorted(_optimizers.values(), key=lambda entry: entry[1]):
        optimizer = ref()
        if optimizer is None:
            continue
        for index, (param, values) in enumerate(optimizer.state.items()):
            owner = names.get(id(param), f"#{index}")
            found.extend((f"optimizer {owner}.{key}", value) for key, value in values.items()
                         if isinstance(value, torch.Tensor))
    return found


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Sum, sum of squares and a position-weighted strided sample of ``tensor``, in float64 (3 numbers)."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_floating_point():
        flat = flat.double()
    n = flat.numel()
    cut = n - n % _BLOCK
    blocks, tail = flat[:cut].view(-1, _BLOCK), flat[cut:].double()
    total = blocks.sum(1).double().sum() + tail.sum()
    squares = torch.linalg.vector_norm(blocks, dim=1).double().square().sum() + tail.dot(tail)
    sample = flat[:: max(1, n // _SAMPLES)][:_SAMPLES].double()
    sample = (sample * torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=flat.device)).sum()
    return torch.stack([total, squares, sample])


@dataclass
class ReplicaReport:
    """What the check found: ``tensors`` checked, the ``differing`` ranks, and per differing tensor a line."""

    tensors: int
    ranks: int
    differing: list[int] = field(default_factory=list)
    reference: list[int] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    count: int = 0  # tensors that differ
    nonfinite: list[int] = field(default_factory=list)  # ranks with NaN or inf in some tensor
    nonfinite_names: list[str] = field(default_factory=list)  # the first such tensors
    nonfinite_count: int = 0  # tensors not finite on some rank

    @property
    def ok(self) -> bool:
        return not self.differing and not self.nonfinite

    def text(self) -> str:
        if self.ok:
            return f"replicas agree: {self.tensors} tensors identical on {self.ranks} ranks"
        lines = []
        if self.nonfinite:
            where = f"all {self.ranks} ranks" if len(self.nonfinite) == self.ranks else _span(self.nonfinite)
            lines.append(f"non-finite values (NaN or inf) on {where} in {self.nonfinite_count} of {self.tensors} "
                         f"tensors, first: {', '.join(self.nonfinite_names)}; {DIVERGED}")
        if self.differing:
            lines.append(f"replicas differ: {_span(self.differing)} {'holds' if len(self.differing) == 1 else 'hold'}"
                         f" other values than {_span(self.reference)} in {self.count} of {self.tensors} tensors; "
                         "first:")
            lines.extend(f"  {line}" for line in self.details)
            lines.append(CAUSES)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "tensors": self.tensors, "ranks": self.ranks, "differing": self.differing,
                "reference": self.reference, "count": self.count, "nonfinite": self.nonfinite,
                "nonfinite_count": self.nonfinite_count, "text": self.text()}

    def __str__(self) -> str:
        return self.text()


def _blocks(gathered: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's rows, in rank order, from the allgather of each rank's fingerprints followed by a row that
    holds their count (ranks may track different numbers of tensors: that is a difference too)."""
    blocks: list[torch.Tensor] = []
    end = gathered.shape[0]
    while end > 0:
        count = int(gathered[end - 1, 0])
        blocks.insert(0, gathered[end - 1 - count:end - 1])
        end -= count + 1
    return blocks


def compare(names: list[str], blocks: list[torch.Tensor]) -> ReplicaReport:
    """The report for ``blocks`` (each rank's fingerprints, tensors × 3, ``names`` this rank's): each tensor's
    majority value (ties: rank 0's side) is the reference; a rank that differs from it in any number differs,
    and so does one that tracks another number of tensors. A rank whose fingerprint of a tensor is not finite is
    named as such and left out of that tensor's comparison."""
    ranks, tensors = len(blocks), len(names)
    report = ReplicaReport(tensors, ranks)
    counts: dict[int, list[int]] = {}
    for rank, block in enumerate(blocks):
        counts.setdefault(block.shape[0], []).append(rank)
    if len(counts) > 1:
        usual = max(counts, key=lambda c: (len(counts[c]), 0 in counts[c]))
        report.differing = sorted(r for c, rs in counts.items() if c != usual for r in rs)
        report.reference, report.count = counts[usual], abs(tensors - usual) or tensors
        report.details = [f"{_span(rs)} {'tracks' if len(rs) == 1 else 'track'} {c} tensors, "
                          f"{_span(counts[usual])} {usual}" for c, rs in counts.items() if c != usual]
        return report
    prints = torch.stack(blocks)
    differing: set[int] = set()
    nonfinite: set[int] = set()
    finite = torch.isfinite(prints).all(dim=2)  # ranks × tensors
    for i, name in enumerate(names):
        column = prints[:, i, :]
        groups: dict[tuple[float, ...], list[int]] = {}
        for rank in range(ranks):
            if finite[rank, i]:
                groups.setdefault(tuple(column[rank].tolist()), []).append(rank)
        if not bool(finite[:, i].all()):
            nonfinite.update(r for r in range(ranks) if not finite[r, i])
            report.nonfinite_count += 1
            if len(report.nonfinite_names) < _SHOWN:
                report.nonfinite_names.append(name)
        if len(groups) <= 1:
            continue
        reference = max(groups.values(), key=lambda g: (len(g), 0 in g))
        others = sorted(r for g in groups.values() if g is not reference for r in g)
        differing.update(others)
        report.count += 1
        if len(report.details) < _SHOWN:
            report.details.append(_detail(name, column, reference, others))
    report.differing = sorted(differing)
    report.reference = [r for r in range(ranks) if r not in differing and r not in nonfinite]
    report.nonfinite = sorted(nonfinite)
    return report


def _detail(name: str, column: torch.Tensor, reference: list[int], others: list[int]) -> str:
    norm = float(column[reference[0], 1].clamp(min=0).sqrt())
    parts = []
    for rank in others:
        theirs = float(column[rank, 1].clamp(min=0).sqrt())
        apart = abs(theirs - norm) / norm if norm else float("inf") if theirs else 0.0
        delta = float((column[rank, 0] - column[reference[0], 0]).abs())
        parts.append(f"norm {theirs:.6g} on rank {rank} ({apart:.2e} apart), sum off by {delta:.3g}")
    return f"{name}: norm {norm:.6g} on {_span(reference)}; " + "; ".join(parts)


def _span(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return "ranks " + ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def check_replicas(model: Any = None, optimizer: Any = None, *, show: bool = True) -> ReplicaReport:
    """Compare ``model``'s parameters (and ``optimizer``'s state) across ranks, or everything taco trains when
    both are None; collective: call it on every rank. Rank 0 prints the report when they differ (``show``).

    >>> taco.check_replicas(model).ok  # doctest: +SKIP
    True
    """
    from ..collectives.ops import allgather
    from ..group.bootstrap import device
    from ..state import state

    if model is None and optimizer is None:
        named = tracked_tensors()
    else:
        params = list(model.named_parameters()) if hasattr(model, "named_parameters") else []
        names = {id(p): name for name, p in params}
        named = params
        if optimizer is not None:
            inner = getattr(optimizer, "optimizer", optimizer)
            named = params + [(f"optimizer {names.get(id(p), f'#{i}')}.{key}", value)
                              for i, (p, values) in enumerate(inner.state.items())
                              for key, value in values.items() if isinstance(value, torch.Tensor)]
    here = device()  # the backend's device: NCCL takes no CPU tensor; nothing waits for the host before the gather
    rows = [fingerprint(t).to(here) for _, t in named]
    rows.append(torch.full((len(FIELDS),), float(len(named)), dtype=torch.float64, device=here))
    report = compare([name for name, _ in named], _blocks(allgather(torch.stack(rows)).cpu()))
    if show and not report.ok and state.ensure_topology().rank == 0:
        import sys

        print(f"[taco] {report.text()}", file=sys.stderr, flush=True)
    return report


def begin_cell() -> None:
    """Before a cell: note how many collectives the group has run, to tell whether the cell trained."""
    global _seq_at_cell
    from ..state import state

    _seq_at_cell = state.board.seq if state.board is not None else None


def wanted() -> bool:
    """Whether this rank has something to check after the cell: tracked parameters, and collectives run in the
    cell on a group that is not broken. No collective: the kernel asks every rank first and runs
    :func:`after_cell` only when all say yes (ranks that joined or were rebuilt since may say no)."""
    from ..state import state

    board = state.board
    if board is None or _seq_at_cell is None or board.seq == _seq_at_cell or state.stalled is not None:
        return False
    return any(ref() is not None for ref, _, _ in list(_params.values()))


def after_cell() -> dict[str, Any] | None:
    """After a cell in which every rank is :func:`wanted`: the check of everything tracked
    (:meth:`ReplicaReport.to_dict`), collective; None (no collective) on a rank with nothing to check."""
    return check_replicas(show=False).to_dict() if wanted() else None
