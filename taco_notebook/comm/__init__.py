"""The engine-side API, known as ``taco`` inside a ``%%taco_run`` cell.

Importable without IPython, so the same code runs under ``mpiexec -n 4 python train.py``::

    import taco_notebook.comm as taco
    t = torch.full((3,), float(taco.rank()))
    taco.allreduce(t)          # sum over ranks, in place
"""

from __future__ import annotations

from ..errors import StallError
from .collectives import algorithms as _algorithms  # noqa: F401, I001 - registers taco's world group on group start
from .collectives.groups import SubGroup, new_group
from .collectives.ops import (
    REDUCE_OPS,
    allgather,
    allreduce,
    allreduce_async,
    alltoall,
    barrier,
    broadcast,
    broadcast_parameters,
)
from .collectives.scatter import reduce_scatter, reduce_scatter_async
from .compression.compressors import parse_compression
from .compression.spec import CompressionSpec
from .config import configure, settings
from .diagnostics import excepthook as _excepthook
from .diagnostics import metrics, stall
from .diagnostics.progress import progress
from .group import placement
from .group import rendezvous as _rendezvous
from .group.bootstrap import device, init, is_initialized, reinit, shutdown
from .group.topology import Topology

placement.apply_from_env()  # pin this rank's GPU (or hide them) before the user's code can touch CUDA

__all__ = [
    "Topology",
    "REDUCE_OPS",
    "reduce_scatter",
    "new_group",
    "SubGroup",
    "reduce_scatter_async",
    "init",
    "shutdown",
    "reinit",
    "is_initialized",
    "topology",
    "rank",
    "size",
    "local_rank",
    "device",
    "local_size",
    "node",
    "num_nodes",
    "allreduce",
    "allreduce_async",
    "configure",
    "settings",
    "parse_compression",
    "CompressionSpec",
    "metrics",
    "progress",
    "DistributedOptimizer",
    "tune",
    "hooks",
    "broadcast",
    "allgather",
    "alltoall",
    "barrier",
    "broadcast_parameters",
    "StallError",
    "stall",
    "elastic",
    "check_replicas",
]

_excepthook.install()  # under plain mpiexec an uncaught exception on one rank ends the whole job (excepthook.py)
_rendezvous.keep_mpi_local()  # a one-host plain mpiexec job's MPI opens no listener on the LAN (rendezvous.py)


def topology() -> Topology:
    """This rank's placement (from MPI; does not need the process group)."""
    from .state import state

    return state.ensure_topology()


def rank() -> int:
    """Global rank, 0..size()-1 (equals the ipyparallel engine id under ``%%taco_run``)."""
    return topology().rank


def size() -> int:
    """Number of ranks in the job."""
    return topology().size


def local_rank() -> int:
    """Rank within this node; with ``--gpus auto`` it is also the index of the rank's GPU (:func:`device`)."""
    return topology().local_rank


def local_size() -> int:
    """Number of ranks on this node."""
    return topology().local_size


def node() -> int:
    """Index of this rank's node, 0..num_nodes()-1."""
    return topology().node


def num_nodes() -> int:
    """Number of nodes in the job."""
    return topology().num_nodes


def __getattr__(name: str) -> object:
    # The training APIs import more of torch (optim, nn): loaded on first use.
    if name == "tune":  # the compression advisor (advisor.py); a module named tune would shadow the function
        from .training.advisor import tune

        return tune
    if name == "DistributedOptimizer":
        from .training.optimizer import DistributedOptimizer

        return DistributedOptimizer
    if name == "check_replicas":
        from .diagnostics.replicas import check_replicas

        return check_replicas
    if name in ("hooks", "elastic"):
        import importlib

        return importlib.import_module(f".training.{name}", __name__)
    raise AttributeError(f"module 'taco_notebook.comm' has no attribute {name!r}")
