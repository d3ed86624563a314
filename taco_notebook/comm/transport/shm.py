"""Intra-node reduce-scatter and allgather through one shared-memory segment per node, chunk by chunk.

gloo would move every byte of a node's reduce-scatter and allgather through loopback TCP; ranks of one node
share memory instead. Each copies its tensor into its slot of the segment, each sums its shard across the slots
into the output area, the inter-node step reduces that shard in place, and each reads the whole output area
back. Only the segment's creation goes over the node's process group; the passes wait for each other through
counters in the segment's header, so they can run on their own thread, chunk after chunk, while the
communication thread is in the cross-node step of an earlier chunk (:mod:`.pipeline`). With no cross-node step
the same passes are a one-node job's whole allreduce (:func:`.pipeline.reduce_node_shm`), and the header also
carries the ranks' agreement on each collective (:meth:`NodeSegment.exchange`).

The segment lives in a hugetlbfs mount or in ``/dev/shm`` (:mod:`.shmfile`); with no room in either,
:meth:`NodeSegment.prepare` says so on every local rank. Its file has no name: local rank 0 makes it unnamed and
the others open it through rank 0's fd, so a rank killed, stopped or failing at any point leaves nothing in
``/dev/shm`` (:meth:`NodeSegment._open`, which also covers ranks that cannot open each other's fds). Waits
sleep on futex words in the header, and a rank waiting for a dead local peer learns it within ``_CHECK_S``
(:mod:`.peers`), not at the collective timeout.
"""

from __future__ import annotations

import mmap
import os
import select
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from .peers import LIBC, Pidfds, futex_wait, futex_wake, started, watch
from .shmfile import hugetlbfs_mount
from .shmsetup import agree, let_go, make, take

__all__ = ["NodeSegment", "hugetlbfs_mount", "MAX_LOCAL"]

_HUGE_PAGE = 2 * 1024 * 1024
# The segment opens with one huge page of flags (what each local rank has published so far, see
# NodeSegment._wait), so the slots after it stay huge-page aligned.
_HEADER = _HUGE_PAGE
MAX_LOCAL = 1024  # local ranks the header has flags for
_COPIED, _REDUCED, _DONE = 0, 1, 2  # flag rows: chunk copied in, shard reduced into the output area, call read
_PID, _STARTED = 3, 4  # header rows: each local rank's pid and its start time (clock ticks after boot)
_SAID = 5  # flag row: values published for :meth:`NodeSegment.exchange`; rows 6-9 hold them (two calls' worth)
_SAYING = 6
_ROWS = {_COPIED: "copy-in", _REDUCED: "reduced shard", _DONE: "end of call", _SAID: "agreement on a collective"}
_LEFT = 10  # header row: 1 where a local rank let go of the segment with its process group (it will not come)
_GATE = 11  # header row: column r is flag row r's gate, the futex word its waiters sleep on (see _publish)
_HEADER_ROWS = 12
_CHECK_S = 0.05  # a wait looks at its peers' pidfds, its deadline and the segment at least this often


def _itemsize(dtype: torch.dtype) -> int:
    return int(dtype.itemsize)


class NodeSegment:
    """The node's shared buffer: a header of flags, an input slot of ``capacity`` bytes per local rank, an output area.

    Each chunk of an allreduce (elements ``[lo, hi)``) takes three passes per rank: :meth:`copy_in`,
    :meth:`sum_shard` (into the output area, which the cross-node step reduces in place), then :meth:`reduced`
    and :meth:`copy_out`. The passes wait on per-rank counters in the header, not on the node's process group,
    so they can run beside a collective on the communication thread and need no gloo barrier.
    """

    def __init__(self, group: Any, local_rank: int, local_size: int, tag: str, timeout_s: float = 1800.0) -> None:
        if local_size > MAX_LOCAL:
            raise ValueError(f"shared-memory allreduce supports up to {MAX_LOCAL} ranks per node, got "
                             f"{local_size}; use configure(shm=False)")
        self.group = group
        self.local_rank = local_rank
        self.local_size = local_size
        self.tag = tag  # the same on every rank of the node, unique to the job and generation
        self.capacity = 0
        self.mapping: mmap.mmap | None = None
        self.bytes: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None  # the header as int64 rows (a view made once per mapping)
        self._base = 0  # the mapping's address: a flag's futex word is at _base + (row * MAX_LOCAL + rank) * 8
        self.location = ""
        self.growths = 0
        self.timeout_s = timeout_s  # a pass waiting for a local rank gives up after this (collective timeout)
        # Each flag row counts what a rank has published through this mapping; every rank publishes the same
        # sequence, so "all ranks at n" is a row's minimum. _start/_end: the current call's first/last values.
        self._start = [0, 0, 0]
        self._end = [0, 0, 0]
        self._pidfds = Pidfds()  # local rank -> pidfd of that peer process (where it could be opened)
        self._said = 0  # exchanges through this mapping (every local rank makes the same ones)
        self._roomless = False  # the node had no room even for the header: exchange() goes over the group
        self.by_path = False  # the ranks open the segment by its path: some rank could not open rank 0's fd

    def _open(self, nbytes: int) -> bool:
        """Grow to hold tensors of ``nbytes`` (collective over the node); False on every local rank when the
        node has no room for the segment (the old one is kept).

        Local rank 0 makes the file with no name unless :attr:`by_path`: the others open it through
        ``/proc/<pid>/fd`` while rank 0 holds it open, so a fault at any point leaves nothing behind. By path
        (where a rank cannot open another's fd: another pid namespace, a hardened ``/proc``), the name lives
        until every local rank mapped it, or the setup failed; then any rank removes it, and where all were
        killed first, the next segment made on the node does.
        """
        capacity = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
        total = _HEADER + capacity * (self.local_size + 1)
        self.growths += 1
        offer, fd = make(f"{self.tag}-{self.growths}", total, self.by_path) if self.local_rank == 0 else (None, -1)
        try:
            holder = [offer]
            dist.broadcast_object_list(holder, src=dist.get_global_rank(self.group, 0), group=self.group)
            offer = holder[0]
            if offer is None:
                return False
            self.close()
            failure = ""
            if self.local_rank != 0:
                fd, failure = take(offer, self.local_rank)
            failed = agree(self.group, self.local_size, failure or self._map(fd, total))
        finally:
            let_go(offer, fd)
        if failed:
            self.close()
            if not offer.by_path:  # a rank could not open another's fd: the same again, by name
                self.by_path = True
                return self._open(nbytes)
            raise RuntimeError(f"the node's shared segment {offer.path} could not be mapped: {'; '.join(failed)}")
        self._watch_peers()
        self.capacity = capacity
        self.location = os.path.dirname(offer.path)
        self._said = 0  # a new mapping starts with zero counters
        return True

    def _map(self, fd: int, total: int) -> str:
        """Map the segment open on ``fd`` and publish this rank's pid in it; "" or what went wrong."""
        try:
            self.mapping = mmap.mmap(fd, total)
        except OSError as error:
            return f"local rank {self.local_rank}: {error}"
        self.bytes = torch.frombuffer(self.mapping, dtype=torch.uint8)
        self._rows = self.bytes[: _HEADER_ROWS * MAX_LOCAL * 8].view(torch.int64).view(_HEADER_ROWS, MAX_LOCAL)
        self._base = int(self.bytes.data_ptr())
        self._flags()[_PID, self.local_rank] = os.getpid()
        self._flags()[_STARTED, self.local_rank] = started(os.getpid())
        return ""

    def _watch_peers(self) -> None:
        """A pidfd on each local peer that published its pid and start time (:func:`.peers.watch`)."""
        rows = self._flags()
        self._pidfds = watch([(int(rows[_PID, i]), int(rows[_STARTED, i])) if i != self.local_rank else (0, 0)
                              for i in range(self.local_size)])

    def _view(self, area: int, dtype: torch.dtype, numel: int, offset: int = 0) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at element ``offset`` of ``area`` (0..local_size-1: the input slots,
        local_size: the output area)."""
        size = _itemsize(dtype)
        start = _HEADER + area * self.capacity + offset * size
        return self._mapped()[start: start + numel * size].view(dtype)

    def prepare(self, nbytes: int, chunks: int, itemsize: int = 8) -> bool:
        """Make room for a tensor of ``nbytes`` (elements of ``itemsize``) going in ``chunks`` chunks (collective
        over the node when it grows: call it on every local rank, on the thread that runs the node's
        collectives, before any pass). False on every local rank when the node has no room for it: no pass
        may run then."""
        room = nbytes + max(8, itemsize) * self.local_size  # the last chunk's shards are padded to equal widths
        if room > self.capacity:
            if not self._open(room):
                return False
            self._end = [0, 0, 0]  # a new mapping starts with zero counters
        self._start = list(self._end)
        self._end = [self._start[_COPIED] + chunks, self._start[_REDUCED] + chunks, self._start[_DONE] + 1]
        return True

    def exchange(self, values: tuple[int, int], timeout_s: float | None = None) -> tuple[list[int], list[int]] | None:
        """Every local rank's two int64 ``values``, in local-rank order, through the header: what the ranks'
        agreement on a collective exchanges (:mod:`.agreement`), without gloo's allgather (L-1 loopback steps
        among L processes). Collective over the node; None on every local rank when the node has no room for it.

        Two calls' values alternate between two pairs of rows: a rank overwrites call k's row only in call
        k+2, after every rank published call k+1, which each did after reading call k. ``timeout_s``: a shorter
        wait than the collective timeout (a meeting on the way out, which must not hold a teardown up).
        """
        if self.bytes is None:
            if self._roomless or not self._open(0):
                self._roomless = True
                return None
        rows = self._flags()
        said = self._said
        base = _SAYING + 2 * (said % 2)
        rows[base, self.local_rank] = values[0]
        rows[base + 1, self.local_rank] = values[1]
        self._said = said + 1
        self._publish(_SAID, said + 1)
        self._wait(_SAID, said + 1, timeout_s)
        every = rows[base: base + 2, : self.local_size].tolist()
        return every[0], every[1]

    # ---- passes of chunk ``k`` of the call (elements ``[lo, hi)`` of the caller's buffer) ----------------------
    def copy_in(self, buf: torch.Tensor, lo: int, hi: int, k: int, own: tuple[int, int] | None = None) -> None:
        """Write this rank's elements ``[lo, hi)`` into its input slot and say so.

        ``own``: this rank's shard of the chunk, which is left out. Only this rank sums that shard, and
        :meth:`sum_shard` reads it from ``buf`` itself, which saves 1/local_size of the copy.
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

    def sum_slots(self, dtype: torch.dtype, lo: int, hi: int, out: torch.Tensor, k: int) -> None:
        """``out`` = the sum over every slot of elements ``[lo, hi)`` (zeros past ``hi``), in one reduction over
        a strided view of the slots, once every rank copied chunk ``k`` in whole (:meth:`copy_in` without
        ``own``). One call where :meth:`sum_shard` makes one per slot: with many local ranks, the small adds
        cost more than the bytes they read."""
        self._wait(_COPIED, self._start[_COPIED] + k + 1)
        width = max(0, hi - lo)
        if width < out.numel():
            out[width:].zero_()
        if width == 0:
            return
        size = _itemsize(dtype)
        slots = torch.as_strided(self._mapped().view(dtype), (self.local_size, width), (self.capacity // size, 1),
                                 (_HEADER + lo * size) // size)
        torch.sum(slots, dim=0, dtype=dtype, out=out[:width])

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
        """Say that this rank reached ``value`` in flag row ``row``; the last rank to get there opens the row's
        gate, which wakes every rank waiting for it (:meth:`_wait`).

        Why a plain store is enough for the data: it was written by a finished torch call before this store,
        and x86 keeps stores in order (TSO); readers load the flag before the data. Why the last rank is
        always seen: the futex wake on this rank's own flag (nobody sleeps there) runs a full memory barrier
        in the kernel (``futex_hb_waiters_pending``), between this store and the loads of the others' flags.
        Of two ranks arriving together each then sees the other's flag, and at least one opens the gate. A
        gate only moves forward: a rank opens ``value`` before it publishes anything later in the row, so
        before anyone can open a later one.
        """
        rows = self._flags()
        rows[row, self.local_rank] = value
        if LIBC is None:
            return
        futex_wake(self._address(row, self.local_rank))  # the barrier (a syscall with no one to wake)
        if int(rows[row, : self.local_size].min()) >= value:
            rows[_GATE, row] = value
            futex_wake(self._address(_GATE, row))

    def _address(self, row: int, local_rank: int) -> int:
        """Where a flag lives: its low 32 bits are the futex word waiters sleep on (little-endian hosts: the
        counters stay far below 2**32, and a futex compares the low half the kernel reads there)."""
        self._mapped()
        return self._base + (row * MAX_LOCAL + local_rank) * 8

    def _mapped(self) -> torch.Tensor:
        """The mapping's bytes; a pass on a closed segment (its group torn down under it) raises."""
        if self.bytes is None:
            raise RuntimeError("the node's shared-memory segment is closed (the process group was torn down)")
        return self.bytes

    def _flags(self) -> torch.Tensor:
        rows = self._rows
        if rows is None:
            raise RuntimeError("the node's shared-memory segment is closed (the process group was torn down)")
        return rows

    def _wait(self, row: int, target: int, timeout_s: float | None = None) -> None:
        """Wait until every local rank published ``row`` at least ``target`` times, asleep (ranks share cores).

        The sleep is on the row's gate, a futex word that the last rank to arrive moves and wakes
        (:meth:`_publish`): a waiter costs no CPU while it waits and wakes once, when everyone is there, not on
        every arrival. Where there is no futex (not Linux) it polls, sleeping up to 0.5 ms. At least every
        ``_CHECK_S`` it looks at the pidfds of the ranks not there yet, so a peer that died ends the wait with an
        error naming it; one that never arrives for another reason (the job diverged) ends it after the
        collective timeout, and so does this segment's close (the group was torn down under the wait).
        """
        if self.bytes is None:
            raise RuntimeError(f"the node's shared-memory segment was closed before step {_ROWS[row]} (the "
                               "process group was torn down)")
        rows, peers = self._flags(), self._pidfds  # held here: a close() on another thread drops only its own
        flags = rows[row, : self.local_size]
        if int(flags.min()) >= target:
            return
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        delay, deadline, checked = 2e-5, time.monotonic() + timeout_s, time.monotonic()
        gate, lefts = self._address(_GATE, row), rows[_LEFT, : self.local_size]
        while True:
            opened = int(rows[_GATE, row])  # read before the flags: a gate moved after this wakes the sleep below
            seen = flags.tolist()
            late = [i for i, count in enumerate(seen) if count < target]
            if not late:
                return
            if self.bytes is None:
                raise RuntimeError(f"the node's shared-memory segment was closed while waiting for local rank(s) "
                                   f"{late} at step {_ROWS[row]} (the process group was torn down)")
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"local rank(s) {late} of this node did not reach the shared-memory step "
                                   f"{_ROWS[row]} #{target} within {timeout_s:g} s (a rank died or the "
                                   "ranks called different collectives)")
            gone = lefts.tolist()
            left = [i for i in late if gone[i]]
            if left:
                raise RuntimeError(f"local rank(s) {left} of this node left the shared-memory step {_ROWS[row]}: "
                                   "their process group was torn down (they gave up on this collective)")
            if LIBC is not None and now - checked < _CHECK_S:
                futex_wait(gate, opened, _CHECK_S)
                continue
            checked = now
            watched = [peers[i] for i in late if i in peers]
            ended, _, _ = select.select(watched, [], [], 0.0 if LIBC is not None else delay)
            if ended:
                dead = [i for i in late if peers.get(i) in ended]
                pids = [int(rows[_PID, i]) for i in dead]
                raise RuntimeError(f"local rank(s) {dead} of this node (pid {', '.join(map(str, pids))}) ended "
                                   f"before the shared-memory step {_ROWS[row]}: connection to the peer lost")
            delay = min(2 * delay, 5e-4)

    def close(self, leaving: bool = False) -> None:
        """Let go of the mapping and the peers' pidfds; ``leaving``: for good, with the process group (teardown):
        the other local ranks waiting for this one in a pass, now or when they arrive, raise at once instead of
        waiting for their timeout or stall watchdog (a rank that arrives after its peers gave up).

        Neither the mapping nor the pidfds are closed here, but when their last user lets go: a pass on another
        thread may still be reading the mapping or waiting on the pidfds (the group torn down under it: that
        wait then ends with an error), and an unmapped page read there is a segfault, a closed fd number
        reused a wrong answer. The mapping's tensors keep it alive (torch.frombuffer holds the mmap object);
        the pidfds go with the last reference to their holder (:class:`.peers.Pidfds`)."""
        if leaving and self.bytes is not None:
            self._flags()[_LEFT, self.local_rank] = 1
            if LIBC is not None:  # move every gate and wake its sleepers: they look again and see this
                for row in (_COPIED, _REDUCED, _DONE, _SAID):
                    self._flags()[_GATE, row] = -1
                    futex_wake(self._address(_GATE, row))
        self._pidfds = Pidfds()
        self.bytes = None
        self._rows = None
        self.mapping = None
        self.capacity = 0


def new_tag(group: Any) -> str:
    """A name part shared by a node's ranks and unique to this job and process-group generation."""
    holder = [uuid.uuid4().hex[:12]]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    return str(holder[0])
