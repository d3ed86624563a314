"""``%taco_cluster undo``, the rank's side: before each ``%%taco_run`` cell, one copy in host memory of what taco
trains on this rank, which :meth:`Undo.restore` puts back bit for bit.

What is copied is what the replica check knows (:mod:`.tracked`): the parameters that ``taco.DistributedOptimizer``,
the DDP comm hook and ``taco.elastic.State`` register, every registered optimizer's ``state_dict()``, and each
live State's counters and last commit. Before a cell after one that changed none of it, the copy is kept
(:func:`.tracked.signature`). A copy larger than :data:`MEMORY_FRACTION` of the node's available memory per rank
on the node is not taken (said once per size); ``TACO_UNDO=0`` turns undo off. docs/undo.md says what is not copied.
"""

from __future__ import annotations

import copy
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .tracked import Tracked, samples, signature, tracked

if TYPE_CHECKING:  # the notebook imports this module to name its functions: torch only where they run
    import torch

__all__ = ["MEMORY_FRACTION", "OFF_ENV", "NothingToUndo", "Snapshot", "Undo", "memory_limit", "rank_undo",
           "before_cell", "undo_check", "undo_restore"]

MEMORY_FRACTION = 0.25  # of the node's MemAvailable per rank on it: one copy leaves room for the cells' own memory
OFF_ENV = "TACO_UNDO"  # "0" (off, false, no): no snapshot
NOTHING_TRACKED = ("taco trains nothing on this rank: undo restores what a taco.DistributedOptimizer, the DDP comm "
                   "hook or a taco.elastic.State registers")
REGISTERED_SINCE = ("no cell has run since the model was registered: at the start of the last cell taco trained "
                    "nothing here, so there is no earlier state to go back to")
REPLACED = ("the last cell replaced the objects: the parameters and optimizers copied before it are gone (built "
            "again, or their names bound to new ones), and what replaced them did not exist before it")


class NothingToUndo(RuntimeError):
    """:meth:`Undo.restore` has no snapshot to restore; the message says why."""


@dataclass
class Snapshot:
    """The copy: each parameter's and optimizer's (weakly held, with its host copy) and each State's last commit,
    commit count and counters; ``nbytes`` of tensors."""

    params: list[tuple[weakref.ref[Any], torch.Tensor]] = field(default_factory=list)
    optimizers: list[tuple[weakref.ref[Any], dict[str, Any]]] = field(default_factory=list)
    states: list[tuple[weakref.ref[Any], Any, int, dict[str, Any]]] = field(default_factory=list)
    nbytes: int = 0

    def refs(self) -> list[weakref.ref[Any]]:
        return [p[0] for p in self.params] + [o[0] for o in self.optimizers] + [s[0] for s in self.states]


def _host_copy(value: Any, previous: Any = None) -> Any:
    """``value`` with every tensor copied to host memory bit for bit, into ``previous``'s tensor where it fits."""
    import torch

    if isinstance(value, torch.Tensor):
        if (isinstance(previous, torch.Tensor) and previous.shape == value.shape and previous.dtype == value.dtype
                and value.layout == torch.strided):
            return previous.copy_(value.detach())
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        old = previous if isinstance(previous, dict) else {}
        return {key: _host_copy(item, old.get(key)) for key, item in value.items()}
    if type(value) in (list, tuple):
        olds = previous if type(previous) is type(value) and len(previous) == len(value) else [None] * len(value)
        return type(value)(_host_copy(item, old) for item, old in zip(value, olds, strict=True))
    return copy.deepcopy(value)


def _copy(now: Tracked, previous: Snapshot | None) -> Snapshot:
    """A new snapshot of ``now``, into the buffers of ``previous`` where the same object kept its shapes."""
    old_params = {id(p): saved for ref, saved in previous.params if (p := ref()) is not None} if previous else {}
    old_optimizers = ({id(o): saved for ref, saved in previous.optimizers if (o := ref()) is not None}
                      if previous else {})
    return Snapshot([(weakref.ref(p), _host_copy(p, old_params.get(id(p)))) for p in now.params],
                    [(weakref.ref(o), _host_copy(o.state_dict(), old_optimizers.get(id(o)))) for o in now.optimizers],
                    [(weakref.ref(s), s._saved, s.commits, copy.deepcopy(s.counters)) for s in now.states],
                    now.nbytes())


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _local() -> tuple[int, int]:
    """This rank's local rank and the ranks on its node (1 before the topology is known: no collective here)."""
    from ..comm.state import state

    topology = state.topology
    return (topology.local_rank, topology.local_size) if topology is not None else (0, 1)


def memory_limit(held: int = 0) -> tuple[float, str]:
    """The most one copy may take on this rank, and how that was reckoned: :data:`MEMORY_FRACTION` of the node's
    MemAvailable (plus the copies the ranks hold, ``held`` each) per rank on the node; no limit without
    /proc/meminfo."""
    try:
        with open("/proc/meminfo") as meminfo:
            kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return float("inf"), "no limit (this system has no /proc/meminfo)"
    ranks = _local()[1]
    available = kib * 1024
    limit = MEMORY_FRACTION * (available / ranks + held)
    return limit, (f"{_size(limit)}, {MEMORY_FRACTION:g} of the {_size(available)} this node has available shared "
                   f"by {ranks} rank{'s' if ranks != 1 else ''} (taco_notebook.engine.undo.MEMORY_FRACTION)")


class Undo:
    """This rank's one snapshot, or why it has none; ``copies`` counts the cells before which a copy was made,
    ``kept`` those before which nothing had changed, so the copy was kept. ``source`` gives what is tracked."""

    def __init__(self, source: Callable[[], Tracked] = tracked) -> None:
        self.source = source
        self.snapshot: Snapshot | None = None
        self.why_none = "no %%taco_run cell has run on this rank since its engine started"
        self.signature: tuple[Any, ...] | None = None
        self.samples: torch.Tensor | None = None
        self.copies = 0
        self.kept = 0
        self.noticed: set[int] = set()  # sizes whose "off" notice was shown

    def drop(self, why: str) -> None:
        self.snapshot, self.signature, self.samples, self.why_none = None, None, None, why

    def take(self) -> None:
        """Before a cell: copy what is tracked, unless nothing changed since the last copy, it is off, or too big."""
        value = os.environ.get(OFF_ENV, "").strip().lower()
        now = None if value in ("0", "off", "false", "no") else self.source()
        if now is None:
            self.drop(f"undo is off on this rank: {OFF_ENV}={value}")
        elif not now:
            self.drop(NOTHING_TRACKED)
            self.snapshot = Snapshot()  # empty: check() tells "registered since" from "nothing tracked"
        else:
            self._copy_if_changed(now)

    def _copy_if_changed(self, now: Tracked) -> None:
        marks, sampled = signature(now), samples(now.tensors())
        if self._unchanged(marks, sampled):
            self.kept += 1
            return
        need = now.nbytes()
        limit, reckoned = memory_limit(self.snapshot.nbytes if self.snapshot is not None else 0)
        if need > limit:
            detail = f"one copy of the {_size(need)} taco trains here would not fit comfortably in {reckoned}"
            self.drop(f"undo was off for the last cell: {detail}")
            if need not in self.noticed and _local()[0] == 0:  # once per size, once per node
                self.noticed.add(need)
                print(f"[taco] undo is off for this cell: {detail}; {OFF_ENV}=0 turns it off", file=sys.stderr,
                      flush=True)
            return
        previous, live = self.snapshot, {id(item) for item in (*now.params, *now.optimizers)}
        if previous is not None and not any(id(ref()) in live for ref in previous.refs()):
            previous = None  # nothing to copy into: freed first, so two copies are never held at once
        self.drop("the copy before the last cell was interrupted")
        self.snapshot = _copy(now, previous)
        self.signature, self.samples = marks, sampled
        self.copies += 1

    def _unchanged(self, marks: tuple[Any, ...], sampled: torch.Tensor) -> bool:
        import torch

        if self.snapshot is None or self.samples is None or any(ref() is None for ref in self.snapshot.refs()):
            return False
        try:
            return bool(marks == self.signature) and torch.equal(sampled, self.samples)
        except (RuntimeError, TypeError, ValueError):  # a value without a plain ==: take it as changed
            return False

    def check(self) -> str | None:
        """Why :meth:`restore` cannot run now, or None when it can."""
        snapshot = self.snapshot
        if snapshot is None:
            return self.why_none
        if not snapshot.refs():
            return REGISTERED_SINCE if self.source() else NOTHING_TRACKED
        if all(ref() is None for ref in snapshot.refs()):
            return REPLACED
        reshaped = sum(1 for ref, saved in snapshot.params if (p := ref()) is not None and p.shape != saved.shape)
        if reshaped:
            return f"the last cell gave {reshaped} parameter(s) another shape: their copies no longer fit"
        return None

    def restore(self) -> dict[str, int]:
        """Put the snapshot back, in place, on the tensors' own devices; what was restored (counts, bytes), the
        objects dropped since (not restored), those registered since (left as they are), and whether the state
        was the copy's already (``unchanged``: the last cell changed none of it)."""
        why = self.check()
        if why is not None or self.snapshot is None:
            raise NothingToUndo(why)
        now = self.source()
        unchanged = self._unchanged(signature(now), samples(now.tensors()))
        done = _put_back(self.snapshot)
        known = {id(ref()) for ref in self.snapshot.refs()}
        done["new"] = sum(1 for item in (*now.params, *now.optimizers, *now.states) if id(item) not in known)
        if not done["dropped"] and not done["new"]:  # the state is the copy's: the next cell need not copy again
            self.signature, self.samples = signature(now), samples(now.tensors())
        return {**done, "bytes": self.snapshot.nbytes, "unchanged": int(unchanged)}


def _put_back(snapshot: Snapshot) -> dict[str, int]:
    """Copy ``snapshot`` into the live objects it was taken of; how many of each, and how many are gone."""
    import torch

    done = {"tensors": 0, "optimizers": 0, "states": 0, "dropped": 0}
    with torch.no_grad():
        for ref, saved in snapshot.params:
            if (param := ref()) is not None:
                param.copy_(saved)
                done["tensors"] += 1
    for ref, state_dict in snapshot.optimizers:
        if (optimizer := ref()) is not None:
            optimizer.load_state_dict(_host_copy(state_dict))  # a copy: load_state_dict keeps what it is given
            done["optimizers"] += 1
    for ref, commit, commits, counters in snapshot.states:
        if (state := ref()) is not None:
            state._saved, state.commits = commit, commits
            for name, value in copy.deepcopy(counters).items():
                setattr(state, name, value)
            done["states"] += 1
    done["dropped"] = sum(1 for ref in snapshot.refs() if ref() is None)
    return done


rank_undo = Undo()  # this process's: what the runner's before_cell takes and the notebook's undo restores


def before_cell() -> None:
    """First thing before each cell (:mod:`.runner`): :meth:`Undo.take`. It never fails the cell: a failure leaves
    no snapshot, and undo then says why."""
    try:
        rank_undo.take()
    except Exception as exc:  # noqa: BLE001 - any failure: the cell runs, undo names it
        rank_undo.drop(f"the copy before the last cell failed: {type(exc).__name__}: {exc}")


def undo_check() -> str | None:
    """For the notebook (``view.apply``): why this rank cannot undo, or None."""
    return rank_undo.check()


def undo_restore() -> dict[str, int]:
    """For the notebook (``view.apply``): restore this rank (:meth:`Undo.restore`)."""
    return rank_undo.restore()
