"""The registry's writing side, in the process that owns clusters: entries written on lifecycle events, and
the watcher that carries out the sidebar's stop/scale requests between cells.

:func:`track` subscribes a :class:`~taco_notebook.cluster.session.TacoCluster` to be written to the registry
(:mod:`~taco_notebook.cluster.registry.files` holds the format and the reading side): its entry is written on
``starting``, ``running``, ``stopping``, ``broken`` and ``run`` events and removed, with any request left for it,
on ``stopped``. The kernel tracks the clusters ``%%taco_run`` starts, the server extension its own.

For kernel-owned clusters a daemon watcher thread (one per process) looks for ``{id}.request.json`` every
:data:`POLL_INTERVAL` s and acts only while it can take the cluster's ``busy`` lock, i.e. between cells; it ends
when no kernel-owned cluster is left or the process exits (:data:`~taco_notebook.cluster.session.exiting`).
The process's one exit hook is session's: it registers none here. A kernel that is killed runs no hook: the
reaper (:mod:`~taco_notebook.cluster.registry.reaper`, started with the first kernel-owned entry) cleans up after it.
A request is honoured only when the directory's owner wrote it and its size passes
:func:`~taco_notebook.cluster.launch.limits.check_size`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from pathlib import Path

from ..launch.limits import SizeLimitError, check_size
from ..session import Event, TacoCluster, clusters, exiting
from .files import RegistryEntry, checked_dir, entry_path, read_request, registry_dir, request_path, write_atomic
from .reaper import ensure_reaper

__all__ = ["POLL_INTERVAL", "track", "tracked", "write_entry", "keep_entry"]

log = logging.getLogger("taco_notebook")

POLL_INTERVAL = 0.5  # seconds between the watcher's looks for requests: a click feels immediate, a poll is cheap

_lock = threading.RLock()
_directories: weakref.WeakKeyDictionary[TacoCluster, Path] = weakref.WeakKeyDictionary()  # tracked -> its dir
_written: dict[int, tuple[TacoCluster, Path]] = {}  # id(cluster) -> (cluster, directory) of each entry there now
_watcher: _Watcher | None = None
_kept: dict[str, float] = {}  # cluster id -> seconds it outlives this process unadopted (%taco_cluster keep)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


@functools.lru_cache(maxsize=4)  # only this process's own pid is asked: its start time never changes
def _create_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def track(cluster: TacoCluster, directory: str | os.PathLike[str] | None = None) -> TacoCluster:
    """Write ``cluster`` to the registry in ``directory`` (default :func:`registry_dir`) on each of its events
    from now on (an entry from ``starting`` to ``stopped``, again if it starts again); returns it. Tracking it
    again changes nothing. Call it before :meth:`~TacoCluster.start`."""
    with _lock:
        if cluster not in _directories:
            _directories[cluster] = registry_dir(directory)
            cluster.subscribe(_on_event)
    return cluster


def tracked() -> list[TacoCluster]:
    """The clusters whose entries this process has written and not removed yet."""
    with _lock:
        return [cluster for cluster, _ in _written.values()]


def write_entry(cluster: TacoCluster, directory: Path) -> None:
    """Write ``cluster``'s entry: its model and what a reader needs to judge it and clean up after it."""
    model = cluster.model()
    entry: RegistryEntry = {
        "model": model, "owner_create_time": _create_time(os.getpid()),
        # create_time() is cached by psutil: no /proc reads per write (a cell writes twice). A process that died
        # since stays listed; readers judge every (pid, create time) themselves, so a reused pid is never taken.
        "processes": [(p.pid, p.create_time()) for p in cluster.processes],
        "rank_pids": [(r.rank, r.pid) for r in cluster.ranks],
        "shared_memory": sorted(cluster.shared_memory),
    }
    idle = _kept.get(model["id"])
    if idle is not None:
        entry["kept_idle_s"] = idle
    write_atomic(entry_path(directory, model["id"]), entry)


def keep_entry(cluster: TacoCluster, idle_s: float | None) -> None:
    """Write ``cluster``'s entry as kept (``idle_s``: how long it outlives this process unadopted) or, with
    None, as not kept any more."""
    with _lock:
        if idle_s is None:
            _kept.pop(cluster.cluster_id or "", None)
        else:
            _kept[cluster.cluster_id or ""] = idle_s
    cluster.set_run(cluster.run)  # an event: the entry is written again


def _on_event(cluster: TacoCluster, event: Event) -> None:
    """A tracked cluster changed: write its entry, or remove it when the cluster stopped. Never raises for an
    unwritable registry: the cluster works without a sidebar, so that is a logged warning."""
    with _lock:
        directory = _directories.get(cluster)
        if directory is None or not cluster.cluster_id:
            return
        if event == "stopped":
            _written.pop(id(cluster), None)
            _kept.pop(cluster.cluster_id, None)
            _unlink(entry_path(directory, cluster.cluster_id))
            _unlink(request_path(directory, cluster.cluster_id))
            return
        try:
            write_entry(cluster, directory)
        except OSError as exc:
            log.warning("cannot write cluster %r to the registry %s (the sidebar will not show it): %s",
                        cluster.name, directory, exc)
            return
        _written[id(cluster)] = (cluster, directory)
        if cluster.owner_kind == "kernel":
            _ensure_watcher()
            ensure_reaper(directory)  # stops this kernel's clusters if it is killed


class _Watcher(threading.Thread):
    """Carries out the server's stop/scale requests for this process's kernel-owned clusters, between cells."""

    def __init__(self) -> None:
        super().__init__(name="taco-registry-watcher", daemon=True)

    def run(self) -> None:
        global _watcher
        while not exiting.wait(POLL_INTERVAL):
            with _lock:
                records = [r for r in _written.values() if r[0].owner_kind == "kernel"]
                if not records:
                    if _watcher is self:
                        _watcher = None
                    return
            for cluster, directory in records:
                if not exiting.is_set():
                    _serve(cluster, directory)


def _ensure_watcher() -> None:
    global _watcher
    with _lock:
        if not exiting.is_set() and (_watcher is None or not _watcher.is_alive()):
            _watcher = _Watcher()
            _watcher.start()


def _serve(cluster: TacoCluster, directory: Path) -> None:
    path = request_path(directory, cluster.cluster_id or "")
    if cluster.state in ("starting", "stopping") or not os.path.lexists(path):
        return
    if not cluster.busy.acquire(blocking=False):
        return  # a cell is running: the request stays pending
    try:
        _carry_out(cluster, directory, path)
    finally:
        cluster.busy.release()


def _carry_out(cluster: TacoCluster, directory: Path, path: Path) -> None:
    """Read the request at ``path`` (the caller holds ``busy``) and do what it asks."""
    try:
        checked_dir(directory)  # a directory others can write: its requests are not the server's
        request = read_request(directory, cluster.cluster_id or "")  # its owner's, small, or None
    except OSError as exc:
        log.warning("ignoring request %s: %s", path, exc)
        return
    finally:
        _unlink(path)  # taken: from here on the entry's state tells the progress
    if request is None or exiting.is_set():
        return
    if request.get("action") == "stop":
        if clusters.get(cluster.name) is cluster:
            clusters.pop(cluster.name)
        cluster.stop()
    elif request.get("action") == "scale":
        try:
            size = check_size(request.get("size"), f"the size in {path.name}")
        except SizeLimitError as exc:
            log.warning("ignoring request %s: %s", path, exc)
            return
        try:
            cluster.scale(size)
        except Exception:  # the kernel has no caller to raise to; start() already cleaned up
            log.exception("scaling cluster %r to %s ranks (asked from the sidebar) failed",
                          cluster.name, request.get("size"))
