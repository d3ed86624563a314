"""Run under ``mpiexec -n 2``: does torch's own abort of a gloo group release a peer blocked on it?

Rank 1 calls ``_abort_process_group()`` (which calls ``ProcessGroup.abort()`` on every group) while keeping
its references, then stays alive ``HOLD_S`` seconds; rank 0 is blocked in an ``all_reduce`` and prints how
long it stayed blocked. If the abort closed rank 1's sockets, rank 0 is released at once; if they close only
when rank 1 drops its last reference (after ``HOLD_S``), rank 0 waits that long. Why bootstrap.abort() clears
frames instead of calling torch's abort (see its docstring).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import taco_notebook.comm as taco

HOLD_S = float(os.environ.get("HOLD_S", "8"))

taco.init()
t = torch.ones(3)
dist.all_reduce(t)  # the group works on both ranks
group = dist.group.WORLD  # a reference kept, as a failed collective's frames keep one
if taco.rank() == 1:
    time.sleep(1.0)  # let rank 0 block first
    dist.distributed_c10d._abort_process_group()
    print("ABORTED", flush=True)
    time.sleep(HOLD_S)
    del group  # the last reference: now the sockets close (a normal exit would close them too)
else:
    began = time.monotonic()
    try:
        dist.all_reduce(t)
        print("RANK-0-RETURNED", flush=True)
    except RuntimeError as exc:
        print(f"RELEASED-AFTER {time.monotonic() - began:.2f} {str(exc)[:80]!r}", flush=True)
    del group
# both ranks leave normally: MPI finalizes and removes its shared memory, atexit destroys the group
