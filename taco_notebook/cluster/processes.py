"""The processes behind a cluster: find its tree, tell whether one lives, stop them (politely or not).

ipyparallel manages the processes; these helpers make sure that whatever it leaves (a rank stuck in C code, an
orphaned nanny, MPI's shared-memory files) is found and ended, and that an exiting kernel ends them quickly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .session import RankInfo

__all__ = ["shared_memory_files", "alive", "descendants", "process_tree", "stop_at_exit", "kill"]


def shared_memory_files(ranks: list[RankInfo]) -> set[str]:
    """The /dev/shm files this machine's ranks have mapped (MPI's intra-node segments)."""
    import psutil

    found: set[str] = set()
    for rank in ranks:
        try:
            maps = psutil.Process(rank.pid).memory_maps(grouped=True)
        except Exception:  # another host's rank, or already gone
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
