"""Bring up torch.distributed from MPI, and tear it down again.

The ranks meet through :mod:`.rendezvous` (a FileStore in a private directory on one host, a TCPStore bound to
the job's interface across hosts; its name or address agreed over MPI), so nothing is hard-coded and two jobs on
one machine never collide. The process group can be destroyed and built again without restarting the processes
(after an interrupted cell, or when membership changes): the process's state is :data:`.state.state`, and
``shutdown()`` runs the teardown callbacks that modules building on the group registered there. ``init()`` reads
the collective timeout, ``taco.configure(collective_timeout=...)`` (default ``TACO_COLLECTIVE_TIMEOUT``, 1800 s).

Works under ``%%taco_run`` and under plain ``mpiexec -n 4 python train.py`` alike; imports no IPython.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

from ..diagnostics import board, excepthook
from ..state import ProcessState, state
from . import rendezvous
from .topology import Topology

__all__ = ["CommState", "state", "init", "start_group", "shutdown", "abort", "reinit", "is_initialized",
           "default_backend", "device"]


# How long shutdown()'s rendezvous creator waits for its peers to let go of the FileStore before removing its
# directory (all ranks shut down together: milliseconds; a peer that is gone costs this much once).
_PEERS_CLOSE_S = 2.0


def default_backend() -> str:
    """gloo without CUDA; with CUDA one backend per device type: ``cpu:gloo,cuda:nccl`` (a GPU per rank)
    or ``cpu:gloo,cuda:gloo`` (``--gpus shared``, or ``auto`` sharing a node's GPUs), so CPU and CUDA tensors
    share one process group. The rank's placement decides once it is made: only it knows whether ``auto`` shares."""
    import torch

    from .placement import backend_for, current, gpu_mode

    placed = current()
    if placed is not None:
        return placed.backend
    mode = gpu_mode()
    return backend_for(mode, mode != "none" and torch.cuda.is_available())


CommState = ProcessState  # an alias kept for code that imports it


def is_initialized() -> bool:
    """True when the torch process group is up."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _placed_backend(topology: Topology) -> str:
    """Place this rank (``--gpus``/``TACO_GPUS``; may raise PlacementError) and return its backend string."""
    from .placement import resolve

    return resolve(topology.local_rank, topology.local_size).backend


def _pick_device(backend: str, topology: Topology) -> Any:
    """The rank's device: its placed GPU, else (an explicit NCCL backend) the local rank's, else the CPU."""
    import torch

    from .placement import current

    placed = current()
    if placed is not None and placed.gpu is not None:
        return torch.device("cuda", placed.gpu)
    if backend.split(":")[-1].startswith("nccl") and torch.cuda.is_available():
        device = torch.device("cuda", topology.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def device() -> Any:
    """This rank's ``torch.device`` (``cuda:i`` of its placed GPU, or ``cpu``), without needing the group."""
    if state.device is None:
        topology = state.ensure_topology()
        placed = _placed_backend(topology)
        return _pick_device(os.environ.get("TACO_BACKEND") or placed, topology)
    return state.device


def init(
    backend: str | None = None, timeout: float | None = None, intra_size: int | None = None
) -> Topology:
    """Create the torch process group over all MPI ranks (collective: every rank must call it).

    Calling it again while the group is up returns the current topology and does nothing else.
    """
    from ..config import settings

    if state.membership is not None and not is_initialized():
        raise RuntimeError(f"rank {state.topology.rank if state.topology else '?'}'s process group is down and "
                           "its members were chosen by the notebook (elastic: ranks left or joined), not by "
                           "MPI: run the cell with %%taco_run --elastic, which rebuilds it over the live ranks")
    topology = state.ensure_topology(intra_size)
    if is_initialized():
        return topology
    placed = _placed_backend(topology)  # before the group: pins the GPU, or fails naming the node
    backend = backend or os.environ.get("TACO_BACKEND") or placed
    seconds = settings().collective_timeout if timeout is None else timeout  # TACO_COLLECTIVE_TIMEOUT
    meeting = rendezvous.create(state.mpi, seconds)
    start_group(meeting, topology, backend, seconds)
    return topology


def start_group(meeting: rendezvous.Rendezvous, topology: Topology, backend: str, seconds: float,
                device: Any = None) -> None:
    """The process group of ``topology``'s ranks through ``meeting``'s store (collective over those ranks).

    :func:`init` calls it with MPI's ranks; :mod:`.membership` with ranks the notebook chose. ``device``: keep
    this one (a rebuilt group keeps the rank's GPU) instead of picking it from the placement.
    """
    import torch.distributed as dist

    try:
        dist.init_process_group(backend, store=meeting.store, rank=topology.rank, world_size=topology.size,
                                timeout=timedelta(seconds=seconds))
    except BaseException:
        meeting.close()
        raise
    excepthook.install()  # outermost again: torch's init wrapped sys.excepthook in its own
    state.store, state.rendezvous = meeting.store, meeting
    state.board = board.open_board(meeting, topology.rank, topology.size)  # the stall watchdog's (stall.py)
    state.stalled = None  # a group rebuilt after a stall works again
    state.backend = backend
    if state.generation == 0:
        # Destroy the group before the interpreter tears torch down: a group left to C++ destructors at exit
        # can abort the process ("terminate called without an active exception") after a clean run.
        atexit.register(shutdown)
    state.device = device if device is not None else _pick_device(backend, topology)
    state.generation += 1
    state.group_started()  # taco's own world group among them (algorithms.world_group)


def shutdown() -> None:
    """Destroy the process group (collective) and run the state's teardown callbacks. Safe when none exists."""
    _shutdown(_PEERS_CLOSE_S)


def _shutdown(rendezvous_wait_s: float) -> None:
    import torch.distributed as dist

    if is_initialized():
        dist.destroy_process_group()  # every group, the 2D algorithm's subgroups included
    state.teardown(rendezvous_wait_s)  # what was built on the group (algorithms' groups and thread) goes too


_HOLD_GROUPS = ("torch/distributed", "taco_notebook/comm")  # code whose frames hold process groups


def abort() -> None:
    """Drop this rank's process group at once so peers blocked on it in a collective fail instead of waiting.

    Not collective: called on ranks that already stopped while their peers may still be blocked. A group's
    sockets close only when its last reference goes, and the frames of a failed collective, kept by the
    traceback of the error, hold it as a local: those frames are cleared first.

    Why walk the garbage collector instead of asking torch to abort: in torch 2.13 a gloo group's
    ``ProcessGroup.abort()``, its backend's ``abort()`` and ``shutdown()``, and ``_abort_process_group()``
    (documented as NCCL only) all return at once but leave gloo's pair sockets open, so a peer blocked in a
    collective stays blocked until this process drops its last reference to the group or exits
    (tests/mpi/gloo_abort.py; ``test_torch_abort_does_not_release_a_gloo_peer`` fails the day torch closes
    them, and this walk can then go). Only the C++ destructor closes the sockets, and the references that
    keep it alive are in frames we do not own (the traceback kept by IPython, ipyparallel or the comm
    thread's future): we cannot know every holder, but we know which code holds groups, so frames of that
    code are cleared. Generators and coroutines are skipped (clearing a suspended one closes it), and frames
    still executing cannot be cleared (the comm thread, if blocked, is abandoned on teardown instead).
    """
    import gc
    import inspect
    import types

    skip = inspect.CO_GENERATOR | inspect.CO_COROUTINE  # clearing a suspended generator would close it
    for obj in gc.get_objects():
        # type(), not isinstance(): that asks every object for __class__, and torch's deprecated ones warn
        if (type(obj) is types.FrameType and not obj.f_code.co_flags & skip
                and any(part in obj.f_code.co_filename.replace("\\", "/") for part in _HOLD_GROUPS)):
            try:
                obj.clear()
            except RuntimeError:  # still executing
                pass
    _shutdown(0.0)  # peers are blocked or failing: do not wait for them to let go of the store
    gc.collect()


def reinit(backend: str | None = None, timeout: float | None = None) -> Topology:
    """Rebuild the process group from scratch, for example after an interrupted collective."""
    previous = backend or state.backend
    shutdown()
    return init(previous, timeout)
