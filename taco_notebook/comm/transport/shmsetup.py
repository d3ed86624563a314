"""How a node's ranks come to share one segment file (:class:`.shm.NodeSegment`), and what each tells the others.

Local rank 0 makes the file (:func:`make`) and offers it (:class:`Offer`): unnamed, held open on an fd the others
open through ``/proc/<pid>/fd`` (:func:`take`); or, where some rank cannot, named until every rank mapped it.
:func:`agree` then tells every rank what any could not do; until then rank 0 holds its fd, so no rank comes too
late for it. :func:`let_go` closes this rank's fd and removes a name left for the ranks that open it by name.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .shmfile import create, hugetlbfs_mount, open_held, open_own, reclaim_orphans, segment_name

__all__ = ["Offer", "make", "take", "agree", "let_go"]


@dataclass(frozen=True)
class Offer:
    """What local rank 0 tells the others of a new segment file: where it was made (a name gone already
    unless ``by_path``), and the process and fd holding it open."""

    path: str
    pid: int
    fd: int
    dev: int
    ino: int
    by_path: bool


def make(name: str, total: int, by_path: bool) -> tuple[Offer | None, int]:
    """Local rank 0: a new segment file of ``total`` bytes and the fd it is held open on, (None, -1) when the
    node has no room. Named ``name`` only ``by_path``; orphans of dead makers go first
    (:func:`.shmfile.reclaim_orphans`)."""
    directory = hugetlbfs_mount()
    reclaim_orphans([place for place in (directory, "/dev/shm") if place])
    path, fd = create(directory, segment_name(name), total, named=by_path)
    if not path:
        return None, -1
    found = os.fstat(fd)
    return Offer(path, os.getpid(), fd, found.st_dev, found.st_ino, by_path), fd


def take(offer: Offer, local_rank: int) -> tuple[int, str]:
    """A non-zero local rank: an fd on the file rank 0 offers, or -1 and why not (:func:`agree` then tells
    every rank)."""
    try:
        if not offer.by_path:
            return open_held(offer.pid, offer.fd, offer.dev, offer.ino), ""
        fd = open_own(offer.path)
        if os.fstat(fd).st_ino == offer.ino:
            return fd, ""
        os.close(fd)
        return -1, f"local rank {local_rank}: {offer.path} is another file now"
    except OSError as error:
        return -1, f"local rank {local_rank}: {error}"


def agree(group: Any, local_size: int, failure: str) -> list[str]:
    """What each local rank could not do to map the new segment (``failure``: this rank's), in local-rank
    order; empty when every rank mapped it. Collective over the node ``group``; a rank that cannot reach the
    others here names what it failed at."""
    ok = torch.tensor([0 if failure else 1], dtype=torch.int32)
    try:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    except RuntimeError as error:
        if failure:
            raise RuntimeError(f"could not map the node's shared segment ({failure}), and the node's process "
                               f"group failed: {error}") from error
        raise
    if int(ok) == 1:
        return []
    every: list[Any] = [None] * local_size
    dist.all_gather_object(every, failure, group=group)
    return [str(what) for what in every if what]


def let_go(offer: Offer | None, fd: int) -> None:
    """Close this rank's fd on a segment file (its mapping, if any, keeps the memory) and remove a name left
    for the ranks that open it by name (whichever rank gets there first)."""
    if fd >= 0:
        os.close(fd)
    if offer is not None and offer.by_path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(offer.path)
