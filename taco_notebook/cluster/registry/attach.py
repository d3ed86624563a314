"""Run a kernel's cells on a cluster another process owns: one started from the JupyterLab sidebar.

The sidebar's "New cluster" starts a cluster in the Jupyter server and its "Insert cell" button writes
``%%taco_run -np N --cluster NAME``; that cell finds the cluster in the registry and attaches to it through
ipyparallel's cluster file instead of starting a second cluster of the same name. The owner keeps the
lifecycle: stopping it from the kernel only disconnects; stop and scale it from the sidebar.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ...errors import ClusterStartError
from ..launch.ippfiles import profile_dir
from ..session import TacoCluster

__all__ = ["AttachedCluster", "find_shared", "attach"]


def find_shared(name: str, wait: float = 0.0, on_wait: Callable[[], None] | None = None) -> Any:
    """The registry's running cluster ``name`` owned by a Jupyter server, or None.

    While such a cluster is still ``starting`` (the sidebar's Start was just pressed, or its entry is being
    written), wait up to ``wait`` seconds for it to run, calling ``on_wait`` once, rather than let the caller
    start a second cluster of the same name."""
    from .files import read_models, registry_dir

    deadline, told = time.monotonic() + wait, False
    while True:
        found = [m for m in read_models(registry_dir()) if m["name"] == name and m["owner"]["kind"] == "server"]
        running = next((m for m in found if m["state"] == "running"), None)
        if running is not None or not any(m["state"] == "starting" for m in found) or time.monotonic() > deadline:
            return running
        if on_wait is not None and not told:
            on_wait()
            told = True
        time.sleep(0.2)


class AttachedCluster(TacoCluster):
    """A :class:`TacoCluster` whose processes belong to another process; this kernel only runs cells on it.

    Nothing here writes its registry entry (the owner does: this process never tracks it), so killing hung
    ranks after Ctrl-C (:meth:`~TacoCluster.kill_engines`) marks it broken here only.
    """

    owner_kind = "server"

    def stop(self, fast: bool = False) -> None:
        """Disconnect; the owner (the sidebar's server) stops the engines."""
        client, self.client, self.ipp_cluster, self.ranks = self.client, None, None, []
        if client is not None:
            client.close()

    def scale(self, size: int) -> TacoCluster:
        raise ClusterStartError(f"cluster {self.name!r} belongs to the Jupyter server: scale it from the sidebar")

    def adopt(self, started_at: float | None, timeout: float) -> None:
        """Connect to the running cluster of this id through its ipyparallel cluster file; checks that its
        engines are the MPI ranks it says."""
        from ...ipp import upstream as ipp
        from ...ipp.client import connect

        self.ipp_cluster = ipp.Cluster.from_file(profile_dir=str(profile_dir()), cluster_id=self.cluster_id)
        self.client = connect(self.ipp_cluster)
        self.client.wait_for_engines(self.size, timeout=timeout, interactive=False)  # no stray tqdm bar
        self.check_ranks()
        self.started_at = started_at or time.time()


def attach(model: Any, timeout: float = 30.0) -> AttachedCluster:
    """Connect to the cluster of a registry ``model``; checks its engines are the MPI ranks it says."""
    cluster = AttachedCluster(model["name"], model["size"], cluster_id=model["id"])
    try:
        cluster.adopt(model.get("started_at"), timeout)
    except Exception as exc:
        cluster.stop()
        raise ClusterStartError(f"cannot attach to cluster {model['name']!r} started from the sidebar "
                                f"({model['id']}): {exc}") from exc
    return cluster
