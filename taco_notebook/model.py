"""The cluster state model: one typed structure for the registry files, the REST API and the sidebar.

It sits below both ``cluster/`` (which builds it, :meth:`~taco_notebook.cluster.session.TacoCluster.model`) and
``server/`` (which serves it); ``labextension/src/models.ts`` mirrors these TypedDicts field for field
(``tests/server/test_models_ts.py`` compares them). No imports from the rest of the package.

Its last section defines how far a running cell got (:func:`cell_progress`), once for the sidebar's ``run`` and
the dashboard under the cell.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict

__all__ = [
    "State", "OwnerKind", "Action", "Owner", "NodeModel", "HugePagesModel", "RunModel", "PendingModel",
    "LostRankModel", "MembershipModel",
    "ClusterModel", "ClusterList", "ErrorModel", "StartRequest", "ScaleRequest",
    "CellProgress", "cell_progress", "slowest_rank", "PEEK_TIMEOUT_S",
]

PEEK_TIMEOUT_S = 5.0  # the longest a peek (REST, magic, the ranks' listener) waits for its expression on a rank

State = Literal["starting", "running", "stopping", "broken", "stopped", "stale"]
OwnerKind = Literal["kernel", "server"]
Action = Literal["stop", "scale"]


class Owner(TypedDict):
    """The process that owns a cluster: a notebook kernel, or the Jupyter server (clusters started via REST).

    ``notebook``: the kernel's session path (``JPY_SESSION_NAME``), None when unknown or server-owned;
    ``server_pid``: the Jupyter server the kernel belongs to (``JPY_PARENT_PID``), or the owning server itself.
    """

    kind: OwnerKind
    pid: int
    notebook: str | None
    server_pid: int | None


class NodeModel(TypedDict):
    """One node of a cluster: its index, host name, the MPI ranks on it and the GPUs they can see."""

    node: int
    host: str
    ranks: list[int]
    gpus: int
    gpu_names: list[str]  # models of those GPUs (from the driver's /proc files), one per GPU


class HugePagesModel(TypedDict):
    """Huge pages of the rank-0 host (``/proc/meminfo``); HARP-style network stacks need them on every node."""

    total: int
    free: int
    page_kb: int


class RunModel(TypedDict):
    """The cell running on a cluster, as the kernel's cell runner last reported it."""

    cell: str
    started_at: float
    step: int
    total: int | None
    samples_per_s: float | None


class PendingModel(TypedDict):
    """A stop or scale asked for but not yet carried out (a kernel acts only when no cell runs)."""

    action: Action
    size: int | None
    requested_at: float


class LostRankModel(TypedDict):
    """A rank an elastic cluster lost: its rank then, its host, how it ended (``SIGKILL``) and when."""

    rank: int
    host: str
    how: str
    at: float


class MembershipModel(TypedDict):
    """An elastic cluster's membership (``%%taco_run --elastic MIN:MAX``): its bounds, the ranks it lost, how
    many joined, and the hosts sitting out a cooldown after failing repeatedly."""

    min: int
    max: int
    lost: list[LostRankModel]
    joined: int
    blacklisted: list[str]


class ClusterModel(TypedDict):
    """One cluster as the sidebar shows it. ``id`` is the ipyparallel cluster_id; ``stale``: its owner is dead.

    ``this_server``: owned by the Jupyter server answering, or by one of its kernels (computed when served).
    """

    id: str
    name: str
    profile: str  # how its engines launch: local, hosts, slurm or mpijob (cluster/launch/profiles.py)
    owner: Owner
    this_server: bool
    state: State
    size: int
    engines_up: int
    mpi: str
    nodes: list[NodeModel]
    gpus: int
    hugepages: HugePagesModel | None
    started_at: float | None
    updated_at: float
    run: RunModel | None
    pending: PendingModel | None
    error: str | None
    membership: MembershipModel | None  # None until an elastic cell ran on it


class ClusterList(TypedDict):
    clusters: list[ClusterModel]


class ErrorModel(TypedDict):
    """Body of every 4xx/5xx reply (written by jupyter_server's ``APIHandler.write_error``)."""

    message: str
    reason: str


class StartRequest(TypedDict, total=False):
    """``POST /taco-notebook/api/clusters``: ``size`` is required."""

    size: int
    name: str


class ScaleRequest(TypedDict):
    """``PATCH /taco-notebook/api/clusters/{id}``."""

    size: int


# ---------------------------------------------------------------- progress of a running cell

class CellProgress(TypedDict):
    """How far a cell got: what the sidebar's :class:`RunModel` and the dashboard's bar and status line show."""

    step: int
    total: int | None
    samples_per_s: float | None


def _positions(payloads: Mapping[int, Mapping[str, Any]]) -> dict[int, int]:
    """Each reporting rank's position: its ``taco.progress`` count where some rank runs such a loop (the unit of
    ``total``), else its optimizer steps (``metrics["steps"]``). Ranks that report neither are left out."""
    loops = {r: int(p["progress"]["n"]) for r, p in payloads.items() if p.get("progress")}
    if loops:
        return loops
    return {r: int(p["metrics"].get("steps", 0)) for r, p in payloads.items() if p.get("metrics")}


def slowest_rank(payloads: Mapping[int, Mapping[str, Any]]) -> int | None:
    """The rank furthest behind (the lowest rank among equals), None when no rank reports a position."""
    positions = _positions(payloads)
    return min(positions, key=lambda rank: (positions[rank], rank)) if positions else None


def cell_progress(payloads: Mapping[int, Mapping[str, Any]]) -> CellProgress:
    """The cell's progress from the ranks' latest payloads (``{rank: {"metrics": snapshot, "progress": state}}``,
    either part may be missing or None).

    ``step`` is the **slowest** rank's position (see :func:`_positions`): in synchronous data-parallel training
    every step ends in a collective, so no rank can get more than the pipeline's depth ahead of the slowest, and
    the job is done only when the slowest rank is; the fastest rank's count would promise progress that the job
    has not made. ``total`` is the largest loop length any rank announced (None without a sized loop);
    ``samples_per_s`` the sum over ranks of samples over each rank's elapsed seconds (None before any samples).

    >>> cell_progress({0: {"progress": {"n": 5, "total": 10}}, 1: {"progress": {"n": 4, "total": 10}}})
    {'step': 4, 'total': 10, 'samples_per_s': None}
    """
    positions = _positions(payloads)
    totals = [int(p["progress"]["total"]) for p in payloads.values()
              if p.get("progress") and p["progress"].get("total") is not None]
    rate = sum(float(m.get("samples", 0)) / float(m["elapsed_seconds"])
               for m in (p.get("metrics") for p in payloads.values()) if m and m.get("elapsed_seconds"))
    return {"step": min(positions.values(), default=0), "total": max(totals) if totals else None,
            "samples_per_s": rate if rate > 0 else None}
