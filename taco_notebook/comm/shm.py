"""Intra-node reduce-scatter and allgather through one shared-memory segment per node.

gloo's reduce-scatter and allgather move every byte through loopback TCP and cost more than the inter-node
step they feed (measured: 370 ms and 245 ms for 100 MiB on 2 local ranks, against 78 ms for the cross-node
allreduce of the shard). Ranks of one node share memory instead: each copies its tensor into its slot of the
segment, each sums its shard across the slots, and after the inter-node step each writes its reduced shard
back for the others to read. Only small barriers go over the node's process group.

The segment lives in a hugetlbfs mount when the node has free huge pages (what HARP-style stacks need
anyway), else in ``/dev/shm``. Its file is unlinked as soon as every local rank has mapped it, so nothing is
left behind even if a rank is killed.
"""

from __future__ import annotations

import mmap
import os
import uuid
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["NodeSegment", "hugetlbfs_mount"]

_HUGE_PAGE = 2 * 1024 * 1024


def hugetlbfs_mount() -> str | None:
    """A writable hugetlbfs mount with free huge pages, or None."""
    try:
        with open("/proc/mounts") as mounts:
            paths = [line.split()[1] for line in mounts if line.split()[2:3] == ["hugetlbfs"]]
        with open("/proc/meminfo") as meminfo:
            free = next((int(line.split()[1]) for line in meminfo if line.startswith("HugePages_Free:")), 0)
    except OSError:
        return None
    usable = [p for p in paths if os.access(p, os.W_OK)]
    return usable[0] if usable and free > 0 else None


class NodeSegment:
    """The node's shared buffer: ``local_size`` input slots of ``capacity`` bytes plus one output area."""

    def __init__(self, group: Any, local_rank: int, local_size: int, tag: str) -> None:
        self.group = group
        self.local_rank = local_rank
        self.local_size = local_size
        self.tag = tag  # the same on every rank of the node, unique to the job and generation
        self.capacity = 0
        self.mapping: mmap.mmap | None = None
        self.bytes: torch.Tensor | None = None
        self.location = ""
        self.growths = 0

    def _barrier(self) -> None:
        dist.barrier(group=self.group)

    def _open(self, nbytes: int) -> None:
        """Grow to hold tensors of ``nbytes`` (collective over the node)."""
        capacity = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
        total = capacity * (self.local_size + 1)
        self.growths += 1
        name = f"taco-{self.tag}-{self.growths}"
        directory = hugetlbfs_mount() if self.local_rank == 0 else None
        path = ""
        if self.local_rank == 0:
            path = self._create(directory, name, total)
        holder = [path]
        dist.broadcast_object_list(holder, src=dist.get_global_rank(self.group, 0), group=self.group)
        path = holder[0]
        self.close()
        fd = _open_own(path)
        try:
            self.mapping = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self._barrier()
        if self.local_rank == 0:
            os.unlink(path)  # every rank has it mapped: the memory lives on, the name does not
        self.bytes = torch.frombuffer(self.mapping, dtype=torch.uint8)
        self.capacity = capacity
        self.location = os.path.dirname(path)

    @staticmethod
    def _create(directory: str | None, name: str, total: int) -> str:
        for place in ([directory] if directory else []) + ["/dev/shm"]:
            path = os.path.join(place, name)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                try:
                    os.ftruncate(fd, total)
                    if place != "/dev/shm":  # hugetlbfs: check the pages really exist before using them
                        mmap.mmap(fd, total).close()
                finally:
                    os.close(fd)
                return path
            except OSError:
                if os.path.exists(path):
                    os.unlink(path)
        raise RuntimeError(f"no shared memory for {total} bytes in {directory or ''} or /dev/shm")

    def _view(self, area: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        assert self.bytes is not None
        start = area * self.capacity
        return self.bytes[start: start + numel * torch.empty((), dtype=dtype).element_size()].view(dtype)

    def reduce_scatter(self, buf: torch.Tensor, shard: torch.Tensor) -> None:
        """``shard`` = the node's sum of this rank's 1/local_size of ``buf`` (collective over the node)."""
        nbytes = buf.numel() * buf.element_size()
        if nbytes > self.capacity:
            self._open(nbytes)
        self._view(self.local_rank, buf.dtype, buf.numel()).copy_(buf)
        self._barrier()
        start = self.local_rank * shard.numel()
        width = max(0, min(shard.numel(), buf.numel() - start))
        shard.zero_()
        for slot in range(self.local_size):
            shard[:width].add_(self._view(slot, buf.dtype, buf.numel())[start: start + width])

    def all_gather(self, buf: torch.Tensor, shard: torch.Tensor) -> None:
        """Every rank's ``shard`` concatenated into ``buf`` (collective over the node)."""
        out = self._view(self.local_size, buf.dtype, buf.numel())
        start = self.local_rank * shard.numel()
        width = max(0, min(shard.numel(), buf.numel() - start))
        out[start: start + width].copy_(shard[:width])
        self._barrier()
        buf.copy_(out)
        self._barrier()  # nobody overwrites the output area until everyone has read it

    def close(self) -> None:
        self.bytes = None
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:  # a tensor still views it: the mapping goes when that tensor does
                pass
            self.mapping = None
        self.capacity = 0


def _open_own(path: str) -> int:
    """Open the segment rank 0 named, refusing a symlink (``O_NOFOLLOW``) or a file another user owns: in a shared
    hugetlbfs mount or /dev/shm someone else could otherwise slip in a file of theirs under the expected name."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    owner = os.fstat(fd).st_uid
    if owner != os.geteuid():
        os.close(fd)
        raise PermissionError(f"shared segment {path} belongs to uid {owner}, not to this user: refusing to map it")
    return fd


def new_tag(group: Any) -> str:
    """A name part shared by a node's ranks and unique to this job and process-group generation."""
    holder = [uuid.uuid4().hex[:12]]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    return str(holder[0])
