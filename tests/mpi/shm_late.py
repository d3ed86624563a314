"""One process of a node's shared segment, outside MPI: ``python shm_late.py RANK SIZE STORE_FILE``.

The processes form a real gloo group over a file store and share a :class:`NodeSegment`. Rank 0 exits as soon
as it has offered the segment; the last rank opens it only once rank 0 is gone, and must raise at once, naming
what it could not map (MPI would end the job for us before we could look). It prints
``RAISED <seconds> <message>``.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from taco_notebook.comm.transport import shm, shmsetup

rank, size, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size,
                        timeout=timedelta(seconds=60))


def exit_once_offered(broadcast: Any) -> Any:
    def wrapped(objects: list[Any], *args: Any, **kwargs: Any) -> Any:
        done = broadcast(objects, *args, **kwargs)
        if objects and isinstance(objects[0], shmsetup.Offer):
            os._exit(3)
        return done
    return wrapped


def once_gone(opener: Any) -> Any:
    def wrapped(pid: int, *args: Any) -> Any:
        deadline = time.monotonic() + 20
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.01)
        return opener(pid, *args)
    return wrapped


if rank == 0:
    dist.broadcast_object_list = exit_once_offered(dist.broadcast_object_list)
if rank == size - 1:
    shmsetup.open_held = once_gone(shmsetup.open_held)  # type: ignore[assignment]
segment = shm.NodeSegment(dist.group.WORLD, rank, size, f"late{os.getppid()}", timeout_s=60)
began = time.monotonic()
try:
    segment.prepare(4096, 1)
except RuntimeError as error:
    print(f"RAISED {time.monotonic() - began:.2f} {type(error).__name__}: {error}", flush=True)
os._exit(0)  # the group has a dead member: do not wait for it in destroy_process_group
