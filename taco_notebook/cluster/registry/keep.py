"""Ranks that outlive their kernel: ``%taco_cluster keep`` and ``%taco_cluster adopt``.

A kept cluster is not stopped when its kernel exits or dies (:data:`~taco_notebook.cluster.session.kept`; its
entry says so, :func:`~.writer.keep_entry`). Its controller, mpiexec and ranks run in sessions of their own, so
they go on, every rank's variables with them. The sidebar shows it as *kept*, with Stop. The kernel's reaper
(:mod:`.reaper`) waits for it and stops it :data:`IDLE_S` after its kernel ended, unless another kernel adopts
it first.

``adopt`` is the new owner taking over. It connects to the cluster's controller through ipyparallel's cluster
file, checks that the engines are still the MPI ranks the entry lists, and rewrites the entry with itself as
owner. From then on the cluster is this kernel's, as if it had started it: stopped with it, kept again only if
asked.
"""

from __future__ import annotations

import os
import time

from ...errors import ClusterStartError
from ...model import ClusterModel
from ..launch.ippfiles import profile_dir
from ..launch.profiles import LOCAL, mpi_for
from ..session import TacoCluster, clusters, kept
from .files import RegistryEntry, kept_idle_s, leftovers, read_entry, read_models, registry_dir
from .writer import keep_entry, track

__all__ = ["IDLE_ENV", "IDLE_S", "AdoptError", "idle_seconds", "keep", "adoptable", "AdoptedCluster", "adopt"]

IDLE_ENV = "TACO_KEEP_IDLE"  # seconds an unadopted kept cluster outlives its kernel
IDLE_S = 3600.0  # by default an hour: enough to restart a kernel and adopt, not enough to forget it overnight


class AdoptError(ClusterStartError):
    """No cluster to adopt, or not that one: the message says why and what to do."""


def idle_seconds() -> float:
    """``$TACO_KEEP_IDLE`` when it is a positive number of seconds, else :data:`IDLE_S`."""
    text = os.environ.get(IDLE_ENV, "")
    try:
        value = float(text)
    except ValueError:
        return IDLE_S
    return value if value > 0 else IDLE_S


def keep(cluster: TacoCluster, idle_s: float | None = None) -> float:
    """Let ``cluster`` outlive this process (its exit, a restart, a kill) for another kernel to adopt; returns
    how long it waits unadopted."""
    if cluster.owner_kind != "kernel" or not cluster.running or not cluster.cluster_id:
        raise AdoptError(f"cluster {cluster.name!r} is not a running cluster this kernel started: only those can "
                         "be kept")
    idle = idle_s if idle_s is not None else idle_seconds()
    track(cluster)  # already tracked by the magics; a cluster started otherwise gets its entry now
    kept.add(cluster.cluster_id)
    keep_entry(cluster, idle)
    return idle


def adoptable(name: str) -> tuple[ClusterModel, RegistryEntry]:
    """The registry's kept cluster named (or with id) ``name`` whose kernel has ended: its model and entry."""
    directory = registry_dir()
    kept_ones = [(m, e) for m in read_models(directory)
                 if (e := read_entry(directory, m["id"])) is not None and kept_idle_s(e) is not None]
    named = [(m, e) for m, e in kept_ones if name in (m["name"], m["id"])]
    free = [(m, e) for m, e in named if m["state"] == "stale"]  # stale: its kernel ended
    if len(free) == 1:
        return free[0]
    if len(free) > 1:
        ids = ", ".join(m["id"] for m, _ in free)
        raise AdoptError(f"{len(free)} kept clusters are named {name!r} (ids {ids}): adopt one by its id")
    if named:
        raise AdoptError(f"cluster {name!r} is kept by kernel {named[0][0]['owner']['pid']}, which still runs: "
                         "it can be adopted once that kernel has ended (restart or shut it down)")
    waiting = sorted(m["name"] for m, _ in kept_ones if m["state"] == "stale")
    raise AdoptError(f"no kept cluster named {name!r} waits to be adopted (%taco_cluster keep marks one in the "
                     f"kernel that runs it); waiting: {', '.join(waiting) or 'none'}")


class AdoptedCluster(TacoCluster):
    """A kept cluster this kernel took over: its processes were started by a kernel that has ended."""

    def take_over(self, model: ClusterModel, entry: RegistryEntry, timeout: float) -> None:
        """Connect to it through its ipyparallel cluster file and check its engines are the ranks the entry
        lists; then it is this kernel's, running."""
        from ...ipp import upstream as ipp
        from ...ipp.client import connect

        self.mpi = mpi_for(self.profile, None, None)
        self.ipp_cluster = ipp.Cluster.from_file(profile_dir=str(profile_dir()), cluster_id=self.cluster_id)
        self.client = connect(self.ipp_cluster)
        self.client.wait_for_engines(self.size, timeout=timeout, interactive=False)
        self.check_ranks()
        listed = sorted(pid for _, pid in entry["rank_pids"])
        if sorted(r.pid for r in self.ranks) != listed:
            raise AdoptError(f"cluster {self.name!r}'s engines are not the ranks its kernel kept (pids {listed})")
        self.processes = leftovers(entry)
        self.shared_memory = set(entry.get("shared_memory", []))
        self.started_at = model["started_at"] or time.time()

    def disconnect(self) -> None:
        """Let go of the connection and stop nothing: the cluster stays kept, for another try."""
        client, self.client, self.ipp_cluster, self.ranks = self.client, None, None, []
        if client is not None:
            client.close()


def adopt(name: str, timeout: float = 30.0) -> AdoptedCluster:
    """Take over the kept cluster ``name`` (or id): connected, listed as this kernel's in the registry, in
    :data:`~taco_notebook.cluster.session.clusters` under its name."""
    model, entry = adoptable(name)
    if clusters.get(model["name"]) is not None and clusters[model["name"]].running:
        raise AdoptError(f"this kernel already runs a cluster named {model['name']!r}: stop it first "
                         f"(%taco_cluster stop --cluster {model['name']})")
    if model["profile"] != LOCAL.name:
        raise AdoptError(f"cluster {model['name']!r} runs on the {model['profile']} profile: adopting is for "
                         "clusters of this machine (profile local) only")
    cluster = AdoptedCluster(model["name"], model["size"], cluster_id=model["id"])
    try:
        cluster.take_over(model, entry, timeout)
    except Exception as exc:
        cluster.disconnect()
        if isinstance(exc, AdoptError):
            raise
        raise AdoptError(f"cannot adopt cluster {model['name']!r} ({model['id']}): {exc}") from exc
    track(cluster)
    clusters[cluster.name] = cluster
    cluster.set_run(None)  # an event: the entry is written with this kernel as its owner
    return cluster
