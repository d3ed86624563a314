"""A one-node job's allreduce of CUDA tensors whose ranks share one GPU, in the GPU's own memory (CUDA IPC).

With ``--gpus auto`` on a node with fewer GPUs than ranks (every 1-GPU box) the ranks share a GPU, where NCCL
cannot run (one rank per GPU), so their CUDA tensors would go over gloo: a copy to host memory, 2(L-1)
loopback TCP steps, a copy back. Here each local rank owns a slot of device memory that every local rank maps
through CUDA IPC (as :mod:`torch.multiprocessing` shares CUDA tensors), and an allreduce is three passes of
device-to-device work: each rank copies its buffer into its slot (cast to the wire dtype for fp16/bf16), sums
its shard across every slot into its own slot, and reads every rank's summed shard back (cast back).

How the passes wait for each other depends on how the GPU runs the ranks' processes. Without MPS it
time-slices them, and a stream waiting on another process's event holds its slice (a step several times slower,
measured in benchmarks/README.md). So by default, after each pass, the comm thread waits for its own stream (the
training thread waits for nothing) and the ranks meet on the node's host segment
(:meth:`.shm.NodeSegment.exchange`, a futex wait). Under MPS (every rank sees its control daemon) the processes
run at once and the host never waits for the GPU: each rank records an interprocess CUDA event after each pass,
the ranks meet, and each stream waits for its peers' events. A peer may by then have recorded its event again
for a later pass: the wait covers more than it needs, never less, and cannot deadlock, since every wait refers
to work already queued.

Slots, handles and events are set up collectively over the node, once, and again when a buffer outgrows the
slots; every local rank must see the same GPU (its UUID) and the same answer on MPS. Where the driver or a
container refuses IPC, the ranks agree on it, keep gloo, and local rank 0 says why, once.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from .shm import NodeSegment

__all__ = ["DeviceSegment", "gpu_identity", "mps_active"]

_MIN_BYTES = 1 << 20  # the smallest slot: a handful of small allreduces must not set up again one by one
_LEAVING_S = 5.0  # how long a closing rank waits for its peers to let go of its slot (then it lets go anyway)


def gpu_identity(device: torch.device) -> str:
    """What tells one physical GPU from another across processes (their device indices may differ)."""
    props = torch.cuda.get_device_properties(device)
    return str(getattr(props, "uuid", None) or f"{props.name}@{getattr(props, 'pci_bus_id', device.index)}")


def mps_active() -> bool:
    """Whether this process's CUDA runs under MPS: its control daemon's pipe is where CUDA looks for it."""
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps", "control"))


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}".rstrip(": ")


class DeviceSegment:
    """Every local rank's slot of device memory, mapped in this process, and the ranks' interprocess events.

    ``group`` is a process group of exactly the node's ranks (a one-node job's world, local rank = rank), over
    which the set-up gathers handles; ``node`` is the node's host segment the passes meet on.
    """

    def __init__(self, node: NodeSegment, group: Any, local_rank: int, local_size: int,
                 device: torch.device) -> None:
        self.node, self.group = node, group
        self.local_rank, self.local_size, self.device = local_rank, local_size, device
        self.capacity = 0  # bytes of each slot, 0 until set up
        self.slots: list[torch.Tensor] = []  # local rank j's slot as uint8, this rank's own at local_rank
        self.events: list[torch.cuda.Event] = []  # local rank j's interprocess event, opened here
        self._event: torch.cuda.Event | None = None  # this rank's own, created once
        self.refused: str | None = None  # why this node keeps gloo (the same text on every local rank)
        self.calls = 0  # allreduces through the slots
        self.on_gpu = False  # the passes wait on the GPU (MPS), not on the host

    # ---- set-up (collective over the node) -------------------------------------------------------------------
    def ready(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fit in mapped slots, growing them first when not (collective then: the ranks
        reduce the same buffer, so they decide alike). False on every local rank when this node keeps gloo."""
        if self.refused is not None:
            return False
        if nbytes <= self.capacity:
            return True
        return self._set_up(max(nbytes, 2 * self.capacity, _MIN_BYTES))

    def _set_up(self, capacity: int) -> bool:
        self._let_go()
        if self.node.exchange((capacity, 0)) is None:  # the passes meet there: without it, no passes
            return self._refuse("the node's /dev/shm has no room for the ranks' meeting flags")
        try:  # which GPU, and MPS: asked before anything is shared, so that a refusal leaves no share behind
            seen: Any = (gpu_identity(self.device), mps_active())
        except Exception as exc:  # noqa: BLE001 - a driver's refusal: every rank learns it and keeps gloo
            seen = _failure(exc)
        every = self._gather(seen)
        refusal = self._refusal(every, "ask its GPU")
        if refusal is None and len({identity for identity, _ in every}) > 1:
            refusal = "different GPUs: the local ranks do not all share one GPU"
        if refusal is not None:
            return self._refuse(refusal)
        offer: Any = None
        mine: torch.Tensor | None = None
        try:
            with torch.cuda.device(self.device):  # the event is made on the current device, this thread's
                mine = torch.empty(capacity, dtype=torch.uint8, device=self.device)
                if self._event is None:
                    self._event = torch.cuda.Event(interprocess=True)
                from torch.multiprocessing.reductions import reduce_tensor

                # one share per peer: each peer releases its own reference count when it lets go (one share
                # read by three peers would be released three times and never seen free)
                shares = [None if j == self.local_rank else reduce_tensor(mine) for j in range(self.local_size)]
                offer = (shares, self._event.ipc_handle())
        except Exception as exc:  # noqa: BLE001
            offer = _failure(exc)
        offers = self._gather(offer)
        refusal = self._refusal(offers, "share its slot")
        opened: list[Any] = []
        if refusal is None:
            try:
                for j, (shares, event) in enumerate(offers):
                    if j == self.local_rank:
                        opened.append((mine, self._event))
                    else:
                        rebuild, args = shares[self.local_rank]
                        opened.append((rebuild(*args), torch.cuda.Event.from_ipc_handle(self.device, event)))
            except Exception as exc:  # noqa: BLE001
                opened, refusal = [], _failure(exc)
            refusal = self._refusal(self._gather(refusal), "map its peers' slots")
        if refusal is not None:
            return self._refuse(refusal)
        self.on_gpu = all(mps for _, mps in every)  # every rank must wait the same way (see _meet)
        self.slots = [slot for slot, _ in opened]
        self.events = [event for _, event in opened]
        self.capacity = capacity
        return True

    def _gather(self, value: Any) -> list[Any]:
        """Every local rank's ``value`` (picklable), in local-rank order."""
        every: list[Any] = [None] * self.local_size
        dist.all_gather_object(every, value, group=self.group)
        return every

    @staticmethod
    def _refusal(said: list[Any], step: str) -> str | None:
        """The first local rank's failure at ``step`` (a text where others said something else), or None."""
        for rank, value in enumerate(said):
            if isinstance(value, str):
                return f"local rank {rank} could not {step} ({value})"
        return None

    def _refuse(self, why: str) -> bool:
        """Keep gloo on this node for good (every local rank with the same ``why``); local rank 0 says why,
        unless the ranks simply sit on several GPUs (then gloo is the plan, not a failure)."""
        self.refused = why
        if self.local_rank == 0 and not why.startswith("different GPUs"):
            warnings.warn(f"CUDA IPC between the ranks sharing a GPU was refused: {why}. Their CUDA tensors are "
                          "reduced over gloo, through host memory (slower).", stacklevel=3)
        return False

    # ---- one allreduce ---------------------------------------------------------------------------------------
    def allreduce(self, buf: torch.Tensor, wire: torch.dtype) -> int:
        """Sum the 1-D CUDA tensor ``buf`` over the node in place, on the current stream, through the slots in
        ``wire`` dtype (``buf``'s own, or fp16/bf16 for a cast). Call :meth:`ready` with ``buf.numel() *
        wire.itemsize`` first. Returns the bytes of this rank's shard in the wire dtype."""
        numel, me, size = buf.numel(), self.local_rank, self.local_size
        self.calls += 1
        stream = torch.cuda.current_stream(buf.device)
        views = [slot[: numel * wire.itemsize].view(wire) for slot in self.slots]
        views[me].copy_(buf)
        self._meet(stream)
        chunk = -(-numel // size)
        lo, hi = min(me * chunk, numel), min((me + 1) * chunk, numel)
        if hi > lo:  # a cast sums in the buffer's own dtype (a copy), then keeps the sum in the wire's
            total = views[me][lo:hi].to(buf.dtype)
            for j in range(size):
                if j != me:
                    total.add_(views[j][lo:hi])
            if wire != buf.dtype:
                views[me][lo:hi].copy_(total)
        self._meet(stream)
        for j in range(size):
            a, b = min(j * chunk, numel), min((j + 1) * chunk, numel)
            if b > a:
                buf[a:b].copy_(views[j][a:b])
        self._meet(stream)  # every rank has read every slot: the next call may write them
        return chunk * wire.itemsize

    def _meet(self, stream: torch.cuda.Stream) -> None:
        """Wait until every local rank's pass so far is done (on the GPU, or on the host: see the module's text).

        The ranks must agree on the way: a rank that only queued its pass and records an event would be read
        too early by a peer that waits on the host and then reads at once."""
        if not self.on_gpu:
            stream.synchronize()
            self.node.exchange((0, 0))  # not None: it answered at set-up
            return
        self.events[self.local_rank].record(stream)
        self.node.exchange((0, 0))
        for j, event in enumerate(self.events):
            if j != self.local_rank:
                stream.wait_event(event)

    # ---- teardown --------------------------------------------------------------------------------------------
    def _let_go(self, leaving: bool = False) -> None:
        """Drop the slots once this rank's work on them is done: its stream waited for the peers' last pass, so
        their reads of this rank's slot are done too (a host sync, only when growing or closing). The peers'
        slots go first; the ranks meet; then each its own: a slot freed while a peer still maps it would outlive
        its owner in torch's IPC bookkeeping ("Producer process has been terminated before all shared CUDA
        tensors released" at exit). ``leaving`` (teardown): a peer that died, never comes within
        ``_LEAVING_S`` or a broken CUDA context ends the wait quietly; growing, they raise."""
        if not self.slots:
            return
        mine = [self.slots[self.local_rank]]  # held past the meeting: the peers' slots go first
        try:
            torch.cuda.synchronize(self.device)
            self.slots, self.events, self.capacity = [], [], 0
            if not leaving:
                self.node.exchange((0, 0))
            elif self.node.bytes is not None:  # its segment still open: closed, there is nobody to meet
                self.node.exchange((0, 0), _LEAVING_S)
        except (RuntimeError, TimeoutError):
            if not leaving:
                raise
        finally:
            self.slots, self.events, self.capacity = [], [], 0
            mine.clear()
        torch.cuda.ipc_collect()

    def close(self) -> None:
        """Unmap everything (the group is going away)."""
        self._let_go(leaving=True)
