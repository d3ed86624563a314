"""Horovod's process-level calls over comm/'s process state: init, shutdown, rank and size, what is built.

``hvd.init()`` is ``taco_notebook.comm.init()`` (the same torch process group, from MPI), so a program that mixes
``taco.*`` and ``hvd.*`` calls has one job, not two. Unlike comm/, which brings the group up on first use,
every call here except :func:`init`, :func:`is_initialized` and the ``*_built`` queries raises Horovod's own
``ValueError`` before ``init()``: a Horovod program that forgot ``hvd.init()`` fails at once, never hangs.

Reduction ops are Horovod's (``Average``, ``Sum``, ``Adasum``, ``Min``, ``Max``, ``Product``: an ``IntEnum``
with Horovod's values); :func:`reduce_op` turns one, or the older ``average=`` flag, into comm/'s op name.
"""

from __future__ import annotations

import enum
import itertools
import warnings
from typing import Any

from ..comm.collectives.groups import SubGroup, new_group
from ..comm.group import bootstrap
from ..comm.state import state

__all__ = ["ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product", "ProcessSet", "global_process_set",
           "NOT_INITIALIZED", "init", "shutdown", "is_initialized", "check_initialized", "size", "rank",
           "local_size", "local_rank", "cross_size", "cross_rank", "is_homogeneous", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built", "ccl_built",
           "sycl_built", "cuda_built", "rocm_built", "reduce_op", "warn_once", "check_process_set", "add_process_set",
           "remove_process_set"]

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


class ReduceOp(enum.IntEnum):
    """Horovod's reduction ops, with Horovod's numbers (``hvd.Average == 0`` as in ``horovod.common``)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average, Sum, Adasum = ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM
Min, Max, Product = ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT

_COMM_OPS = {ReduceOp.AVERAGE: "avg", ReduceOp.SUM: "sum", ReduceOp.MIN: "min", ReduceOp.MAX: "max",
             ReduceOp.PRODUCT: "product"}

ADASUM_UNSUPPORTED = ("hvd.Adasum is not implemented by taco_notebook.horovod: Adasum's adaptive summation needs "
                      "pairwise dot products inside the reduction, which taco's allreduce does not do; use "
                      "op=hvd.Average (the default) and scale the learning rate by hvd.size(), as Horovod's "
                      "examples do without --use-adasum")


def reduce_op(op: Any, average: bool | None = None) -> ReduceOp:
    """Horovod's rule for ``op=`` and the deprecated ``average=``: one of them, ``Average`` when neither."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    if op is None:
        return ReduceOp.AVERAGE
    try:
        found = ReduceOp(op)
    except ValueError:
        raise ValueError(f"op must be one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product; "
                         f"got {op!r}") from None
    if found is ReduceOp.ADASUM:
        raise NotImplementedError(ADASUM_UNSUPPORTED)
    return found


def comm_op(op: ReduceOp) -> str:
    """comm/'s name of a (non-Adasum) Horovod op."""
    return _COMM_OPS[op]


class ProcessSet:
    """Horovod's process set: some ranks that run collectives among themselves (``process_set=`` on every op).

    ``ProcessSet([0, 2])`` names the ranks; :func:`add_process_set` (collective over every rank) makes it
    usable, over a torch.distributed group of those ranks (:mod:`taco_notebook.comm.collectives.groups`).
    """

    def __init__(self, ranks: Any = None) -> None:
        self.ranks: list[int] | None = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id: int | None = 0 if ranks is None else None
        self.group: SubGroup | None = None

    def size(self) -> int:
        """Number of ranks in the set."""
        return size() if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set, or -1 when it is not in it."""
        me = rank()
        return me if self.ranks is None else (self.ranks.index(me) if me in self.ranks else -1)

    def included(self) -> bool:
        """Whether this process is in the set."""
        return self.ranks is None or rank() in self.ranks

    def __repr__(self) -> str:
        if self.ranks is None:
            return "ProcessSet(process_set_id=0, ranks=all)"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()
_process_sets: dict[int, ProcessSet] = {0: global_process_set}
_next_id = itertools.count(1)


def add_process_set(process_set: Any) -> ProcessSet:
    """Make ``process_set`` (a :class:`ProcessSet` or a list of ranks) usable; collective over every rank,
    which all pass the same ranks, in the same order of calls. Returns the set."""
    check_initialized()
    found = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if found.ranks is None or found.process_set_id is not None:
        raise ValueError(f"{found!r} was added already")
    if any(other.ranks == found.ranks for other in _process_sets.values()):
        raise ValueError(f"a process set with ranks {found.ranks} exists already")
    found.group = new_group(found.ranks)
    found.process_set_id = next(_next_id)
    _process_sets[found.process_set_id] = found
    return found


def remove_process_set(process_set: ProcessSet) -> bool:
    """Forget ``process_set`` (every rank calls it); False for the global set or one that was not added."""
    check_initialized()
    if process_set is global_process_set or _process_sets.get(process_set.process_set_id or -1) is not process_set:
        return False
    del _process_sets[process_set.process_set_id]  # type: ignore[arg-type]
    process_set.process_set_id, process_set.group = None, None
    return True


def check_process_set(process_set: Any) -> SubGroup | None:
    """The comm/ group of ``process_set`` (None: every rank), or a ValueError naming what is wrong with it."""
    if process_set is None or process_set is global_process_set:
        return None
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be an hvd.ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id is None or process_set.group is None:
        raise ValueError(f"{process_set!r} was not added (or was removed): call hvd.add_process_set() on every "
                         "rank first")
    if not process_set.included():
        raise ValueError(f"rank {rank()} is not in {process_set!r}")
    return process_set.group


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Warn with ``message`` the first time ``key`` is seen in this process (arguments with no equivalent)."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Bring up the job over every MPI rank (collective); a no-op when it is up already.

    ``comm``: only ``None`` or MPI's world communicator (or all its ranks as a list) are accepted.
    """
    if comm is not None:
        from mpi4py import MPI

        everyone = list(range(MPI.COMM_WORLD.Get_size()))
        if not (comm == MPI.COMM_WORLD or (isinstance(comm, list | tuple) and sorted(comm) == everyone)):
            raise NotImplementedError("hvd.init(comm=...) accepts only MPI.COMM_WORLD (or every rank): "
                                      "taco_notebook.horovod runs over the whole MPI job")
    bootstrap.init()
    for process_set in process_sets or ():  # Horovod's static process sets
        if not (isinstance(process_set, ProcessSet) and process_set.process_set_id is not None):
            add_process_set(process_set)


def shutdown() -> None:
    """Tear the job's process group down (collective); ``init()`` may build it again."""
    bootstrap.shutdown()


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return bootstrap.is_initialized()


def check_initialized() -> None:
    """Raise Horovod's ``ValueError`` unless ``init()`` ran."""
    if not bootstrap.is_initialized():
        raise ValueError(NOT_INITIALIZED)


def _topology() -> Any:
    check_initialized()
    return state.ensure_topology()


def size() -> int:
    """Number of ranks in the job."""
    return int(_topology().size)


def rank() -> int:
    """This process's rank, 0..size()-1."""
    return int(_topology().rank)


def local_size() -> int:
    """Number of ranks on this node."""
    return int(_topology().local_size)


def local_rank() -> int:
    """This rank's index on its node."""
    return int(_topology().local_rank)


def _cross_nodes() -> list[int]:
    """The nodes that have a rank with this rank's local rank (Horovod's cross communicator)."""
    topo = _topology()
    return [node for node, ranks in enumerate(topo.node_ranks) if len(ranks) > topo.local_rank]


def cross_size() -> int:
    """Number of nodes with a rank of this local rank (the number of nodes on an even job)."""
    return len(_cross_nodes())


def cross_rank() -> int:
    """This rank's node index among :func:`cross_size` nodes."""
    return _cross_nodes().index(_topology().node)


def is_homogeneous() -> bool:
    """True when every node runs the same number of ranks."""
    return len({len(ranks) for ranks in _topology().node_ranks}) == 1


def mpi_built() -> bool:
    """True: ranks are MPI processes (mpi4py), which start the job and exchange its rendezvous."""
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """False: tensors travel over torch.distributed (gloo, NCCL), not MPI; MPI only starts the job."""
    return False


def mpi_threads_supported() -> bool:
    """Whether the MPI library runs with ``MPI_THREAD_MULTIPLE``."""
    check_initialized()
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def gloo_built() -> bool:
    """True when torch has the gloo backend (CPU tensors always travel over it)."""
    import torch.distributed as dist

    return bool(dist.is_gloo_available())


def gloo_enabled() -> bool:
    """True when this job's process group uses gloo for some device."""
    return "gloo" in (state.backend or bootstrap.default_backend())


def nccl_built() -> int:
    """NCCL's version as Horovod reports it (e.g. 22805 for 2.28.5), or 0 without CUDA or NCCL."""
    import torch
    import torch.distributed as dist

    if not (dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()[:3]
    return int(major * 10000 + minor * 100 + patch)


def ddl_built() -> bool:
    """False: IBM DDL is not used."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not used."""
    return False


def sycl_built() -> bool:
    """False: no SYCL (Intel GPU) build; Horovod's tests ask it before using process sets with oneCCL."""
    return False


def cuda_built() -> bool:
    """True when torch was built with CUDA."""
    import torch

    return torch.version.cuda is not None


def rocm_built() -> bool:
    """True when torch was built with ROCm."""
    import torch

    return getattr(torch.version, "hip", None) is not None
