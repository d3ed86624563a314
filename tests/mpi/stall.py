"""Run under ``mpiexec -n 4`` with a stall timeout: rank 3 sleeps while the others wait in an allreduce.

``MODE=fail``: rank 3 sleeps 60 s; ranks 0-2 print ``STALL <rank> <seconds waited> <message>`` and let the
StallError end the job (plain mpiexec aborts every rank on an uncaught exception). ``MODE=recover``: rank 3
sleeps ``SLEEP_S`` (past the timeout) and then enters the allreduce, which raises at once since its peers gave
up; every rank then rebuilds the group with ``taco.reinit()``, checks an allreduce, and reports how many
communication threads are still alive (the ones stuck in the abandoned collective must have been released).
``MODE=mismatch``: rank 3 broadcasts while the others allreduce; the ranks that report say so, then the job ends.
That mode turns the ranks' agreement check off (comm/collectives/agreement.py would raise a CollectiveMismatchError at
once):
the watchdog's own diagnosis is what covers collectives that are not checked, such as gradient buckets.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

import taco_notebook.comm as taco
from taco_notebook.comm.collectives import agreement


def report(line: str) -> None:
    """One write per line: the ranks share mpiexec's stdout, and print()'s separate newline lets lines mix."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


MODE = os.environ.get("MODE", "fail")
if MODE == "mismatch":
    agreement.set_enabled(False)
if "STALL_S" in os.environ:  # else TACO_STALL_TIMEOUT decides
    taco.configure(stall_timeout=float(os.environ["STALL_S"]))
t = torch.ones(4)
taco.allreduce(t)  # the group is up everywhere: the stall below is in collective #2
rank = taco.rank()
if rank == 3 and MODE != "mismatch":
    time.sleep(60.0 if MODE == "fail" else float(os.environ.get("SLEEP_S", "6")))
began = time.monotonic()
try:
    if MODE == "mismatch" and rank == 3:
        taco.broadcast(t)  # the others allreduce: a program whose ranks disagree on the order of collectives
    else:
        taco.allreduce(t, name="step")
except taco.StallError as error:
    report(f"STALL {rank} {time.monotonic() - began:.2f} missing={list(error.missing)} "
           f"gave_up={list(error.gave_up)} {error}")
    if MODE in ("fail", "mismatch"):
        raise
else:
    report(f"NO-STALL {rank}")
if MODE == "recover":
    try:
        taco.allreduce(t)
    except taco.StallError:
        report(f"STILL-BROKEN {rank}")  # until the group is rebuilt
    taco.reinit()
    t = torch.full((4,), float(rank))
    taco.allreduce(t)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        comm = [th for th in threading.enumerate() if th.name == "taco-comm"]
        if len(comm) <= 1:
            break
        time.sleep(0.1)
    report(f"RECOVERED {rank} {t.tolist()} comm-threads={len(comm)}")
