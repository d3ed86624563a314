"""Operations matched by name, as Horovod's coordinator matches them: what the ranks do when they disagree.

Horovod pairs the ranks' operations by name, so a named ``hvd.allreduce_async(t, name="x")`` started on rank 0
before a ``hvd.barrier()`` that the others reach first simply waits for them. taco runs every collective in one
order (torch.distributed pairs them by order), and the ranks agree on each before it moves data
(:mod:`.agreement`). When they do not agree, the slow path of that agreement gathers every rank's
:class:`Proposal` (what it is about to run, whether that may wait, and what it parked earlier) and every rank
takes the same :func:`decide` on them:

* **run** a signature that some rank is about to run and every other rank either is about to run too or
  parked earlier: the ranks that parked it run it now, the others run it as their next collective;
* **park** the operations matched by name (Horovod's named ``*_async``, submitted inside
  :meth:`.state.CommThread.by_name`) of the ranks that disagree: each such rank sets its operation aside and
  proposes its next one;
* otherwise the ranks really disagree: the same :class:`~.agreement.CollectiveMismatchError` on every rank.
  Two operations with one kind and name but different shapes, dtypes or roots are such a mismatch, wherever
  they are (running or parked).

Only the disagreeing slow path pays for this; the steady state is the agreement's one small exchange. A parked
operation runs when the others reach it while this rank runs another collective of the same group, or, once
someone waits for it (``hvd.synchronize``), as the rank's next collective in order. A rank with an operation
parked and nothing else to run does not answer the others (there is no background negotiation loop, as
Horovod's): ``synchronize`` the handle, or run any other collective of that group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Proposal", "decide"]


@dataclass(frozen=True)
class Proposal:
    """What one rank brings to a disagreeing agreement round (pickled to every rank of the group)."""

    sig: Any  # agreement.Signature: what it is about to run
    may_park: bool = False  # a named Horovod *_async nobody waits for yet
    parked: tuple[Any, ...] = ()  # the signatures it parked over this group, oldest first


def _named_conflict(proposals: Sequence[Proposal]) -> bool:
    """Two different signatures with one kind and name, anywhere: a real mismatch, never a matter of order."""
    seen: dict[tuple[str, str], Any] = {}
    for proposal in proposals:
        for sig in (proposal.sig, *proposal.parked):
            if sig.name is None:
                continue
            if seen.setdefault((sig.kind, sig.name), sig) != sig:
                return True
    return False


def decide(proposals: Sequence[Proposal]) -> tuple[str, Any] | None:
    """The same decision on every rank (their proposals, in group order): ``("run", sig)``, ``("park", [indices
    of the ranks that park])``, or None (a mismatch: raise)."""
    if _named_conflict(proposals):
        return None
    for proposal in proposals:
        sig = proposal.sig
        if all(other.sig == sig or sig in other.parked for other in proposals) and any(
            other.sig != sig for other in proposals
        ):
            return ("run", sig)
    parking = [i for i, proposal in enumerate(proposals) if proposal.may_park]
    return ("park", parking) if parking else None
