"""Run under ``mpiexec -n N`` on one host: one rank faults while the ranks use the node's shared segment.

``python shm_faults.py FAULT STAGE VICTIM [by-path]``

FAULT: ``kill`` (SIGKILL itself), ``stop`` (SIGSTOP itself; the test then kills the job), ``raise`` (an exception
out of the rank's code), ``late`` (no fault: the victim waits 2 s there, once, and every rank must still finish)
or ``none``.
STAGE: ``before`` the first collective; ``create`` while a segment is made (rank 0: made, not yet offered; the
others: about to open it); ``mid`` during allreduces that grow the segment again and again (a timer); ``after``
those allreduces, before the next collective.
``by-path``: the ranks cannot open rank 0's fd, so they open the segment by its name (the fallback).

Every rank writes ``PID <rank> <pid> <the /dev/shm files it maps>`` first (MPI's own, which a killed job leaves
behind: the test removes them), the victim ``FAULT <rank>`` just before it faults, and a rank that
gets through ``DONE <rank>``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import taco_notebook.comm as taco
from taco_notebook.comm.transport import shmsetup

FAULT, STAGE, VICTIM = sys.argv[1], sys.argv[2], int(sys.argv[3])
BY_PATH = "by-path" in sys.argv[4:]


def say(line: str) -> None:
    """One write per line: the ranks share mpiexec's stdout."""
    os.write(1, (line + "\n").encode())


def fault() -> None:
    if FAULT == "none":
        return
    say(f"FAULT {rank}")
    if FAULT == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif FAULT == "stop":
        while True:  # stopped again if continued (the kernel continues a stopped orphaned process group)
            os.kill(os.getpid(), signal.SIGSTOP)
    elif FAULT == "late":
        time.sleep(2.0)
        globals()["FAULT"] = "none"
        return
    raise RuntimeError(f"rank {rank} fails on purpose at stage {STAGE}")


def at_offer(broadcast: Any) -> Any:
    """Rank 0's broadcast, faulting first when it offers a new segment (made, not yet opened by the others; with
    ``by-path``, an offer by name)."""
    def wrapped(objects: list[Any], *args: Any, **kwargs: Any) -> Any:
        if objects and isinstance(objects[0], shmsetup.Offer) and objects[0].by_path == BY_PATH:
            fault()
        return broadcast(objects, *args, **kwargs)
    return wrapped


def before_open(opener: Any) -> Any:
    def wrapped(*args: Any) -> Any:
        fault()
        return opener(*args)
    return wrapped


def refuse(*args: Any) -> int:
    raise PermissionError("opening another process's fd is refused here (the test's fallback)")


def grow(rounds: int, arm_at: int | None = None) -> None:
    """Allreduces of 64 KiB up to 16 MiB, each size growing the segment once, then 16 MiB again; exact sums.
    ``arm_at``: at that step, a timer faults this rank a few ms later, inside that collective or a later one."""
    size = taco.size()
    for step in range(rounds):
        if step == arm_at:
            signal.setitimer(signal.ITIMER_REAL, 0.003)
        numel = (1 << 14) << min(step, 8)
        t = torch.full((numel,), float(rank + 1))
        taco.allreduce(t)
        assert torch.equal(t, torch.full((numel,), float(size * (size + 1) // 2))), step


def mapped() -> list[str]:
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[5] for line in maps if len(line.split()) == 6 and "/dev/shm/" in line})


taco.configure(collective_timeout=90)
rank = taco.rank()
say(" ".join(["PID", str(rank), str(os.getpid()), *mapped()]))
if BY_PATH:
    shmsetup.open_held = refuse  # type: ignore[assignment]
victim = rank == VICTIM
if victim and STAGE == "before":
    fault()
if victim and STAGE == "create":
    if rank == 0:
        dist.broadcast_object_list = at_offer(dist.broadcast_object_list)
    elif BY_PATH:
        shmsetup.open_own = before_open(shmsetup.open_own)  # type: ignore[assignment]
    else:
        shmsetup.open_held = before_open(shmsetup.open_held)  # type: ignore[assignment]
if victim and STAGE == "mid":
    signal.signal(signal.SIGALRM, lambda *_: fault())
grow(12 if STAGE == "mid" else 4, arm_at=6 if victim and STAGE == "mid" else None)
if victim and STAGE == "mid" and FAULT != "none":  # every collective ended before the timer: fault now
    signal.setitimer(signal.ITIMER_REAL, 0)
    fault()
if victim and STAGE == "after":
    fault()
taco.allreduce(torch.ones(8))
say(f"DONE {rank}")
