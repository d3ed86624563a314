"""The cluster registry: one JSON file per running cluster, written by its owner, read by the Jupyter server.

Kernel side (the owner of a :class:`~taco_notebook.cluster.session.TacoCluster`): :func:`publish` after each
state change (``TacoCluster.start``/``stop``/``kill_engines`` call it), :func:`set_run` while a cell runs,
:func:`remove` when the cluster is gone. The first kernel-owned :func:`publish` starts a daemon watcher thread
(one per process) that carries out stop/scale requests the server left as ``{id}.request.json``; it acts only
while it can take the cluster's ``busy`` lock, i.e. between cells, and ends when no cluster is left.

Server side (the files' format, reading and judging them, requests, stale entries) is
:mod:`~taco_notebook.cluster.registry_files`, re-exported here. Files are 0600 in a 0700 directory that must be
this user's (:mod:`~taco_notebook.cluster.private`); a request is honoured only when the directory's owner wrote it
and its size passes :func:`~taco_notebook.cluster.limits.check_size`.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..model import ClusterModel, NodeModel, Owner, OwnerKind, PendingModel, RunModel, State
from .limits import SizeLimitError, check_size
from .registry_files import (
    ENV_VAR,
    RegistryEntry,
    checked_dir,
    discard_stale,
    entry_path,
    owner_alive,
    read_entry,
    read_model,
    read_models,
    read_request,
    registry_dir,
    request_path,
    write_atomic,
    write_request,
)

if TYPE_CHECKING:
    from .session import TacoCluster

__all__ = [
    "ENV_VAR", "POLL_INTERVAL", "RegistryEntry", "registry_dir", "publish", "set_run", "remove", "model_of",
    "owner_of", "read_entry", "read_model", "read_models", "write_request", "discard_stale", "owner_alive",
]

log = logging.getLogger("taco_notebook")

_write_atomic = write_atomic
POLL_INTERVAL = 0.5  # seconds between the watcher's looks for requests: a click feels immediate, a poll is cheap


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _create_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


# ------------------------------------------------------------------------------------------ kernel side
@dataclass
class _Published:
    """This process's record of a cluster it published: where, as whom, and the fields TacoCluster lacks."""

    cluster: TacoCluster
    directory: Path
    kind: OwnerKind
    state: State
    run: RunModel | None = None


_lock = threading.RLock()
_published: dict[str, _Published] = {}
_watcher: _Watcher | None = None


def _nodes(cluster: TacoCluster) -> list[NodeModel]:
    nodes: dict[int, NodeModel] = {}
    for rank in cluster.ranks:
        node = nodes.setdefault(rank.node, {"node": rank.node, "host": rank.host, "ranks": [], "gpus": 0,
                                            "gpu_names": []})
        node["ranks"].append(rank.rank)
        node["gpus"] = max(node["gpus"], rank.gpus)  # ranks of one node see the same devices
        if len(rank.gpu_names) > len(node["gpu_names"]):
            node["gpu_names"] = list(rank.gpu_names)
    return [nodes[n] for n in sorted(nodes)]


def _derived_state(cluster: TacoCluster) -> State:
    if cluster.broken_reason:
        return "broken"
    return "running" if cluster.ipp_cluster is not None else "stopped"


def owner_of(kind: OwnerKind) -> Owner:
    """This process as a cluster's owner: a kernel names its notebook (``JPY_SESSION_NAME``) and its Jupyter
    server (``JPY_PARENT_PID``), both set by Jupyter in the kernel's environment; a server names itself."""
    if kind == "server":
        return {"kind": kind, "pid": os.getpid(), "notebook": None, "server_pid": os.getpid()}
    parent = os.environ.get("JPY_PARENT_PID", "")
    return {"kind": kind, "pid": os.getpid(), "notebook": os.environ.get("JPY_SESSION_NAME") or None,
            "server_pid": int(parent) if parent.isdigit() and int(parent) > 0 else None}


def model_of(cluster: TacoCluster, state: State | None = None, kind: OwnerKind | None = None,
             run: RunModel | None = None, pending: PendingModel | None = None,
             error: str | None = None) -> ClusterModel:
    """The model of ``cluster`` as its owner sees it. Reads plain attributes only: safe from any thread."""
    from .session import PROFILE

    state = state or _derived_state(cluster)
    nodes = _nodes(cluster) if state != "starting" else []
    ranks = sorted(cluster.ranks, key=lambda r: r.rank)
    hugepages = ranks[0].hugepages if ranks and state != "starting" else None
    return {
        "id": cluster.cluster_id or "", "name": cluster.name, "profile": PROFILE,
        "owner": owner_of(kind or cluster.owner_kind), "this_server": False,
        "state": state, "size": cluster.size,
        "engines_up": len(cluster.ranks) if state in ("running", "broken") else 0,
        "mpi": cluster.mpi.description if cluster.mpi else "",
        "nodes": nodes, "gpus": sum(n["gpus"] for n in nodes),
        "hugepages": {"total": hugepages["total"], "free": hugepages["free"], "page_kb": hugepages["page_kb"]}
        if hugepages else None,
        "started_at": cluster.started_at if state != "starting" else None, "updated_at": time.time(),
        "run": run, "pending": pending, "error": error or cluster.broken_reason,
    }


def _write(record: _Published) -> ClusterModel:
    cluster = record.cluster
    model = model_of(cluster, record.state, record.kind, record.run)
    entry: RegistryEntry = {
        "model": model, "owner_create_time": _create_time(os.getpid()),
        "processes": [(p.pid, p.create_time()) for p in cluster._started_processes if _create_time(p.pid)],
        "rank_pids": [(r.rank, r.pid) for r in cluster.ranks],
    }
    write_atomic(entry_path(record.directory, model["id"]), entry)
    return model


def publish(cluster: TacoCluster, state: State | None = None,
            directory: str | os.PathLike[str] | None = None) -> ClusterModel | None:
    """Write ``cluster``'s entry (``state`` defaults to what the cluster says: running, broken or stopped).

    The first call for a cluster fixes its directory (``directory`` or :func:`registry_dir`). Never raises for
    an unwritable registry: the cluster works without a sidebar, so that is a logged warning, and None.
    """
    if not cluster.cluster_id:
        raise ValueError(f"cluster {cluster.name!r} has no cluster_id yet; publish it from start()")
    with _lock:
        record = _published.get(cluster.cluster_id)
        if record is None or record.cluster is not cluster:
            record = _Published(cluster, registry_dir(directory), cluster.owner_kind, state or "starting")
            _published[cluster.cluster_id] = record
        record.state = state or _derived_state(cluster)
        if record.kind == "kernel":
            _ensure_watcher()
        if record.state == "running":  # after ipyparallel registered its exit hook: run before it
            atexit.unregister(_at_exit)
            atexit.register(_at_exit)
        try:
            return _write(record)
        except OSError as exc:
            log.warning("cannot publish cluster %r to the registry %s (the sidebar will not show it): %s",
                        cluster.name, record.directory, exc)
            return None


def set_run(cluster: TacoCluster, run: RunModel | None) -> None:
    """Record the cell running on ``cluster`` (None when it ends); the caller throttles (say, once a second)."""
    with _lock:
        record = _published.get(cluster.cluster_id or "")
        if record is None or record.cluster is not cluster:
            return
        record.run = run
        try:
            _write(record)
        except OSError as exc:
            log.warning("cannot update cluster %r in the registry: %s", cluster.name, exc)


def remove(cluster: TacoCluster) -> None:
    """Delete ``cluster``'s entry and any request left for it."""
    with _lock:
        record = _published.get(cluster.cluster_id or "")
        if record is None or record.cluster is not cluster:
            return
        del _published[cluster.cluster_id or ""]
        _unlink(entry_path(record.directory, cluster.cluster_id or ""))
        _unlink(request_path(record.directory, cluster.cluster_id or ""))


class _Watcher(threading.Thread):
    """Carries out the server's stop/scale requests for this process's kernel-owned clusters, between cells."""

    def __init__(self) -> None:
        super().__init__(name="taco-registry-watcher", daemon=True)
        self.stopping = threading.Event()

    def run(self) -> None:
        global _watcher
        while not self.stopping.wait(POLL_INTERVAL):
            with _lock:
                records = [r for r in _published.values() if r.kind == "kernel"]
                if not records:
                    if _watcher is self:
                        _watcher = None
                    return
            for record in records:
                if not self.stopping.is_set():
                    _serve(record)


def _ensure_watcher() -> None:
    global _watcher
    with _lock:
        if _watcher is None or not _watcher.is_alive():
            _watcher = _Watcher()
            _watcher.start()


def _stop_watcher(timeout: float = 30.0) -> None:
    """Finish the request being carried out (if any), take no more."""
    watcher = _watcher
    if watcher is not None:
        watcher.stopping.set()
        watcher.join(timeout)


def _at_exit() -> None:
    """Interpreter exit: stop the watcher, then every cluster this process published, removing its entry.

    Re-registered whenever a cluster comes up, so it runs before ipyparallel's own exit hook, whose slower
    stop (~5 s) outlasts the grace a kernel gets at shutdown: killed in the middle, the kernel would leave its
    entries behind, shown as stale.
    """
    _stop_watcher()
    with _lock:
        records = list(_published.values())
    for record in records:
        try:
            record.cluster.stop(fast=True)
        except Exception:  # at exit there is no caller: log, and stop the others
            log.exception("stopping cluster %r at exit failed", record.cluster.name)


atexit.register(_at_exit)


def _serve(record: _Published) -> None:
    cluster = record.cluster
    path = request_path(record.directory, cluster.cluster_id or "")
    if record.state in ("starting", "stopping") or not os.path.lexists(path):
        return
    if not cluster.busy.acquire(blocking=False):
        return  # a cell is running: the request stays pending
    try:
        try:
            checked_dir(record.directory)  # a directory others can write: its requests are not the server's
            request = read_request(record.directory, cluster.cluster_id or "")  # its owner's, small, or None
        except OSError as exc:
            log.warning("ignoring request %s: %s", path, exc)
            return
        finally:
            _unlink(path)  # taken: from here on the entry's state tells the progress
        if request is None:
            return
        if request.get("action") == "stop":
            from .session import clusters

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
    finally:
        cluster.busy.release()
