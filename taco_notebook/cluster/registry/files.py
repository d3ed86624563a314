"""The cluster registry's files: where they live, what they hold, and how a reader judges them.

One ``{id}.json`` entry per cluster, written by its owner (a kernel, or the Jupyter server for the clusters it
started; see :mod:`~taco_notebook.cluster.registry.writer`), and ``{id}.request.json`` for a stop or scale the server
asks of a kernel. The directory is ``$TACO_REGISTRY_DIR`` or ``<jupyter runtime dir>/taco-notebook/clusters``.

Nothing in these files is taken on its word (see SECURITY.md): the directory must be this user's and writable by
no one else (:func:`~taco_notebook.private.check_private_dir`), files are read only when this user owns them and
they are small, and a process named in an entry is killed only when it proves to be that cluster's
(:func:`~taco_notebook.cluster.processes.tree.proven_processes`).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from ...model import Action, ClusterModel, PendingModel
from ...private import check_private_dir, read_private_json, write_private_json
from ..launch.ippfiles import remove_cluster_files
from ..processes.tree import mapped_shared_memory, proven_processes

__all__ = [
    "ENV_VAR", "ENTRY_MAX_BYTES", "REQUEST_MAX_BYTES", "RegistryEntry", "registry_dir", "checked_dir",
    "entry_path", "request_path", "write_atomic", "read_entry", "read_request", "read_model", "read_models",
    "judge", "write_request", "discard_stale", "leftovers", "owner_alive", "kept_idle_s",
]

log = logging.getLogger("taco_notebook")

ENV_VAR = "TACO_REGISTRY_DIR"
ENTRY_MAX_BYTES = 1 << 20  # an entry holds a model (a few KiB with a long cell line); anything larger is not ours
REQUEST_MAX_BYTES = 4096  # {"action", "size", "requested_at"}
_WHAT = "taco registry directory"


class RegistryEntry(TypedDict):
    """What a registry file holds: the model, plus what a reader needs to judge and clean up after its owner."""

    model: ClusterModel
    owner_create_time: float | None
    processes: list[tuple[int, float]]  # (pid, create time) of the local controller/mpiexec/rank processes
    rank_pids: list[tuple[int, int]]  # (rank, pid)
    shared_memory: NotRequired[list[str]]  # MPI's /dev/shm segments of this machine's ranks (a killed rank's stay)
    kept_idle_s: NotRequired[float]  # kept (``%taco_cluster keep``): outlives its owner this long, unadopted


def kept_idle_s(entry: RegistryEntry) -> float | None:
    """How long a kept cluster outlives its owner unadopted; None when it is not kept."""
    value = entry.get("kept_idle_s")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else None


def registry_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """``directory`` if given, else ``$TACO_REGISTRY_DIR``, else ``<jupyter runtime dir>/taco-notebook/clusters``."""
    if directory is not None:
        return Path(directory)
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "taco-notebook" / "clusters"


def checked_dir(directory: Path) -> bool:
    """False if ``directory`` does not exist; True if it is safe to trust; raises
    :class:`~taco_notebook.private.UnsafeDirectoryError` (with the fix) if another user could control it."""
    if not os.path.lexists(directory):
        return False
    check_private_dir(directory, _WHAT)
    return True


def entry_path(directory: Path, cluster_id: str) -> Path:
    return directory / f"{cluster_id}.json"


def request_path(directory: Path, cluster_id: str) -> Path:
    return directory / f"{cluster_id}.request.json"


def write_atomic(path: Path, data: Any) -> None:
    """Write a registry file: 0600 in a 0700 directory (created so), whole or not at all."""
    write_private_json(path, data, _WHAT)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def owner_alive(pid: int, create_time: float | None) -> bool:
    """Whether process ``pid`` runs and is the one that started at ``create_time`` (not a reused pid)."""
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time is None or abs(process.create_time() - create_time) < 0.01
    except (psutil.Error, TypeError, ValueError, OverflowError):
        return False


def _well_formed(entry: Any, cluster_id: str) -> bool:
    """Whether ``entry`` has the shape a reader relies on, for the id its file name gives."""
    if not isinstance(entry, dict) or not isinstance(entry.get("model"), dict):
        return False
    model, owner = entry["model"], entry["model"].get("owner")
    return (model.get("id") == cluster_id and isinstance(owner, dict) and isinstance(owner.get("pid"), int)
            and isinstance(entry.get("processes"), list) and isinstance(entry.get("rank_pids"), list))


def read_entry(directory: Path, cluster_id: str) -> RegistryEntry | None:
    """The entry of ``cluster_id`` if there is one this user wrote, small and well formed; else None."""
    try:
        entry = read_private_json(entry_path(directory, cluster_id), os.geteuid(), ENTRY_MAX_BYTES)
    except FileNotFoundError:
        return None
    except ValueError as exc:
        log.warning("ignoring registry entry: %s", exc)
        return None
    if not _well_formed(entry, cluster_id):
        log.warning("ignoring malformed registry entry %s", entry_path(directory, cluster_id))
        return None
    result: RegistryEntry = entry
    return result


def read_request(directory: Path, cluster_id: str) -> dict[str, Any] | None:
    """The request left for ``cluster_id`` if the directory's owner wrote it and it is small; else None."""
    path = request_path(directory, cluster_id)
    try:
        request = read_private_json(path, os.lstat(directory).st_uid, REQUEST_MAX_BYTES)
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as exc:
        log.warning("ignoring request: %s", exc)
        return None
    return request if isinstance(request, dict) else None


def _pending(directory: Path, cluster_id: str) -> PendingModel | None:
    request = read_request(directory, cluster_id)
    if request is None or request.get("action") not in ("stop", "scale"):
        return None
    size, at = request.get("size"), request.get("requested_at")
    return {"action": request["action"], "size": size if isinstance(size, int) else None,
            "requested_at": at if isinstance(at, int | float) else 0.0}


def leftovers(entry: RegistryEntry) -> list[Any]:
    """The processes recorded in ``entry`` that still run and prove to be its cluster's (psutil.Process)."""
    return proven_processes(entry["processes"], entry["model"]["id"])


def _normalise_owner(model: ClusterModel) -> None:
    owner: Any = model["owner"]
    owner.setdefault("notebook", None)
    owner.setdefault("server_pid", None)
    model.setdefault("this_server", False)


def judge(directory: Path, entry: RegistryEntry) -> tuple[ClusterModel, int]:
    """The model as a reader should show it, and how many of a stale cluster's processes are left running.

    Stale (its owner died): ``error`` says what is left (proven processes only); running: rank deaths counted;
    ``pending`` from a request file.
    """
    model = entry["model"]
    _normalise_owner(model)
    model["pending"] = _pending(directory, model["id"])
    owner = model["owner"]
    if not owner_alive(owner["pid"], entry["owner_create_time"]):
        left = len(leftovers(entry))
        who = "kernel" if owner["kind"] == "kernel" else "Jupyter server"
        model["state"], model["engines_up"] = "stale", 0
        idle = kept_idle_s(entry)
        if idle is not None and left:
            model["error"] = (f"kept: its kernel (pid {owner['pid']}) ended and its ranks still run; "
                              f"%taco_cluster adopt {model['name']} in a notebook takes it over, variables and all; "
                              f"stopped {idle / 60:g} min after its kernel ended unless adopted; Stop ends it now")
            return model, left
        model["error"] = (f"its {who} (pid {owner['pid']}) died; {left} process{'es' if left != 1 else ''} "
                          f"it started {'are' if left != 1 else 'is'} still running: Stop kills "
                          f"{'them' if left != 1 else 'it'}" if left else
                          f"its {who} (pid {owner['pid']}) died; nothing it started is still running")
        return model, left
    local = {}
    for item in entry["processes"]:
        if isinstance(item, list | tuple) and len(item) == 2:
            local[item[0]] = item[1]
    dead = [(rank, pid) for rank, pid in entry["rank_pids"] if pid in local and not owner_alive(pid, local[pid])]
    if dead and model["state"] in ("running", "broken"):
        model["engines_up"] = max(0, model["engines_up"] - len(dead))
        model["state"] = "broken"
        model["error"] = model["error"] or ", ".join(f"rank {r} (pid {p})" for r, p in dead) + " exited"
    return model, 0


def _prune(directory: Path, model: ClusterModel) -> None:
    log.info("removed the registry entry of cluster %s: %s", model["id"], model["error"])
    _unlink(entry_path(directory, model["id"]))
    _unlink(request_path(directory, model["id"]))
    remove_cluster_files(model["id"])


def read_model(directory: Path, cluster_id: str, prune: bool = False) -> ClusterModel | None:
    """The judged model of ``cluster_id``, or None; ``prune`` as for :func:`read_models`."""
    if not checked_dir(directory):
        return None
    entry = read_entry(directory, cluster_id)
    if entry is None:
        return None
    model, left = judge(directory, entry)
    if prune and model["state"] == "stale" and not left:
        _prune(directory, model)
        return None
    return model


def read_models(directory: Path, exclude: set[str] | frozenset[str] = frozenset(),
                prune: bool = False) -> list[ClusterModel]:
    """Every cluster in ``directory`` but those in ``exclude``, oldest first.

    ``prune``: remove the entries of stale clusters that left nothing running instead of listing them.
    """
    if not checked_dir(directory):
        return []
    models = []
    for path in directory.glob("*.json"):
        cluster_id = path.name[: -len(".json")]
        if path.name.startswith(".") or cluster_id.endswith(".request") or cluster_id in exclude:
            continue
        entry = read_entry(directory, cluster_id)
        if entry is None:
            continue
        model, left = judge(directory, entry)
        if prune and model["state"] == "stale" and not left:
            _prune(directory, model)
            continue
        models.append(model)
    return sorted(models, key=lambda m: (m["started_at"] or m["updated_at"], m["id"]))


def write_request(directory: Path, cluster_id: str, action: Action, size: int | None) -> PendingModel:
    """Ask the owning kernel to stop or scale ``cluster_id``; it acts when no cell runs there."""
    pending: PendingModel = {"action": action, "size": size, "requested_at": time.time()}
    write_atomic(request_path(directory, cluster_id), pending)
    return pending


def discard_stale(directory: Path, cluster_id: str) -> list[int]:
    """Remove a stale entry and kill what its dead owner left running; returns the pids killed. ipyparallel's
    files of the cluster go too (:func:`~taco_notebook.cluster.launch.ippfiles.remove_cluster_files`).

    Only the processes that prove to be this cluster's are killed (this user's, started at the recorded time,
    carrying ``TACO_CLUSTER_ID=<cluster_id>``): never a process merely named in the file.
    """
    import psutil

    checked_dir(directory)
    entry = read_entry(directory, cluster_id)
    left = leftovers(entry) if entry else []
    mapped = sorted(mapped_shared_memory(left))  # the segments MPI made after the entry was written too
    killed = []
    for process in left:
        try:
            process.kill()
            killed.append(process.pid)
        except psutil.Error:
            pass
    if entry is not None:
        _unlink_own_shared_memory([*entry.get("shared_memory", []), *mapped])
    _unlink(entry_path(directory, cluster_id))
    _unlink(request_path(directory, cluster_id))
    remove_cluster_files(cluster_id)
    return killed


def _unlink_own_shared_memory(paths: Any) -> None:
    """Remove the listed MPI segments that are files directly in /dev/shm and this user's (a name in a file is
    not taken on its word)."""
    if not isinstance(paths, list):
        return
    for path in paths:
        if not isinstance(path, str) or os.path.dirname(path) != "/dev/shm":
            continue
        try:
            if os.lstat(path).st_uid == os.getuid():
                os.unlink(path)
        except OSError:  # gone already, or not a file we may remove
            pass
