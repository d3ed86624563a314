"""ClusterManager: the logic behind the REST API, over the cluster registry. No tornado here.

Two kinds of cluster, one list:

- kernel-owned (started by ``%%taco_run`` / ``%taco_cluster`` in a notebook kernel): read from the registry.
  The server cannot call into a kernel, so stop and scale leave a request file that the kernel's watcher
  carries out between cells; until then the model shows it as ``pending``. An entry whose kernel died is
  removed as soon as it is read if nothing of its cluster runs any more; otherwise it is ``stale``, its
  ``error`` says how many processes are left, and deleting it kills those that prove to be the cluster's
  (see :func:`~taco_notebook.cluster.registry.files.discard_stale`), never a pid merely named in the file.
- server-owned (``POST /clusters``): plain :class:`TacoCluster` objects in this process, started, stopped and
  scaled in worker threads (never on the server's event loop), written to the registry by
  :func:`~taco_notebook.cluster.registry.writer.track`, and all stopped by :meth:`ClusterManager.shutdown`
  (the extension's shutdown hook, :class:`~taco_notebook.server.handlers.TacoServerExtension`). Their state
  (pending action, last error) lives on the cluster; the manager keeps only a dict of them by id.

Every blocking method has an async twin ``<method>_async`` that runs it in a worker thread
(:func:`asyncio.to_thread`): the REST handlers await the twins, so the event loop never waits on the disk or on
processes being killed; tests, kernels and scripts call the plain methods, written once, synchronously.

Every method returns models and raises :class:`BadRequest`, :class:`NotFound` or :class:`Conflict` (or
:class:`UnsafeRegistry` when the registry directory could be controlled by another user). Each model served says
whether it belongs to this server (``this_server``): its own clusters and those of its kernels.
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from .._version import __version__
from ..cluster.describe import new_cluster_id
from ..cluster.launch import ippfiles
from ..cluster.launch.limits import SizeLimitError, max_ranks
from ..cluster.registry import files as registry_files
from ..cluster.registry.writer import track
from ..cluster.session import TacoCluster
from ..model import ClusterList, ClusterModel
from ..private import UnsafeDirectoryError
from .requests import (
    BadRequest,
    Conflict,
    ManagerError,
    NotFound,
    check_cluster_id,
    parse_peek_request,
    parse_scale_request,
    parse_start_request,
)

__all__ = ["ClusterManager", "BadRequest", "NotFound", "Conflict", "UnsafeRegistry"]


class UnsafeRegistry(ManagerError):
    """The registry directory is not this user's alone: nothing in it is read or acted on (the message says why
    and how to fix it). A server-side condition, hence a 500 that names it."""

    status = 500


log = logging.getLogger("taco_notebook")

Body = bytes | str | Mapping[str, Any]

P = ParamSpec("P")
R = TypeVar("R")


def _off_loop(
    method: Callable[Concatenate[ClusterManager, P], R],
) -> Callable[Concatenate[ClusterManager, P], Coroutine[Any, Any, R]]:
    """The async twin of a blocking manager method: the same call, run in a worker thread so that the awaiting
    event loop goes on serving other requests meanwhile; the method's errors propagate unchanged."""

    @functools.wraps(method)
    async def twin(self: ClusterManager, *args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(method, self, *args, **kwargs)

    twin.__name__ = f"{method.__name__}_async"
    twin.__qualname__ = f"{method.__qualname__}_async"
    twin.__doc__ = f"Awaitable :meth:`{method.__name__}`, run in a worker thread (off the event loop)."
    return twin


SWEEP_S = 60.0  # list() sweeps dead owners' ipyparallel files at most this often


class ClusterManager:
    """Lists, starts, stops and scales clusters; ``registry_dir`` defaults to
    :func:`~taco_notebook.cluster.registry.files.registry_dir`."""

    def __init__(self, registry_dir: str | os.PathLike[str] | None = None, max_workers: int = 4) -> None:
        self.directory: Path = registry_files.registry_dir(registry_dir)
        self._clusters: dict[str, TacoCluster] = {}  # the clusters this server started, by id
        self._lock = threading.Lock()
        # a request to a kernel's cluster is checked, then written: one at a time, now that the handlers call in
        # from several threads, so that of two at once the second sees the first's pending request (409)
        self._request_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="taco-cluster")
        self._closed = False
        self._swept_at: float | None = None  # when list() last swept dead owners' ipyparallel files

    # ---------------------------------------------------------------- reading
    def version(self) -> dict[str, Any]:
        """``{"version", "max_ranks"}``: the sidebar caps its size dialog at ``max_ranks``."""
        try:
            return {"version": __version__, "max_ranks": max_ranks()}
        except SizeLimitError as exc:
            raise ManagerError(f"the Jupyter server's environment is wrong: {exc}") from None

    @staticmethod
    def _owned_model(cluster: TacoCluster) -> ClusterModel:
        return {**cluster.model(), "this_server": True}

    @staticmethod
    def _served(model: ClusterModel) -> ClusterModel:
        """``model`` with ``this_server`` set: owned by this server or by one of its kernels."""
        owner, me = model["owner"], os.getpid()
        ours = owner["pid"] == me if owner["kind"] == "server" else owner.get("server_pid") == me
        return {**model, "this_server": ours}

    def _read(self, reader: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return reader(self.directory, *args, **kwargs)
        except UnsafeDirectoryError as exc:
            raise UnsafeRegistry(str(exc)) from None

    def list(self) -> ClusterList:
        """Every cluster: this server's, and the registry's (stale entries that left nothing running removed).
        ipyparallel's files of clusters whose owner died are swept on the way, at most every :data:`SWEEP_S`
        (:func:`ippfiles.sweep`: the sidebar lists every second, and an owner's reaper removes them sooner)."""
        now = time.monotonic()
        if self._swept_at is None or now - self._swept_at >= SWEEP_S:
            self._swept_at = now
            ippfiles.sweep()
        with self._lock:
            owned = [self._owned_model(c) for c in self._clusters.values()]
        theirs = self._read(registry_files.read_models, exclude={m["id"] for m in owned}, prune=True)
        return {"clusters": [self._served(m) for m in theirs] + owned}

    def get(self, cluster_id: str) -> ClusterModel:
        check_cluster_id(cluster_id)
        with self._lock:
            owned = self._clusters.get(cluster_id)
            if owned is not None:
                return self._owned_model(owned)
        model = self._read(registry_files.read_model, cluster_id, prune=True)
        if model is None:
            raise NotFound(f"No such cluster: {cluster_id}")
        return self._served(model)

    def stacks(self, cluster_id: str, full: bool = False) -> dict[str, Any]:
        """The hang autopsy of a running cluster (:mod:`taco_notebook.cluster.cells.autopsy`): read from the
        ranks' own listeners, so it works while a cell holds the kernel; the ranks are the registry's (a
        kernel's cluster) or this server's. Never stops or changes a rank. ``full``: every frame in ``text``."""
        from ..cluster.cells.autopsy import collect

        ranks, launcher = self._rank_addresses(cluster_id, "read stacks from")
        report: dict[str, Any] = collect(ranks, launcher_exec=launcher).to_dict(full)
        return report

    def peek(self, cluster_id: str, body: Body) -> dict[str, Any]:
        """``%taco_peek`` of a running cluster: an expression evaluated in each asked rank's namespace by its
        listener, while a cell runs there (:mod:`taco_notebook.cluster.debug.peek`). It runs code on the ranks:
        the route asks Jupyter's ``execute`` permission."""
        from ..cluster.debug.peek import peek

        request = parse_peek_request(body)
        ranks, launcher = self._rank_addresses(cluster_id, "peek into")
        chosen = [r for r in ranks if request["ranks"] is None or r.rank in request["ranks"]]
        if not chosen:
            raise BadRequest(f"cluster {cluster_id} has no rank {request['ranks']}: its ranks are 0-{len(ranks) - 1}")
        return peek(chosen, request["expr"], request["timeout"], launcher).to_dict()

    def _rank_addresses(self, cluster_id: str, verb: str) -> tuple[builtins.list[Any], str | None]:
        """Where a running cluster's ranks are (the registry's for a kernel's cluster, else this server's) and
        the program that reaches their hosts."""
        from ..cluster.cells.autopsy import RankAddress, launcher_of

        model = self.get(cluster_id)
        if model["state"] not in ("running", "broken"):
            raise Conflict(f"cluster {cluster_id} is {model['state']}: it has no ranks to {verb}")
        with self._lock:
            owned = self._clusters.get(cluster_id)
            ranks = [RankAddress(r.rank, r.pid, r.host) for r in owned.ranks] if owned is not None else None
            launcher = launcher_of(owned)  # a kernel's cluster: None, the emulated hosts' stand-in or ssh
        if ranks is None:
            entry = self._read(registry_files.read_entry, cluster_id)
            hosts = {rank: node["host"] for node in model["nodes"] for rank in node["ranks"]}
            ranks = [RankAddress(rank, pid, hosts.get(rank, "?")) for rank, pid in (entry or {}).get("rank_pids", [])]
        if not ranks:
            raise Conflict(f"cluster {cluster_id} has no ranks yet; ask again once it runs")
        return ranks, launcher

    # ---------------------------------------------------------------- actions
    def start(self, body: Body) -> ClusterModel:
        """Start a cluster owned by this server; returns at once with state ``starting``."""
        request = parse_start_request(body)
        name = request.get("name", "default")
        cluster_id = new_cluster_id(name)
        cluster = TacoCluster(name, request["size"], cluster_id=cluster_id, owner_kind="server")
        with self._lock:
            if self._closed:
                raise Conflict("the Jupyter server is shutting down; start the cluster after it restarts")
            self._clusters[cluster_id] = track(cluster, self.directory)
            cluster.announce_start()  # "starting" from now, in this reply and in the registry
            self._pool.submit(self._run, cluster, "start", None)
            return self._owned_model(cluster)

    def stop(self, cluster_id: str) -> ClusterModel:
        """Stop a cluster: now (server-owned), by request (kernel-owned), or discard a stale entry."""
        with self._lock:
            owned = self._clusters.get(check_cluster_id(cluster_id))
            if owned is not None:
                return self._act(owned, "stop", None)
        with self._request_lock:
            model = self.get(cluster_id)
            if model["state"] == "stale":
                killed = self._read(registry_files.discard_stale, cluster_id)
                log.info("removed stale cluster %s; killed the processes it left: %s", cluster_id, killed or "none")
                return {**model, "state": "stopped", "engines_up": 0}
            self._check_requestable(model, "stop")
            return {**model, "pending": self._read(registry_files.write_request, cluster_id, "stop", None)}

    def scale(self, cluster_id: str, body: Body) -> ClusterModel:
        """Restart a cluster with another number of ranks (a new MPI job: MPI fixes the world size at launch)."""
        size = parse_scale_request(body)["size"]
        with self._lock:
            owned = self._clusters.get(check_cluster_id(cluster_id))
            if owned is not None:
                self._check_size(self._owned_model(owned), size)
                return self._act(owned, "scale", size)
        with self._request_lock:
            model = self.get(cluster_id)
            if model["state"] == "stale":
                raise Conflict(f"cluster {cluster_id} is stale (its owner is gone) and cannot be scaled; delete it")
            self._check_requestable(model, "scale")
            self._check_size(model, size)
            return {**model, "pending": self._read(registry_files.write_request, cluster_id, "scale", size)}

    @staticmethod
    def _check_size(model: ClusterModel, size: int) -> None:
        if model["state"] == "running" and model["size"] == size:
            raise Conflict(f"cluster {model['id']} already runs {size} ranks; ask for another size")

    def _check_requestable(self, model: ClusterModel, action: str) -> None:
        cluster_id = model["id"]
        if model["pending"] is not None:
            raise Conflict(f"cluster {cluster_id} already has a pending {model['pending']['action']}; "
                           "it runs when the cell on the cluster ends")
        if model["state"] == "stopping":
            raise Conflict(f"cluster {cluster_id} is stopping; cannot {action} it")
        if model["owner"]["kind"] == "server":  # another server's: only its manager acts on it
            raise Conflict(f"cluster {cluster_id} belongs to another Jupyter server (pid "
                           f"{model['owner']['pid']}); {action} it there")

    def _act(self, cluster: TacoCluster, action: str, size: int | None) -> ClusterModel:
        """Queue ``action`` on a server-owned cluster (caller holds the lock)."""
        if cluster.pending is not None or cluster.state == "stopping":
            what = f"a pending {cluster.pending['action']}" if cluster.pending else "a stop in progress"
            raise Conflict(f"cluster {cluster.cluster_id} already has {what}; try again when it is done")
        if self._closed:
            raise Conflict("the Jupyter server is shutting down and stops every cluster it started")
        cluster.request("stop" if action == "stop" else "scale", size)
        self._pool.submit(self._run, cluster, action, size)
        return self._owned_model(cluster)

    def _run(self, cluster: TacoCluster, action: str, size: int | None) -> None:
        """Worker thread: carry out one action; ``busy`` keeps actions on one cluster in order."""
        with cluster.busy:
            with self._lock:
                cluster.take_request()
            try:
                if action == "stop":
                    cluster.stop()
                elif action == "scale" and size is not None:
                    cluster.scale(size)
                else:
                    cluster.start()
            except Exception as exc:  # a worker thread: the error goes to the model, where the sidebar shows it
                log.warning("cluster %s: %s failed: %s", cluster.cluster_id, action, exc)
                with self._lock:
                    cluster.fail(f"{action} failed: {exc}")
                return
            if action == "stop":
                with self._lock:
                    self._clusters.pop(cluster.cluster_id or "", None)

    def shutdown(self) -> builtins.list[str]:
        """Stop every cluster this server started (waits for starts in progress); their names. Idempotent."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            owned = list(self._clusters.values())
            self._clusters.clear()
        for cluster in owned:
            cluster.stop()
        return [cluster.name for cluster in owned]

    # ------------------------------------------------ async twins, for the event loop
    version_async = _off_loop(version)
    list_async = _off_loop(list)
    get_async = _off_loop(get)
    stacks_async = _off_loop(stacks)
    peek_async = _off_loop(peek)
    start_async = _off_loop(start)
    stop_async = _off_loop(stop)
    scale_async = _off_loop(scale)
    shutdown_async = _off_loop(shutdown)
