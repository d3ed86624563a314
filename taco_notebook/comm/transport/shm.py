"""Intra-node reduce-scatter and allgather through one shared-memory segment per node, chunk by chunk.

gloo's reduce-scatter and allgather move every byte through loopback TCP and cost more than the inter-node
step they feed (measured: 370 ms and 245 ms for 100 MiB on 2 local ranks, against 78 ms for the cross-node
allreduce of the shard). Ranks of one node share memory instead: each copies its tensor into its slot of the
segment, each sums its shard across the slots into the output area, the inter-node step reduces that shard
in place, and each reads the whole output area back. Only the segment's creation goes over the node's process
group; the passes wait for each other through counters in the segment's header, so they can run on a thread
of their own, chunk after chunk, while the communication thread is in the cross-node step of an earlier
chunk (:mod:`.pipeline`).

The segment lives in a hugetlbfs mount when the node has free huge pages (what HARP-style stacks need
anyway), else in ``/dev/shm``. Its file is unlinked as soon as every local rank has mapped it, so nothing is
left behind even if a rank is killed.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["NodeSegment", "hugetlbfs_mount"]

_HUGE_PAGE = 2 * 1024 * 1024
# The segment opens with one huge page of flags (what each local rank has published so far, see
# NodeSegment._wait), so the slots after it stay huge-page aligned.
_HEADER = _HUGE_PAGE
_MAX_LOCAL = 1024  # local ranks the header has flags for
_COPIED, _REDUCED, _DONE = 0, 1, 2  # flag rows: chunk copied in, shard reduced into the output area, call read
_ROWS = ("copy-in", "reduced shard", "end of call")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
    """The node's shared buffer: a header of flags, ``local_size`` input slots of ``capacity`` bytes and one
    output area.

    One allreduce goes through it in chunks (elements ``[lo, hi)``), each in three passes per rank:
    :meth:`copy_in`, :meth:`sum_shard` (into the output area, where the cross-node step reduces it in place),
    then :meth:`reduced` and :meth:`copy_out`. The passes wait for each other through per-rank counters in the
    header, not through the node's process group: they run on their own thread while the communication
    thread is in a collective, and a counter costs microseconds where a gloo barrier costs a round trip.
    """

    def __init__(self, group: Any, local_rank: int, local_size: int, tag: str, timeout_s: float = 1800.0) -> None:
        if local_size > _MAX_LOCAL:
            raise ValueError(f"shared-memory allreduce supports up to {_MAX_LOCAL} ranks per node, got "
                             f"{local_size}; use configure(shm=False)")
        self.group = group
        self.local_rank = local_rank
        self.local_size = local_size
        self.tag = tag  # the same on every rank of the node, unique to the job and generation
        self.capacity = 0
        self.mapping: mmap.mmap | None = None
        self.bytes: torch.Tensor | None = None
        self.location = ""
        self.growths = 0
        self.timeout_s = timeout_s  # a pass waiting for a local rank gives up after this (collective timeout)
        # Each flag row counts what a rank has published through this mapping; every rank publishes the same
        # sequence, so "all ranks at n" is a row's minimum. _start/_end: the current call's first/last values.
        self._start = [0, 0, 0]
        self._end = [0, 0, 0]

    def _barrier(self) -> None:
        dist.barrier(group=self.group)

    def _open(self, nbytes: int) -> None:
        """Grow to hold tensors of ``nbytes`` (collective over the node)."""
        capacity = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
        total = _HEADER + capacity * (self.local_size + 1)
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

    def _view(self, area: int, dtype: torch.dtype, numel: int, offset: int = 0) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at element ``offset`` of ``area`` (0..local_size-1: the input slots,
        local_size: the output area)."""
        assert self.bytes is not None
        size = _itemsize(dtype)
        start = _HEADER + area * self.capacity + offset * size
        return self.bytes[start: start + numel * size].view(dtype)

    def prepare(self, nbytes: int, chunks: int) -> None:
        """Make room for a tensor of ``nbytes`` going in ``chunks`` chunks (collective over the node when it
        grows: call it on every local rank, on the thread that runs the node's collectives, before any pass)."""
        room = nbytes + 8 * self.local_size  # the last chunk's shards are padded to equal widths
        if room > self.capacity:
            self._open(room)
            self._end = [0, 0, 0]  # a new mapping starts with zero counters
        self._start = list(self._end)
        self._end = [self._start[_COPIED] + chunks, self._start[_REDUCED] + chunks, self._start[_DONE] + 1]

    # ---- passes of chunk ``k`` of the call (elements ``[lo, hi)`` of the caller's buffer) ----------------------
    def copy_in(self, buf: torch.Tensor, lo: int, hi: int, k: int, own: tuple[int, int] | None = None) -> None:
        """Write this rank's elements ``[lo, hi)`` into its input slot and say so.

        ``own``: this rank's shard of the chunk, which is left out. Only this rank sums that shard, and
        :meth:`sum_shard` reads it from ``buf`` itself (1/local_size of the copy saved: half on 2 ranks).
        """
        if k == 0:  # every rank has read the previous call's output area: slots and area are free again
            self._wait(_DONE, self._start[_DONE])
        start, end = own if own is not None else (hi, hi)
        start, end = min(max(start, lo), hi), min(max(end, lo), hi)
        for a, b in (lo, start), (end, hi):
            if b > a:
                self._view(self.local_rank, buf.dtype, b - a, a).copy_(buf[a:b])
        self._publish(_COPIED, self._start[_COPIED] + k + 1)

    def sum_shard(self, buf: torch.Tensor, lo: int, hi: int, out: torch.Tensor, k: int,
                  scratch: torch.Tensor | None = None) -> None:
        """``out`` = the node's sum of elements ``[lo, hi)`` (zeros past ``hi``), written in ``out``'s dtype.

        Why straight into ``out``: when ``out`` is the wire buffer of a cast (fp16/bf16) the cast happens in the
        same pass as the sum, with no full-size float copy of the shard. More than two local ranks sum in
        ``scratch`` (the buffer's dtype) first, so a cast rounds once. This rank's own part is read from
        ``buf`` (:meth:`copy_in` leaves it out of its slot), in the same order, so the sum is the same.
        """
        self._wait(_COPIED, self._start[_COPIED] + k + 1)
        width = max(0, hi - lo)
        slots = [buf[lo:lo + width] if slot == self.local_rank else self._view(slot, buf.dtype, width, lo)
                 for slot in range(self.local_size)]
        if width < out.numel():
            out[width:].zero_()
        if width == 0:
            return
        target = out[:width]
        if len(slots) == 2:
            torch.add(slots[0], slots[1], out=target)
            return
        acc = scratch[:width] if scratch is not None else target
        torch.add(slots[0], slots[1], out=acc)
        for slot in slots[2:-1]:
            acc.add_(slot)
        torch.add(acc, slots[-1], out=target)

    def reduced(self, k: int) -> None:
        """Say that this rank's reduced shard of chunk ``k`` is in the output area."""
        self._publish(_REDUCED, self._start[_REDUCED] + k + 1)

    def copy_out(self, buf: torch.Tensor, lo: int, hi: int, dtype: torch.dtype, k: int, last: bool) -> None:
        """Read elements ``[lo, hi)`` of the output area (held in ``dtype``) into ``buf`` once every rank wrote
        its shard of chunk ``k``; the cast back from a wire dtype happens in this copy."""
        self._wait(_REDUCED, self._start[_REDUCED] + k + 1)
        buf[lo:hi].copy_(self._view(self.local_size, dtype, hi - lo, lo))
        if last:
            self._publish(_DONE, self._end[_DONE])

    def output(self, dtype: torch.dtype, lo: int, numel: int) -> torch.Tensor:
        """The output area's ``numel`` elements of ``dtype`` from element ``lo``: where this rank's shard of a
        chunk is reduced, in place (the cross-node step works on it directly)."""
        return self._view(self.local_size, dtype, numel, lo)

    def _publish(self, row: int, value: int) -> None:
        # Why a plain store is enough: the data was written by a finished torch call before this store, and
        # x86 keeps stores in order (TSO); readers load the flag before the data.
        self._flags()[row, self.local_rank] = value

    def _flags(self) -> torch.Tensor:
        assert self.bytes is not None
        return self.bytes[: 3 * _MAX_LOCAL * 8].view(torch.int64).view(3, _MAX_LOCAL)

    def _wait(self, row: int, target: int) -> None:
        """Wait until every local rank published ``row`` at least ``target`` times (sleeping, not spinning:
        ranks share cores). A rank that never gets there (it died, or the job diverged) ends the wait with an
        error after the collective timeout instead of hanging."""
        flags = self._flags()[row, : self.local_size]
        if int(flags.min()) >= target:
            return
        delay, deadline = 2e-5, time.monotonic() + self.timeout_s
        while int(flags.min()) < target:
            if time.monotonic() > deadline:
                late = [i for i, seen in enumerate(flags.tolist()) if seen < target]
                raise TimeoutError(f"local rank(s) {late} of this node did not reach the shared-memory step "
                                   f"{_ROWS[row]} #{target} within {self.timeout_s:g} s (a rank died or the "
                                   "ranks called different collectives)")
            time.sleep(delay)
            delay = min(2 * delay, 5e-4)

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
