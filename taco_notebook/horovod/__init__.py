"""Horovod's PyTorch API (``horovod.torch``) on taco's engine: change the import line, keep the program.

::

    import taco_notebook.horovod as hvd      # instead of: import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(42)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16)
    loss_avg = hvd.allreduce(torch.tensor(loss), name="avg_loss").item()   # averaged, new tensor

Horovod's semantics (out-of-place average by default, ``root_rank=``, ``op=``, handles) over the same engine as
:mod:`taco_notebook.comm` (its process group, allreduce, compressors, fusion and optimizer machinery): a job may
use both. Runs under ``mpiexec -n 4 python train.py`` and in a ``%%taco_run`` cell; imports no IPython.
Where Horovod cannot be matched, docs/horovod-and-ddp.md ("Not matched, and why") says so and why.
"""

from __future__ import annotations

from .basics import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    ReduceOp,
    Sum,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    sycl_built,
)
from .compression import Compression, Compressor
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .gather_ops import (
    allgather,
    allgather_async,
    alltoall,
    alltoall_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
)
from .grouped_ops import grouped_allreduce, grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_
from .mpi_ops import (
    HorovodInternalError,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    join,
    poll,
    synchronize,
)
from .optimizer import DistributedOptimizer
from .scatter_gather import (
    grouped_allgather,
    grouped_allgather_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
)
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "rank",
    "local_size",
    "local_rank",
    "cross_size",
    "cross_rank",
    "is_homogeneous",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "gloo_built",
    "gloo_enabled",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "sycl_built",
    "cuda_built",
    "rocm_built",
    "ReduceOp",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "Compression",
    "Compressor",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "allgather",
    "allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "poll",
    "synchronize",
    "join",
    "barrier",
    "HorovodInternalError",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "sparse_allreduce_async",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "broadcast_object",
    "allgather_object",
    "DistributedOptimizer",
    "SyncBatchNorm",
]
