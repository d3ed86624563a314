"""What a cluster is made of and the parts of its model derived from that, each in one place: its ranks
(:class:`RankInfo`), its id, its owner, its nodes.

:meth:`~taco_notebook.cluster.session.TacoCluster.model` builds the whole
:class:`~taco_notebook.model.ClusterModel` from these; the kernel (``%%taco_run``) and the server extension
(``POST /clusters``) both name new clusters with :func:`new_cluster_id`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..model import HugePagesModel, NodeModel, Owner, OwnerKind

__all__ = ["RankInfo", "new_cluster_id", "owner_of", "nodes_of", "hugepages_of"]


@dataclass(frozen=True)
class RankInfo:
    """One engine: its rank, where it runs, its placement, and what its host offers.

    ``engine_id``: its ipyparallel engine id. It equals the MPI rank at start; after an elastic membership change
    (cluster/elastic/recovery.py) ranks are renumbered 0..n-1 over the live engines and the two differ.

    ``gpus``: NVIDIA GPUs the rank can see (``CUDA_VISIBLE_DEVICES`` applied); ``hugepages``: its host's
    ``/proc/meminfo`` huge pages as ``{"total", "free", "page_kb"}``, or None where the kernel has none.
    """

    rank: int
    host: str
    pid: int
    local_rank: int
    node: int
    gpus: int = 0
    hugepages: dict[str, int] | None = field(default=None, compare=False)
    gpu_names: list[str] = field(default_factory=list, compare=False)  # models of those GPUs, from /proc
    engine_id: int = field(default=-1, compare=False)  # -1: not known (taken to equal the rank)

    @classmethod
    def of_engine(cls, engine_id: int, info: dict[str, Any]) -> RankInfo:
        """From :func:`~taco_notebook.engine.calls.rank_info`'s dict, as engine ``engine_id`` answered it."""
        return cls(**info, engine_id=engine_id)


def new_cluster_id(name: str) -> str:
    """``{name}-{pid}-{6 hex}``: ipyparallel's cluster id, the registry file's name, and the proof a process is
    the cluster's (``TACO_CLUSTER_ID``); the pid and random part keep two kernels' ``default`` apart."""
    return f"{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def owner_of(kind: OwnerKind) -> Owner:
    """This process as a cluster's owner: a kernel names its notebook (``JPY_SESSION_NAME``) and its Jupyter
    server (``JPY_PARENT_PID``), both set by Jupyter in the kernel's environment; a server names itself."""
    if kind == "server":
        return {"kind": kind, "pid": os.getpid(), "notebook": None, "server_pid": os.getpid()}
    parent = os.environ.get("JPY_PARENT_PID", "")
    return {"kind": kind, "pid": os.getpid(), "notebook": os.environ.get("JPY_SESSION_NAME") or None,
            "server_pid": int(parent) if parent.isdigit() and int(parent) > 0 else None}


def nodes_of(ranks: Iterable[RankInfo]) -> list[NodeModel]:
    """The nodes the ranks run on, in node order; a node's GPUs counted once (its ranks see the same devices)."""
    nodes: dict[int, NodeModel] = {}
    for rank in sorted(ranks, key=lambda r: r.rank):
        node = nodes.setdefault(rank.node, {"node": rank.node, "host": rank.host, "ranks": [], "gpus": 0,
                                            "gpu_names": []})
        node["ranks"].append(rank.rank)
        node["gpus"] = max(node["gpus"], rank.gpus)
        if len(rank.gpu_names) > len(node["gpu_names"]):
            node["gpu_names"] = list(rank.gpu_names)
    return [nodes[n] for n in sorted(nodes)]


def hugepages_of(ranks: Iterable[RankInfo]) -> HugePagesModel | None:
    """Rank 0's host's huge pages (None where its kernel has none)."""
    first = min(ranks, key=lambda r: r.rank, default=None)
    pages = first.hugepages if first is not None else None
    return {"total": pages["total"], "free": pages["free"], "page_kb": pages["page_kb"]} if pages else None
