"""Stop a killed kernel's clusters: a small process that outlives the kernel and cleans up after it.

A kernel stops its clusters at exit (one atexit hook, :mod:`~taco_notebook.cluster.session`), but a kernel that
is SIGKILLed (a Jupyter client's shutdown after its grace period, nbval's ``now=True``, the OOM killer) runs no
hook, and its controller, mpiexec and ranks would go on running, orphaned, until someone pressed Stop on the
sidebar's ``stale`` entry. So when the kernel first writes a kernel-owned cluster to the registry,
:func:`ensure_reaper` starts ``python -m taco_notebook.cluster.registry.reaper --owner PID --registry DIR`` in a
session of its own. It sleeps on a pidfd until that kernel ends (checking every 5 s that it is still needed),
then discards every entry in the registry whose owner was that process
(:func:`~taco_notebook.cluster.registry.files.discard_stale`: only processes proven to be the cluster's are
killed, and the MPI shared-memory segments they map or the entry lists and ipyparallel's files of the cluster are
removed) and exits. A kernel that exits normally
has removed its entries already, so the reaper finds nothing and just ends; it also ends a few seconds after
the kernel has no entry left in that registry (the next cluster starts a new one). A cluster the kernel kept
(``%taco_cluster keep``) it leaves running: it waits until another kernel adopts it (the entry's owner changes)
or the sidebar stops it, and discards it once its idle time has passed since the kernel ended. One small
process per kernel and registry, writing nothing (its output goes to /dev/null).

Stdlib and psutil only, imported before anything heavy: it must start fast and stay small.
"""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .files import RegistryEntry, discard_stale, kept_idle_s, leftovers, owner_alive, read_entry

__all__ = ["ensure_reaper", "running_reapers", "owned_entries", "reap", "outlive", "wait_for_exit", "main"]

_started: dict[tuple[int, str], subprocess.Popen[bytes]] = {}
_lock = threading.Lock()


def ensure_reaper(directory: Path) -> None:
    """Start this process's reaper for the registry ``directory``, once (a reaper that died is started again)."""
    key = (os.getpid(), str(directory))
    with _lock:
        running = _started.get(key)
        if running is not None and running.poll() is None:
            return
        argv = [sys.executable, "-m", "taco_notebook.cluster.registry.reaper", "--owner", str(os.getpid()),
                "--registry", str(directory)]
        _started[key] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def running_reapers() -> list[int]:
    """The pids of this process's reapers that still run."""
    with _lock:
        return [p.pid for (owner, _), p in _started.items() if owner == os.getpid() and p.poll() is None]


def wait_for_exit(pid: int, create_time: float | None, still_needed: Callable[[], bool] | None = None,
                  check_s: float = 5.0) -> bool:
    """Wait until process ``pid`` (the one started at ``create_time``, not a later one with its number) ends:
    True. False as soon as ``still_needed()`` answers False twice in a row, ``check_s`` apart."""
    import psutil

    try:
        process = psutil.Process(pid)
        if create_time is not None and abs(process.create_time() - create_time) >= 0.01:
            return True  # the number was reused: ours is gone already
    except psutil.Error:
        return True
    try:
        fd = os.pidfd_open(pid)  # Linux ≥ 5.3: readable when the process ends
    except (AttributeError, OSError):
        fd = None
    idle = 0
    try:
        while process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
            if fd is not None:
                select.select([fd], [], [], check_s)
            else:
                time.sleep(min(check_s, 1.0))
            idle = 0 if still_needed is None or still_needed() else idle + 1
            if idle >= 2:
                return False
    except psutil.Error:
        pass
    finally:
        if fd is not None:
            os.close(fd)
    return True


def owned_entries(directory: Path, owner: int) -> dict[str, RegistryEntry]:
    """The registry entries in ``directory`` whose owner is process ``owner``, by cluster id."""
    found = {}
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        cluster_id = path.name[: -len(".json")]
        if path.name.startswith(".") or cluster_id.endswith(".request"):
            continue
        entry = read_entry(directory, cluster_id)
        if entry is not None and entry["model"]["owner"]["pid"] == owner:
            found[cluster_id] = entry
    return found


def reap(directory: Path, owner: int, died_at: float | None = None) -> list[str]:
    """Discard the registry entries in ``directory`` of the dead process ``owner``; returns their cluster ids. A
    kept one (``%taco_cluster keep``) whose ranks still run is left alone until ``died_at`` plus its idle time."""
    reaped = []
    now = time.time()
    for cluster_id, entry in owned_entries(directory, owner).items():
        if owner_alive(owner, entry["owner_create_time"]):  # never a live owner's (a reused pid)
            continue
        idle = kept_idle_s(entry)
        if idle is not None and now < (died_at or now) + idle and leftovers(entry):
            continue
        discard_stale(directory, cluster_id)
        reaped.append(cluster_id)
    return reaped


def outlive(directory: Path, owner: int, died_at: float, check_s: float = 5.0) -> None:
    """After ``owner`` died: wait while it has kept entries (each ends adopted, its owner then another process,
    or stopped from the sidebar), and discard each one its idle time after ``died_at``."""
    while True:
        reap(directory, owner, died_at)
        if not owned_entries(directory, owner):
            return
        time.sleep(check_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m taco_notebook.cluster.registry.reaper",
                                     description="stop the clusters a process leaves behind when it is killed")
    parser.add_argument("--owner", type=int, required=True, help="the process whose clusters to clean up after")
    parser.add_argument("--registry", type=Path, required=True, help="the taco registry directory")
    args = parser.parse_args(argv)
    import psutil

    try:
        create_time: float | None = psutil.Process(args.owner).create_time()
    except psutil.Error:
        create_time = None  # already gone: clean up after whatever it left
    if wait_for_exit(args.owner, create_time, lambda: bool(owned_entries(args.registry, args.owner))):
        outlive(args.registry, args.owner, time.time())
    return 0

if __name__ == "__main__":
    sys.exit(main())
