"""The cluster state model: one typed structure for the registry files, the REST API and the sidebar.

It sits below both ``cluster/`` (which builds it, :meth:`~taco_notebook.cluster.session.TacoCluster.model`) and
``server/`` (which serves it); ``labextension/src/models.ts`` mirrors these TypedDicts field for field: change
both together. No imports from the rest of the package.
"""

from __future__ import annotations

from typing import Literal, TypedDict

__all__ = [
    "State", "OwnerKind", "Action", "Owner", "NodeModel", "HugePagesModel", "RunModel", "PendingModel",
    "ClusterModel", "ClusterList", "ErrorModel", "StartRequest", "ScaleRequest",
]

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


class ClusterModel(TypedDict):
    """One cluster as the sidebar shows it. ``id`` is the ipyparallel cluster_id; ``stale``: its owner is dead.

    ``this_server``: owned by the Jupyter server answering, or by one of its kernels (computed when served).
    """

    id: str
    name: str
    profile: str
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
