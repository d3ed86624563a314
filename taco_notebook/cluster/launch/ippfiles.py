"""Where ipyparallel keeps taco's clusters' files, who owns them, and their removal once no one needs them.

ipyparallel writes, for each cluster, ``security/cluster-ID.json`` (in the owning process), the controller's
connection files ``security/ipcontroller-ID-{client,engine}.json``, the processes' logs and ``log/enginesID.json``
(the hub's engine state). They live in :func:`profile_dir`, ``$IPYTHONDIR/taco-ipyparallel``: not an IPython
``profile_*`` directory, so ipyparallel's own JupyterLab panel, which lists the clusters and profiles it finds in
those, shows neither taco's clusters nor a profile to start one in.

Beside them :func:`prepare` writes ``security/taco-owner-ID.json``: the owning process (pid, start time, host,
boot id). A stop removes all of a cluster's files (:func:`remove_cluster_files`). An owner killed without a stop
(``kill -9``) leaves them: its reaper removes them with its registry entry and the processes, and whoever next
starts a cluster or lists them (the server) sweeps the files of every cluster whose owner proves dead (on this
host, in an earlier boot or with no process of its pid started at its time) and of which nothing runs
(:func:`sweep`). Only this user's files are read or removed.
"""

from __future__ import annotations

import os
import re
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from ...private import private_ipython_profile, read_private_json, write_private_json
from ..processes.tree import marked_processes

__all__ = ["PROFILE_DIR_NAME", "OwnerRecord", "profile_dir", "prepare", "cluster_files", "remove_cluster_files",
           "read_owners", "sweep"]

PROFILE_DIR_NAME = "taco-ipyparallel"  # in $IPYTHONDIR; a "profile_" prefix would put it in ipyparallel's panel
OWNER_PREFIX, OWNER_MAX_BYTES = "taco-owner-", 4096
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class OwnerRecord:
    """The process that owns cluster ``cluster_id``'s files, as :func:`prepare` wrote it."""

    cluster_id: str
    pid: int
    create_time: float
    host: str
    boot_id: str | None

    def proven_dead(self) -> bool:
        """True only when the owner surely ended: on this host, and another boot or no such process now.
        Another host's owner (a home shared over NFS) cannot be judged from here: False."""
        if self.host != socket.gethostname():
            return False
        now = _boot_id()
        if self.boot_id and now and self.boot_id != now:
            return True
        import psutil

        try:
            process = psutil.Process(self.pid)
            return process.status() == psutil.STATUS_ZOMBIE or abs(process.create_time() - self.create_time) >= 0.01
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:  # not ours to inspect: not proven
            return False


def profile_dir() -> Path:
    """``$IPYTHONDIR/taco-ipyparallel`` (``~/.ipython/taco-ipyparallel``): ipyparallel's profile for taco's
    clusters. Computing it creates nothing."""
    return Path(os.environ.get("IPYTHONDIR") or "~/.ipython").expanduser().absolute() / PROFILE_DIR_NAME


def prepare(cluster_id: str) -> Path:
    """Before a cluster starts: the profile made private, the files of dead owners swept, this process recorded as
    ``cluster_id``'s owner; returns the profile directory."""
    directory = Path(private_ipython_profile(profile_dir()))
    sweep(directory)
    import psutil

    me = psutil.Process()
    write_private_json(_owner_path(directory, cluster_id), {
        "pid": me.pid, "create_time": me.create_time(), "host": socket.gethostname(), "boot_id": _boot_id()},
        "ipyparallel profile")
    return directory


def cluster_files(cluster_id: str, directory: Path | None = None) -> list[Path]:
    """Every file of ``cluster_id`` in the profile: ipyparallel's (cluster file, connection files, logs, engine
    state) and the owner record; matched by exact name, so another cluster's id that starts with this one is safe."""
    directory = directory or profile_dir()
    cid = re.escape(cluster_id)
    patterns = {"security": re.compile(rf"(cluster-{cid}|ipcontroller-{cid}-(client|engine)|{OWNER_PREFIX}{cid})"
                                       r"\.json"),
                "log": re.compile(rf"engines{cid}\.json|ipcontroller-{cid}-\d+\.log|ipengine-{cid}-\d+-\d+\.log")}
    found = []
    for sub, pattern in patterns.items():
        try:
            with os.scandir(directory / sub) as entries:
                found += [Path(e.path) for e in entries if pattern.fullmatch(e.name) and _own_file(e.path)]
        except OSError:  # no such directory yet
            continue
    return sorted(found)


def remove_cluster_files(cluster_id: str, directory: Path | None = None) -> list[Path]:
    """Remove :func:`cluster_files` of ``cluster_id``; returns those removed."""
    removed = []
    for path in cluster_files(cluster_id, directory):
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:  # removed meanwhile by ipyparallel or another sweep
            pass
    return removed


def read_owners(directory: Path | None = None) -> list[OwnerRecord]:
    """The owner records in the profile that this user wrote and that are well formed."""
    security = (directory or profile_dir()) / "security"
    records = []
    for path in sorted(security.glob(f"{OWNER_PREFIX}*.json")):
        try:
            data = read_private_json(path, os.geteuid(), OWNER_MAX_BYTES)
            record = OwnerRecord(path.name[len(OWNER_PREFIX):-len(".json")], int(data["pid"]),
                                 float(data["create_time"]), str(data["host"]), data.get("boot_id"))
        except (OSError, ValueError, TypeError, KeyError):  # gone, another user's, too large or malformed
            continue
        records.append(record)
    return records


def sweep(directory: Path | None = None) -> list[str]:
    """Remove the files of every cluster whose owner proves dead and of which no process runs any more (a process
    of this user marked with its id); returns their ids. Processes left are the reaper's or the sidebar's Stop's
    to end (:func:`~taco_notebook.cluster.registry.files.discard_stale`, which removes the files too)."""
    swept = []
    for record in read_owners(directory):
        if record.proven_dead() and not marked_processes(record.cluster_id):
            remove_cluster_files(record.cluster_id, directory)
            swept.append(record.cluster_id)
    return swept


def _owner_path(directory: Path, cluster_id: str) -> Path:
    return directory / "security" / f"{OWNER_PREFIX}{cluster_id}.json"


def _own_file(path: str) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return info.st_uid == os.geteuid() and stat.S_ISREG(info.st_mode)


def _boot_id() -> str | None:
    try:
        return BOOT_ID.read_text().strip() or None
    except OSError:  # not Linux
        return None
