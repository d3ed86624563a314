"""Sub-groups: collectives over some of the ranks (Horovod's process sets), over torch.distributed groups.

``group = taco.new_group([0, 2])`` is collective over every rank (each must call it, with the same ranks, in
the same order, as torch's ``new_group``); then ``taco.allreduce(t, group=group)`` and the other collectives run
over those ranks only, checked by :mod:`.agreement` among them. A rank outside the group that calls a
collective on it gets a ValueError naming the group. Groups belong to the process group they were made on: a
rebuilt group (``reinit()``, elastic) forgets them, and using one after that raises, naming the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..state import state

__all__ = ["SubGroup", "new_group", "resolve"]


@dataclass(frozen=True, eq=False)
class SubGroup:
    """Some of the job's ranks (global rank numbers, ascending) and the torch group over them."""

    ranks: tuple[int, ...]
    handle: Any
    generation: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"SubGroup(ranks={list(self.ranks)})"


def new_group(ranks: Any) -> SubGroup:
    """A group of ``ranks`` (collective over every rank of the job: all call it with the same ranks)."""
    import torch.distributed as dist

    from .checked import ensure_ready

    size = state.ensure_topology().size
    try:
        chosen = tuple(sorted(int(r) for r in ranks))
    except (TypeError, ValueError):
        raise ValueError(f"a group needs a list of ranks, got {ranks!r}") from None
    if not chosen or len(set(chosen)) != len(chosen) or not all(0 <= r < size for r in chosen):
        raise ValueError(f"a group needs distinct ranks in 0..{size - 1}, got {list(ranks)!r}")

    def make() -> SubGroup:
        ensure_ready()
        handle = dist.new_group(list(chosen), backend=state.backend)
        return SubGroup(chosen, handle, state.generation)

    return state.comm_thread.run(make)


def resolve(group: SubGroup | None) -> Any:
    """The torch group of ``group`` for this rank (None: every rank); ValueError when this rank is not in it,
    or when the group was made on a process group that has been rebuilt since."""
    if group is None:
        return None
    if not isinstance(group, SubGroup):
        raise TypeError(f"group must be made by taco.new_group(ranks), got {type(group).__name__}")
    if group.generation != state.generation:
        raise ValueError(
            f"{group!r} belongs to a process group that was rebuilt since; make it again with "
            "taco.new_group(ranks) on every rank"
        )
    me = state.ensure_topology().rank
    if me not in group.ranks:
        raise ValueError(f"rank {me} is not in {group!r}: only its ranks may run collectives over it")
    return group.handle
