"""Run under ``mpiexec -n 2``: rank 1 raises after a collective while rank 0 blocks in another allreduce.

``BLOCK_IN`` picks where rank 0 waits: ``mpi`` (an MPI allreduce, which never notices a dead peer by itself)
or ``taco`` (taco's gloo allreduce). Rank 1 prints when it raises, so the test can time the job's end.
"""

from __future__ import annotations

import os
import time

import torch

import taco_notebook.comm as taco
from taco_notebook.comm.group.bootstrap import state

t = torch.ones(3)
taco.allreduce(t)  # the group is up on both ranks
if taco.rank() == 1:
    time.sleep(1.0)  # let rank 0 enter its blocking call first
    print(f"RAISING-AT {time.time():.3f}", flush=True)
    raise RuntimeError("rank 1 fails on purpose")
if os.environ.get("BLOCK_IN", "mpi") == "mpi":
    state.mpi.allreduce(1)
else:
    taco.allreduce(t)
print("RANK-0-FINISHED", flush=True)
