"""Stopping a cluster's processes for good: engines asked first, then ipyparallel's stop, then whatever is left.

:meth:`~taco_notebook.cluster.session.TacoCluster.stop` calls :func:`stop_processes` with what it recorded at start
(the process tree, MPI's shared-memory segments), so nothing outlives the cluster even when orphaned.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

from .tree import alive, kill, mapped_shared_memory, stop_at_exit

__all__ = ["stop_processes", "unlink_shared_memory"]


def unlink_shared_memory(paths: Iterable[str]) -> None:
    """Remove MPI's /dev/shm segments: a killed rank leaves them behind."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:  # MPI removed it on the way out
            pass


def _shutdown_engines(client: Any, cluster: Any, grace: float = 3.0) -> None:
    """Ask idle engines to exit cleanly, so mpiexec ends by itself instead of being TERMed and KILLed."""
    try:
        client.shutdown(targets="all", block=False)
    except Exception:  # no engines registered any more: nothing to ask
        return
    deadline = time.monotonic() + grace
    launchers = list(cluster.engines.values())
    while time.monotonic() < deadline and any(alive(getattr(es, "process", None)) for es in launchers):
        time.sleep(0.05)


def stop_processes(cluster: Any, client: Any, tree: list[Any], shared_memory: set[str], fast: bool) -> None:
    """Stop ipyparallel ``cluster`` (and ``client``), then kill what of ``tree`` is left and unlink the segments.

    ``fast`` (at interpreter exit) terminates the processes at once instead of asking them to exit. The
    segments the tree maps now are unlinked too: those MPI made after start, and a failed start's (no ranks).
    """
    shared_memory = set(shared_memory) | mapped_shared_memory(tree)
    try:
        if fast:
            unlink_shared_memory(shared_memory)  # first: the ranks keep their mappings, the names go now
            stop_at_exit(cluster, client, tree)
            return
        if client is not None:
            _shutdown_engines(client, cluster)
            client.close()
        # Engines first, then the controller: stopped together (stop_cluster) they take several times longer.
        cluster.stop_engines_sync()  # graceful: mpiexec forwards SIGTERM to every rank
        cluster.stop_controller_sync()
    finally:
        kill(tree)  # whatever ignored it (a rank stuck in C code, an orphaned nanny)
        unlink_shared_memory(shared_memory)
