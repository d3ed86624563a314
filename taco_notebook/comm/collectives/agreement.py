"""Ranks agree on a collective before it runs: a mismatch is one clear error on every rank, not a crash or a hang.

Before a collective moves data, every rank of the group gathers a 64-bit hash of what it is about to do (its
:class:`Signature`: kind, name, shape, dtype, device, root, op) and one integer that the collective needs anyway
(allgather's row count): 16 bytes a rank, through shared memory where it can (:mod:`.exchange`), else one
allgather. Equal hashes, the steady state: the collective runs; the hash of a signature is computed once per
distinct signature (cached), so the cost is that one small exchange on the communication thread
(benchmarks/agreement.py measures it). Different hashes: every rank gathers the full
signatures (pickled, the slow path, only on error) and raises the same :class:`CollectiveMismatchError`, naming
the ranks on each side; no data moved, so the group stays usable and the next collective works.

Why not gloo's own checks: gloo aborts the process on a size mismatch (SIGABRT), lets a dtype mismatch through,
and a different broadcast root waits for the stall watchdog. Horovod's coordinator does the same check by
negotiation; here the collective order is the communication thread's, so one exchange per collective suffices.

A rank that is inside ``join()`` takes part with the signature :data:`JOINED`: an allreduce the others run is then
fed zeros by it (see :func:`run_joined`), any other collective raises on the ranks that called it.
Imports no IPython; torch is imported when first needed.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import TacoError

__all__ = [
    "CollectiveMismatchError",
    "Signature",
    "JOINED",
    "agree",
    "enabled",
    "set_enabled",
    "invalid",
    "describe_tensor",
    "run_joined",
]


class CollectiveMismatchError(TacoError):
    """Ranks called different collectives, or the same one with different shapes, dtypes, roots or ops.

    Raised on every rank of the group with the same message; nothing was sent, the group stays usable.
    """


@dataclass(frozen=True)
class Signature:
    """What one rank is about to do; ranks must hold equal signatures (``extra`` may differ, see :func:`agree`).

    ``shape``: the whole shape, or for allgather/alltoall the dimensions after the first (those may differ).
    ``compression``/``algorithm``: an allreduce's (a rank inside ``join()`` runs the same one, with zeros);
    ``detail``: whatever else must match; ``None`` where nothing does.
    """

    kind: str
    name: str | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    device: str | None = None
    root: int | None = None
    op: str | None = None
    compression: str | None = None
    algorithm: str | None = None
    detail: str | None = None

    def describe(self) -> str:
        parts = [self.kind if self.name is None else f"{self.kind} {self.name!r}"]
        if self.shape is not None:
            parts.append(
                f"shape {list(self.shape)}"
                if self.kind not in ("allgather", "alltoall")
                else f"shape [*, {', '.join(map(str, self.shape))}]"
                if self.shape
                else "shape [*]"
            )
        parts += [str(v) for v in (self.dtype, self.device) if v is not None]
        if self.root is not None:
            parts.append(f"root {self.root}")
        if self.op is not None:
            parts.append(f"op {self.op}")
        if self.compression is not None:
            parts.append(f"compression {self.compression}")
        if self.algorithm is not None:
            parts.append(f"algorithm {self.algorithm}")
        if self.detail is not None:
            parts.append(self.detail)
        return ", ".join(parts)


JOINED = Signature("join")

_hashes: dict[Signature, int] = {}
_switch = threading.Event()
_switch.set()


def enabled() -> bool:
    """Whether collectives check agreement first (on by default)."""
    return _switch.is_set()


def set_enabled(on: bool) -> None:
    """Turn the check off (``False``) to save its one small exchange per collective, or back on.

    Every rank must make the same choice at the same point: with the check on one rank and off on another,
    the check's exchange meets the other rank's data collective.
    """
    if on:
        _switch.set()
    else:
        _switch.clear()


def _hash(sig: Signature) -> int:
    found = _hashes.get(sig)
    if found is None:
        digest = hashlib.blake2b(repr(sig).encode(), digest_size=8).digest()
        found = _hashes[sig] = int.from_bytes(digest, "little", signed=True)
        if len(_hashes) > 100_000:  # many distinct names: keep memory bounded
            _hashes.clear()
    return found


def describe_tensor(
    kind: str,
    tensor: Any,
    name: Any = None,
    *,
    root: int | None = None,
    op: str | None = None,
    rows_may_differ: bool = False,
    compression: str | None = None,
    algorithm: str | None = None,
) -> Signature:
    """The :class:`Signature` of ``kind`` on ``tensor`` (its shape, or the dims after the first)."""
    shape = tuple(tensor.shape[1:]) if rows_may_differ and tensor.dim() else tuple(tensor.shape)
    return Signature(
        kind,
        None if name is None else str(name),
        shape,
        str(tensor.dtype).replace("torch.", ""),
        tensor.device.type,
        root,
        op,
        compression,
        algorithm,
    )


def invalid(kind: str, error: BaseException) -> Signature:
    """The signature of a call that failed its own checks on this rank (it raises that error locally)."""
    return Signature(kind, detail=f"invalid on this rank: {type(error).__name__}: {error}")


def _ranks(group: Any) -> list[int]:
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))


def _group(group: Any) -> Any:
    """``group``, or for every rank taco's own world group (:func:`.algorithms.world_group`), never torch's
    default one: the stall watchdog's teardown (``bootstrap.abort``) releases waiters on taco's groups, so a
    rank waiting in the check for a peer that never comes is freed with the rest, not left blocked behind a
    new generation's communication thread."""
    if group is not None:
        return group
    from .algorithms import world_group

    return world_group()


def _exchange(sig: Signature, extra: int, group: Any) -> tuple[list[int], list[int]]:
    """Every rank's (hash, extra), in group order: one allgather of 16 bytes (CPU, so it never syncs a GPU);
    among all ranks, through shared memory and one cross-node step instead where it can (:mod:`.exchange`)."""
    import torch
    import torch.distributed as dist

    from ..transport.reduction import all_gather
    from .exchange import exchange

    if group is None:
        said = exchange((_hash(sig), extra))
        if said is not None:
            return said
    group = _group(group)

    mine = torch.tensor([_hash(sig), extra], dtype=torch.int64)
    every = torch.empty(2 * dist.get_world_size(group), dtype=torch.int64)
    all_gather(every, mine, group=group)
    values = every.tolist()
    return values[0::2], values[1::2]


def _proposals(sig: Signature, group: Any, mine: Any = None) -> list[Any]:
    """Every rank's :class:`.byname.Proposal` (its signature, whether it may park, what it parked), in group
    order: the slow path, only when the hashes differ."""
    import torch.distributed as dist

    from ..state import state
    from .byname import Proposal

    if mine is None:
        thread = state.comm_thread
        mine = Proposal(sig, thread.may_park(), thread.parked(group))
    group = _group(group)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, pickle.dumps(mine), group=group)
    return [pickle.loads(raw) for raw in every]  # noqa: S301 - the job's own ranks sent it


def _message(sigs: Sequence[Signature], ranks: Sequence[int]) -> str:
    sides: dict[Signature, list[int]] = {}
    for rank, sig in zip(ranks, sigs, strict=True):
        sides.setdefault(sig, []).append(rank)
    lines = []
    for sig, who in sorted(sides.items(), key=lambda item: (-len(item[1]), item[1])):
        label = f"rank {who[0]}" if len(who) == 1 else f"ranks {', '.join(map(str, who))}"
        lines.append(f"  {label}: {'join() (finished)' if sig == JOINED else sig.describe()}")
    return (
        "ranks disagree on the collective they are running, so none of them ran it (the group is still usable):\n"
        + "\n".join(lines)
        + "\nEvery rank must call the same collectives in the same order, with the same shape (allgather and "
        "alltoall: the same dimensions after the first), dtype, device, root and op."
    )


def _refused(sig: Signature) -> bool:
    return sig.detail is not None and sig.detail.startswith("invalid on this rank")


def agree(sig: Signature, extra: int = 0, group: Any = None) -> list[int]:
    """Check that every rank of ``group`` (default: all) holds ``sig``; returns every rank's ``extra``.

    Run on the communication thread, right before the collective. Raises :class:`CollectiveMismatchError` on
    every rank when they differ. Ranks inside ``join()`` are accepted for an allreduce (they feed zeros).
    Operations matched by name (Horovod's named ``*_async``) are parked or run out of order instead, where
    that reconciles the ranks (:mod:`.byname`): this raises :class:`.state.Deferred` to park the running one.
    """
    from ..state import Deferred, state
    from .byname import decide

    while True:
        hashes, extras = _exchange(sig, extra, group)
        if all(h == hashes[0] for h in hashes):
            return extras
        proposals = _proposals(sig, group)
        sigs = [p.sig for p in proposals]
        if JOINED in sigs or any(_refused(s) for s in sigs):
            active = [s for s in sigs if s != JOINED]
            if sig != JOINED and active and all(s == active[0] for s in active) and active[0].kind == "allreduce":
                return extras  # ranks that joined feed zeros (run_joined)
            raise CollectiveMismatchError(_message(sigs, _ranks(group)))
        decision = decide(proposals)
        if decision is None:
            raise CollectiveMismatchError(_message(sigs, _ranks(group)))
        what, detail = decision
        if what == "run" and detail != sig:
            state.comm_thread.run_parked(detail, group)  # the others run it now; then this rank's own again
        elif what == "park" and _index(group) in detail:
            raise Deferred(sig, group)
        # otherwise: agree again on this one (the others run or park theirs first)


def _index(group: Any) -> int:
    """This rank's index in ``group`` (None: the world)."""
    import torch.distributed as dist

    return dist.get_rank(group) if group is not None else dist.get_rank()


def run_joined(rejoin: Callable[[Signature], None], group: Any = None) -> list[int]:
    """A rank inside ``join()``: take part in the others' allreduces with zeros (``rejoin(sig)`` runs one) until
    every rank joined; returns every rank's ``extra`` of the final round. Runs on the communication thread."""
    import time

    arrived = int(time.time() * 1e6)
    while True:
        hashes, extras = _exchange(JOINED, arrived, group)
        if all(h == hashes[0] for h in hashes):
            return extras
        sigs = [p.sig for p in _proposals(JOINED, group, _joined())]
        active = [s for s in sigs if s != JOINED]
        if all(s == active[0] for s in active) and active[0].kind == "allreduce":
            rejoin(active[0])
        # anything else: the other ranks raise CollectiveMismatchError and go on; this rank waits for their next


def _joined() -> Any:
    from .byname import Proposal

    return Proposal(JOINED)
