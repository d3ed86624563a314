"""A process group over members chosen without MPI: the survivors (and joiners) of an elastic job.

MPI fixes a job's ranks at launch, and a world with a dead rank can no longer run a collective, so an elastic
group is not built from MPI: whoever owns the membership (the notebook's client,
:mod:`taco_notebook.cluster.elastic`) numbers the live processes 0..n-1, asks the new rank 0 to
:func:`open_group` a store, and tells every member :func:`join_group` with its new rank, every member's node
name (the new topology, hence the new 2D layout) and the store's address. The old group is dropped without a
collective (its peers may be dead).

Imports no IPython: the calls are plain functions taking plain values.
"""

from __future__ import annotations

import os

from ..state import state
from . import bootstrap, rendezvous
from .topology import Topology, intra_size_from_env

__all__ = ["open_group", "join_group", "placement", "new_topology"]

_opened: dict[str, rendezvous.Rendezvous] = {}  # address -> the store this process opened, until it joins


def placement() -> tuple[str, str, str]:
    """What tells hosts apart (:func:`.rendezvous.placement`): equal on every member means one host, a FileStore."""
    return rendezvous.placement()


def _seconds(timeout_s: float | None) -> float:
    from ..config import settings

    return settings().collective_timeout if timeout_s is None else timeout_s


def open_group(kind: str, size: int, timeout_s: float | None = None) -> str:
    """On the new rank 0: open the store of a ``size``-member group (``kind`` "file" or "tcp"); its address."""
    meeting = rendezvous.open_meeting(kind, size, _seconds(timeout_s))
    _opened[meeting.address] = meeting
    return meeting.address


def new_topology(rank: int, hostnames: list[str]) -> Topology:
    """``rank``'s topology among ``hostnames``: ``LIGHT_INTRA_SIZE`` when it still divides the size, else nodes
    by name (a lost rank can leave nodes of unequal size; the 2D algorithm then falls back to the flat ring)."""
    intra = intra_size_from_env()
    if intra is not None and len(hostnames) % intra:
        intra = None
    return Topology.from_hostnames(rank, hostnames, intra)


def join_group(rank: int, hostnames: list[str], kind: str, address: str, timeout_s: float | None = None) -> int:
    """Leave the current group (not collective) and join the one at ``address`` as ``rank`` of
    ``len(hostnames)`` (collective over the new members). Keeps the rank's backend and device. Returns ``rank``.
    """
    backend = state.backend or os.environ.get("TACO_BACKEND")
    device = state.device
    bootstrap.abort()  # drops the old group and runs the teardown callbacks (2D groups, comm thread)
    topology = new_topology(rank, hostnames)
    seconds = _seconds(timeout_s)
    meeting = _opened.pop(address, None)
    if meeting is None:
        meeting = rendezvous.join_meeting(kind, address, len(hostnames), seconds)
    state.topology, state.membership = topology, tuple(hostnames)
    if backend is None:
        backend = bootstrap.default_backend()
    bootstrap.start_group(meeting, topology, backend, seconds, device)
    return rank
