"""One process of a node's shared segment, outside MPI: ``python shm_peers.py MODE RANK SIZE STORE_FILE``.

The processes form a real gloo group over a file store and share a :class:`NodeSegment`. Modes:

``dead``: the last rank exits (code 7) after mapping the segment; the others wait for it in a pass and must
  fail at once with an error naming it, not at the collective timeout (60 s here). They print
  ``RAISED <seconds> <message>``.
``closed``: a one-process group whose segment expects a second local rank that never comes; a thread waits
  in a pass, the main thread closes the segment (what a torn-down group does), and the wait must end with an
  error. Prints ``RAISED <seconds> <message>``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from taco_notebook.comm.transport.shm import NodeSegment

mode, rank, size, store = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size,
                        timeout=timedelta(seconds=60))
group = dist.group.WORLD


def report(began: float, error: BaseException) -> None:
    print(f"RAISED {time.monotonic() - began:.2f} {type(error).__name__}: {error}", flush=True)


if mode == "dead":
    segment = NodeSegment(group, rank, size, f"test{os.getppid()}", timeout_s=60)
    assert segment.prepare(4096, 1)
    if rank == size - 1:
        os._exit(7)
    buf = torch.ones(1024)
    began = time.monotonic()
    try:
        segment.copy_in(buf, 0, 1024, 0)
        segment.sum_slots(buf.dtype, 0, 1024, segment.output(buf.dtype, 0, 1024), 0)
    except RuntimeError as error:
        report(began, error)
    os._exit(0)  # the group has a dead member: do not wait for it in destroy_process_group

if mode == "closed":
    segment = NodeSegment(group, 0, 2, f"test{os.getpid()}", timeout_s=60)  # local rank 1 never comes
    assert segment.prepare(4096, 1)
    failed: list[BaseException] = []
    began = time.monotonic()

    def wait() -> None:
        try:
            segment.copy_in(torch.ones(8), 0, 8, 0)
            segment.sum_slots(torch.float32, 0, 8, segment.output(torch.float32, 0, 8), 0)
        except RuntimeError as error:
            failed.append(error)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    segment.close()
    waiter.join(10)
    assert not waiter.is_alive() and failed, "the wait outlived the segment"
    report(began, failed[0])
    dist.destroy_process_group()
