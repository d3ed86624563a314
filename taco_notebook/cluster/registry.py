"""The cluster registry: one JSON file per running cluster, written by its owner, read by the Jupyter server.

Kernel side (the owner of a :class:`~taco_notebook.cluster.session.TacoCluster`): :func:`publish` after each
state change (``TacoCluster.start``/``stop``/``kill_engines`` call it), :func:`set_run` while a cell runs,
:func:`remove` when the cluster is gone. The first kernel-owned :func:`publish` starts a daemon watcher thread
(one per process) that carries out stop/scale requests the server left as ``{id}.request.json``; it acts only
while it can take the cluster's ``busy`` lock, i.e. between cells, and ends when no cluster is left.

Server side: :func:`read_models` / :func:`read_model` return :class:`ClusterModel` s, with ``stale`` for entries
whose owner process is gone (pid and create time recorded, so a reused pid is not mistaken for the owner),
``pending`` from a request file, and ``engines_up`` counted from the rank processes still alive on this host.

The directory is ``$TACO_REGISTRY_DIR`` or ``<jupyter runtime dir>/taco-notebook/clusters``. Files are written
to a dot-named temporary and renamed (``os.replace``), so a reader never sees half an entry.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from ..server.models import Action, ClusterModel, NodeModel, OwnerKind, PendingModel, RunModel, State

if TYPE_CHECKING:
    from .session import TacoCluster

__all__ = [
    "ENV_VAR", "POLL_INTERVAL", "RegistryEntry", "registry_dir", "publish", "set_run", "remove", "model_of",
    "read_entry", "read_model", "read_models", "write_request", "discard_stale", "owner_alive",
]

log = logging.getLogger("taco_notebook")

ENV_VAR = "TACO_REGISTRY_DIR"
POLL_INTERVAL = 0.5  # seconds between the watcher's looks for requests: a click feels immediate, a poll is cheap


class RegistryEntry(TypedDict):
    """What a registry file holds: the model, plus what a reader needs to judge and clean up after its owner."""

    model: ClusterModel
    owner_create_time: float | None
    processes: list[tuple[int, float]]  # (pid, create time) of the local controller/mpiexec/rank processes
    rank_pids: list[tuple[int, int]]  # (rank, pid)


def registry_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """``directory`` if given, else ``$TACO_REGISTRY_DIR``, else ``<jupyter runtime dir>/taco-notebook/clusters``."""
    if directory is not None:
        return Path(directory)
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "taco-notebook" / "clusters"


def _entry_path(directory: Path, cluster_id: str) -> Path:
    return directory / f"{cluster_id}.json"


def _request_path(directory: Path, cluster_id: str) -> Path:
    return directory / f"{cluster_id}.request.json"


def _write_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


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


def owner_alive(pid: int, create_time: float | None) -> bool:
    """Whether process ``pid`` runs and is the one that started at ``create_time`` (not a reused pid)."""
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time is None or abs(process.create_time() - create_time) < 0.01
    except psutil.Error:
        return False


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
        "owner": {"kind": kind or cluster.owner_kind, "pid": os.getpid()},
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
    _write_atomic(_entry_path(record.directory, model["id"]), entry)
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
        _unlink(_entry_path(record.directory, cluster.cluster_id or ""))
        _unlink(_request_path(record.directory, cluster.cluster_id or ""))


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
    path = _request_path(record.directory, cluster.cluster_id or "")
    if record.state in ("starting", "stopping") or not path.exists():
        return
    if not cluster.busy.acquire(blocking=False):
        return  # a cell is running: the request stays pending
    try:
        try:
            request = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable request %s: %s", path, exc)
            return
        finally:
            _unlink(path)  # taken: from here on the entry's state tells the progress
        if request.get("action") == "stop":
            from .session import clusters

            if clusters.get(cluster.name) is cluster:
                clusters.pop(cluster.name)
            cluster.stop()
        elif request.get("action") == "scale":
            try:
                cluster.scale(int(request["size"]))
            except Exception:  # the kernel has no caller to raise to; start() already cleaned up
                log.exception("scaling cluster %r to %s ranks (asked from the sidebar) failed",
                              cluster.name, request.get("size"))
    finally:
        cluster.busy.release()


# ------------------------------------------------------------------------------------------ server side
def read_entry(directory: Path, cluster_id: str) -> RegistryEntry | None:
    """The raw entry of ``cluster_id``, or None if there is none (or it vanished while being read)."""
    try:
        with open(_entry_path(directory, cluster_id)) as f:
            entry: RegistryEntry = json.load(f)
    except (FileNotFoundError, ValueError):
        return None
    return entry


def _pending(directory: Path, cluster_id: str) -> PendingModel | None:
    try:
        with open(_request_path(directory, cluster_id)) as f:
            request = json.load(f)
        return {"action": request["action"], "size": request.get("size"), "requested_at": request["requested_at"]}
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def _judge(directory: Path, entry: RegistryEntry) -> ClusterModel:
    """The model as a reader should show it: stale if the owner died, rank deaths counted, pending requests."""
    model = entry["model"]
    model["pending"] = _pending(directory, model["id"])
    if not owner_alive(model["owner"]["pid"], entry["owner_create_time"]):
        model["state"] = "stale"
        model["engines_up"] = 0
        model["error"] = model["error"] or (f"its owner ({model['owner']['kind']} pid {model['owner']['pid']}) "
                                            "is gone; delete the entry to kill what it left running")
        return model
    local = {int(pid): created for pid, created in entry["processes"]}
    dead = [(rank, pid) for rank, pid in entry["rank_pids"] if pid in local and not owner_alive(pid, local[pid])]
    if dead and model["state"] in ("running", "broken"):
        model["engines_up"] = max(0, model["engines_up"] - len(dead))
        model["state"] = "broken"
        model["error"] = model["error"] or ", ".join(f"rank {r} (pid {p})" for r, p in dead) + " exited"
    return model


def read_model(directory: Path, cluster_id: str) -> ClusterModel | None:
    entry = read_entry(directory, cluster_id)
    return _judge(directory, entry) if entry is not None else None


def read_models(directory: Path, exclude: set[str] | frozenset[str] = frozenset()) -> list[ClusterModel]:
    """Every cluster in ``directory`` but those in ``exclude``, oldest first."""
    if not directory.is_dir():
        return []
    models = []
    for path in directory.glob("*.json"):
        cluster_id = path.name[: -len(".json")]
        if path.name.startswith(".") or cluster_id.endswith(".request") or cluster_id in exclude:
            continue
        model = read_model(directory, cluster_id)
        if model is not None:
            models.append(model)
    return sorted(models, key=lambda m: (m["started_at"] or m["updated_at"], m["id"]))


def write_request(directory: Path, cluster_id: str, action: Action, size: int | None) -> PendingModel:
    """Ask the owning kernel to stop or scale ``cluster_id``; it acts when no cell runs there."""
    pending: PendingModel = {"action": action, "size": size, "requested_at": time.time()}
    _write_atomic(_request_path(directory, cluster_id), pending)
    return pending


def discard_stale(directory: Path, cluster_id: str) -> list[int]:
    """Remove a stale entry and kill what its dead owner left running; returns the pids killed.

    Only processes recorded in the entry *and* still carrying the recorded create time are killed: those are
    the controller, mpiexec and ranks that kernel started, never a process that later got a reused pid.
    """
    import psutil

    entry = read_entry(directory, cluster_id)
    killed = []
    for pid, created in entry["processes"] if entry else []:
        if owner_alive(pid, created):
            try:
                psutil.Process(pid).kill()
                killed.append(pid)
            except psutil.Error:
                pass
    _unlink(_entry_path(directory, cluster_id))
    _unlink(_request_path(directory, cluster_id))
    return killed
