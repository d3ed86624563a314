"""The processes behind a cluster: find its tree, tell whether one lives, stop them (politely or not).

ipyparallel manages the processes; these helpers make sure that whatever it leaves (a rank stuck in C code, an
orphaned nanny, MPI's shared-memory files) is found and ended, and that an exiting kernel ends them quickly.

A process named in a file (a registry entry) is never killed on the file's word: :func:`proven_processes`
keeps only those that carry this cluster's marker (:data:`CLUSTER_ID_ENV` in their environment, set by
``TacoCluster`` in every process it launches), run as this user, and started at the recorded time.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..describe import RankInfo

__all__ = ["shared_memory_files", "mapped_shared_memory", "alive", "descendants", "process_tree", "stop_at_exit",
           "kill", "CLUSTER_ID_ENV", "proven_process", "proven_processes", "marked_processes"]

CLUSTER_ID_ENV = "TACO_CLUSTER_ID"  # in the environment of the controller, mpiexec and every rank of a cluster


def shared_memory_files(ranks: list[RankInfo]) -> set[str]:
    """The /dev/shm files this machine's ranks have mapped (MPI's intra-node segments)."""
    import psutil

    processes = []
    for rank in ranks:
        try:
            processes.append(psutil.Process(rank.pid))
        except Exception:  # another host's rank, or already gone
            continue
    return mapped_shared_memory(processes)


def mapped_shared_memory(processes: Iterable[Any]) -> set[str]:
    """The /dev/shm files these processes (psutil.Process) have mapped: a failed start knows no ranks yet, but
    its process tree still maps the segments MPI made."""
    found: set[str] = set()
    for process in processes:
        try:
            maps = process.memory_maps(grouped=True)
        except Exception:  # gone, or a zombie
            continue
        found.update(m.path for m in maps if m.path.startswith("/dev/shm/"))
    return found


def alive(process: Any) -> bool:
    try:
        return process is not None and process.is_running() and process.status() != "zombie"
    except Exception:  # psutil.NoSuchProcess and friends
        return False


def descendants(process: Any) -> list[Any]:
    """``process`` and everything it started (mpiexec puts each rank in a process group of its own)."""
    if process is None:
        return []
    try:
        return [process, *process.children(recursive=True)]
    except Exception:  # psutil.NoSuchProcess: already gone
        return []


def process_tree(cluster: Any) -> list[Any]:
    launchers = [cluster.controller, *cluster.engines.values()]
    return [p for launcher in launchers if launcher is not None
            for p in descendants(getattr(launcher, "process", None))]


def stop_at_exit(cluster: Any, client: Any, tree: list[Any], grace: float = 1.5) -> None:
    """Interpreter exit: SIGTERM the whole recorded tree at once (mpiexec forwards it to the ranks), SIGKILL what
    is left after ``grace``. A kernel shut down from JupyterLab is killed ~5 s after it was asked to exit, and
    the graceful stop can take longer on a loaded machine: killed midway, it would orphan the controller."""
    import psutil

    cluster.shutdown_atexit = False  # ipyparallel's own exit hook would stop it again, slowly
    if client is not None:
        client.close()
    asked = []
    for process in tree:
        try:
            process.terminate()
            asked.append(process)
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(asked, timeout=grace)
    kill(left)
    try:
        cluster.remove_cluster_file()
    except OSError:
        pass


def kill(processes: list[Any], wait: bool = True) -> None:
    for process in processes:
        try:
            process.kill()
        except Exception:  # psutil.NoSuchProcess: already gone
            pass
    for process in processes if wait else []:
        try:
            process.wait(timeout=5)
        except Exception:
            pass


def proven_process(pid: int, create_time: float, cluster_id: str) -> Any:
    """The live ``psutil.Process`` ``pid`` if it provably belongs to cluster ``cluster_id``, else None.

    Proof: it runs as this user (real and effective uid), it started at ``create_time`` (not a reused pid), and
    its environment carries ``TACO_CLUSTER_ID=<cluster_id>``, which only a TacoCluster's launch sets.
    """
    import psutil

    if not cluster_id or isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None
    try:
        process = psutil.Process(pid)
        uids = process.uids()
        if {uids.real, uids.effective} != {os.getuid()} or process.status() == psutil.STATUS_ZOMBIE:
            return None
        if not isinstance(create_time, int | float) or abs(process.create_time() - create_time) >= 0.01:
            return None
        if process.environ().get(CLUSTER_ID_ENV) != cluster_id:
            return None
    except (psutil.Error, OSError):
        return None
    return process


def proven_processes(recorded: Iterable[Any], cluster_id: str) -> list[Any]:
    """Those of the ``(pid, create time)`` pairs ``recorded`` (read from a file) that :func:`proven_process`
    proves to be cluster ``cluster_id``'s; malformed pairs are skipped."""
    found = []
    for item in recorded:
        if isinstance(item, list | tuple) and len(item) == 2:
            process = proven_process(item[0], item[1], cluster_id)
            if process is not None:
                found.append(process)
    return found


def marked_processes(cluster_id: str) -> list[Any]:
    """Live processes of this user whose environment carries ``TACO_CLUSTER_ID=<cluster_id>``: what is left of a
    stopped cluster outside its recorded tree, such as a child the controller forked while a start that failed
    at once (sbatch refused the job) was stopping it, orphaned (parent 1)."""
    import psutil

    if not cluster_id:
        return []
    found = []
    for process in psutil.process_iter():
        try:
            uids = process.uids()
            if {uids.real, uids.effective} != {os.getuid()} or process.status() == psutil.STATUS_ZOMBIE:
                continue
            if process.pid != os.getpid() and process.environ().get(CLUSTER_ID_ENV) == cluster_id:
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found
