"""Which GPU each rank uses, decided per node before anything initialises CUDA, and the backend that follows.

Four modes (``--gpus`` of ``%%taco_run`` / ``%taco_cluster start``, ``TACO_GPUS`` under plain ``mpiexec``):

``auto`` (default)
    one GPU per local rank, pinned, CUDA tensors over NCCL, where the node has as many GPUs as ranks; where it
    has fewer (but some), the ranks share them as ``shared`` does, and the notebook says so once
    (:func:`sharing_notice`). A node without GPUs runs on CPU. So every box runs the same notebook.
``exclusive``
    ``auto`` without the sharing: a node with fewer GPUs than ranks is an error (:func:`too_few_message`),
    because NCCL refuses two ranks on one GPU ("Duplicate GPU detected"). For who would rather be told.
``shared``
    several ranks may share a GPU (local rank modulo GPU count); CUDA tensors then go over gloo, which handles
    them correctly where NCCL cannot.
``none``
    the ranks see no GPU at all (``CUDA_VISIBLE_DEVICES=""``).

:func:`decide` is pure (tested over node GPU counts); :func:`apply_from_env` applies the decision at import
under a launcher that tells each rank its local rank (hydra, Open MPI, Slurm), so the device is pinned before
user code can touch CUDA; :func:`resolve` finishes the job at ``taco.init()`` with MPI's own topology.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["GPU_MODES", "Placement", "PlacementError", "check_gpus", "decide", "backend_for", "gpu_mode",
           "launcher_local", "apply_from_env", "resolve", "current", "node_gpu_count", "shares_gpus",
           "sharing_notice", "too_few_message"]

GPU_MODES = ("auto", "exclusive", "shared", "none")
_LOCAL_ENV = (("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # mpich/hydra
              ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI
              ("SLURM_LOCALID", None))  # srun: the local size is derived from SLURM_TASKS_PER_NODE


class PlacementError(RuntimeError):
    """``--gpus exclusive`` on a node with fewer GPUs than ranks (and what to do instead)."""


@dataclass(frozen=True)
class Placement:
    """One rank's decision: the GPU index it uses (None = CPU) and the backend string for its process group."""

    mode: str
    gpu: int | None
    backend: str
    hide_gpus: bool = False  # set CUDA_VISIBLE_DEVICES="" before CUDA starts

    @property
    def device(self) -> str:
        return "cpu" if self.gpu is None else f"cuda:{self.gpu}"


def check_gpus(mode: str | None) -> str:
    """The mode, lower-cased; None means ``TACO_GPUS`` or ``auto``. Raises ValueError naming the choices."""
    given = mode if mode is not None else os.environ.get("TACO_GPUS") or "auto"
    chosen = given.strip().lower()
    if chosen not in GPU_MODES:
        raise ValueError(f"--gpus must be one of {', '.join(GPU_MODES)}, got {given!r}"
                         + ("" if mode is not None else " (from TACO_GPUS)"))
    return chosen


def gpu_mode() -> str:
    """This rank's mode, from ``TACO_GPUS`` (default ``auto``)."""
    return check_gpus(None)


def backend_for(mode: str, cuda: bool) -> str:
    """The process-group backend: gloo alone without CUDA, else one backend per device type.

    ``mode`` is the one in effect: ``shared`` also for ``auto`` on a node it shares (:func:`shares_gpus`).

    >>> backend_for("auto", True)
    'cpu:gloo,cuda:nccl'
    """
    if not cuda or mode == "none":
        return "gloo"
    return "cpu:gloo,cuda:gloo" if mode == "shared" else "cpu:gloo,cuda:nccl"


def shares_gpus(mode: str, node_gpus: int, local_size: int) -> bool:
    """True where ``auto`` puts several of a node's ranks on one GPU: some GPUs, but fewer than ranks."""
    return mode == "auto" and 0 < node_gpus < local_size


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'s' if count != 1 else ''}"


def too_few_message(node: str, gpus: int, local_size: int) -> str:
    """Why ``--gpus exclusive`` refuses a node, and the ways out."""
    return (f"node {node} has {_plural(gpus, 'GPU')} but {local_size} ranks were asked for on it, and --gpus "
            f"exclusive gives each rank a GPU of its own (NCCL cannot share one). Either pass --gpus auto (ranks "
            f"share the GPUs, CUDA tensors go over gloo; TACO_GPUS=auto under mpiexec), --gpus none (train on CPU; "
            f"TACO_GPUS=none), or ask for at most {_plural(gpus, 'rank')} per node.")


def sharing_notice(node: str, gpus: int, local_size: int, nodes: int = 1, cluster_nodes: int = 1) -> str:
    """The one line the notebook shows when ``--gpus auto`` shares GPUs: what, what it costs, the alternatives.

    ``node`` names the node that shares (the first of ``nodes`` that do); ``cluster_nodes``: the cluster's nodes,
    all of them (``-np`` alone fixes the ranks per node only on one).

    >>> sharing_notice("vm", 1, 4)[:60]
    '--gpus auto: node vm has 1 GPU for 4 ranks, so the ranks sha'
    """
    where = f"node {node} has" if nodes == 1 else f"{nodes} nodes (first: {node}) have"
    it = "it" if gpus == 1 else "them"
    fewer = f"-np {gpus}" if cluster_nodes == 1 else f"at most {_plural(gpus, 'rank')} per node"
    if gpus == 1 and cluster_nodes == 1:  # one GPU for the whole job: its allreduce runs in the GPU's memory
        how = ("NCCL cannot run two ranks on one GPU: their allreduce runs in its memory (CUDA IPC), other "
               "collectives and TopK/PowerSGD go over gloo through host memory (slower than NCCL)")
    else:
        how = ("NCCL cannot run two ranks on one GPU, so CUDA tensors go over gloo through host memory (slower "
               "than NCCL)")
    return (f"--gpus auto: {where} {_plural(gpus, 'GPU')} for {local_size} ranks, so the ranks share {it}. "
            f"{how}. Instead: {fewer} (a GPU per rank, NCCL), --gpus none (CPU only), or --gpus exclusive "
            f"(refuse rather than share).")


def decide(mode: str, local_rank: int, local_size: int, node_gpus: int, node: str = "this node") -> Placement:
    """Place one rank. Pure: ``node_gpus`` is what the rank can see (``CUDA_VISIBLE_DEVICES`` applied).

    >>> decide("auto", 1, 2, 4).device
    'cuda:1'
    >>> decide("auto", 3, 4, 1).backend  # fewer GPUs than ranks: shared, so gloo carries CUDA tensors
    'cpu:gloo,cuda:gloo'
    """
    mode = check_gpus(mode)
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local rank {local_rank} is outside 0..{local_size - 1}")
    if mode == "none":
        return Placement(mode, None, "gloo", hide_gpus=True)
    if node_gpus <= 0:
        return Placement(mode, None, "gloo")
    if mode == "exclusive" and node_gpus < local_size:
        raise PlacementError(too_few_message(node, node_gpus, local_size))
    effective = "shared" if shares_gpus(mode, node_gpus, local_size) else mode
    return Placement(mode, local_rank % node_gpus, backend_for(effective, True))


def launcher_local(env: dict[str, str] | os._Environ[str] | None = None) -> tuple[int, int] | None:
    """(local rank, local size) as the launcher tells them, or None when it does not."""
    env = os.environ if env is None else env
    for rank_key, size_key in _LOCAL_ENV:
        if rank_key not in env:
            continue
        try:
            rank = int(env[rank_key])
            if size_key is not None:
                return rank, int(env[size_key])
            per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")  # "4(x2),3"
            node = int(env.get("SLURM_NODEID", "0"))
            counts = [int(part.split("(")[0]) for part in per_node.split(",")
                      for _ in range(int(part.split("(x")[1].rstrip(")")) if "(x" in part else 1)]
            return rank, counts[node]
        except (ValueError, IndexError):
            return None
    return None


def node_gpu_count(allow_cuda: bool = False) -> int:
    """GPUs this rank sees: from /proc (no CUDA init); with ``allow_cuda``, torch's count where /proc has none."""
    from .hardware import visible_gpus

    found = visible_gpus()
    if found == 0 and allow_cuda and os.environ.get("CUDA_VISIBLE_DEVICES", None) != "":
        import torch

        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return found


_current: Placement | None = None
_deferred_error: PlacementError | None = None


def _cuda_started() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def _apply(placement: Placement) -> Placement:
    global _current
    if placement.hide_gpus:
        if _cuda_started():
            raise PlacementError("--gpus none: CUDA was already initialised in this process before taco could "
                                 "hide the GPUs; start the ranks with TACO_GPUS=none (or CUDA_VISIBLE_DEVICES=\"\")")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif placement.gpu is not None:
        import torch

        torch.cuda.set_device(placement.gpu)  # before user code creates tensors on the default device
    _current = placement
    return placement


def apply_from_env() -> Placement | None:
    """Decide and pin from the launcher's local rank at import, before user code touches CUDA.

    Does nothing when the launcher gives no local rank (``resolve`` decides later from MPI). A node with too
    few GPUs for ``exclusive`` is remembered and raised by ``resolve`` (at ``taco.init()``), not at import.
    """
    global _deferred_error
    if _current is not None:
        return _current
    local = launcher_local()
    try:
        mode = gpu_mode()
    except ValueError:
        return None  # reported by resolve(), where an error can be seen
    if local is None:  # not a launched rank (the notebook's kernel imports this too): decide at init()
        return None
    gpus = node_gpu_count()
    if gpus == 0 and mode != "none":
        return None  # nothing to pin; resolve() may still find CUDA through torch
    try:
        return _apply(decide(mode, local[0], local[1], gpus, _node()))
    except PlacementError as exc:
        _deferred_error = exc
        return None


def _node() -> str:
    from .topology import node_name

    return node_name()


def resolve(local_rank: int, local_size: int) -> Placement:
    """The rank's placement at ``taco.init()``: what import already applied, else decided now (may raise)."""
    if _deferred_error is not None:
        raise _deferred_error
    if _current is not None:
        return _current
    mode = gpu_mode()
    return _apply(decide(mode, local_rank, local_size, node_gpu_count(allow_cuda=mode != "none"), _node()))


def current() -> Placement | None:
    """The placement applied in this process, if any yet."""
    return _current


def _reset_for_tests() -> Any:
    """Forget the applied placement (tests decide several times in one process)."""
    global _current, _deferred_error
    _current, _deferred_error = None, None
