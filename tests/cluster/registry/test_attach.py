"""A notebook cell runs on a cluster started from the sidebar (owned by the Jupyter server), not on a second one."""

from __future__ import annotations

import time

import pytest
from IPython.core.error import UsageError

from taco_notebook.cluster.registry.attach import AttachedCluster
from taco_notebook.cluster.session import clusters
from taco_notebook.server.manager import ClusterManager

pytestmark = pytest.mark.cluster


def wait_for(manager: ClusterManager, cluster_id: str, state: str, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        model = manager.get(cluster_id)
        if model["state"] == state:
            return model
        time.sleep(0.2)
    raise AssertionError(f"cluster {cluster_id} not {state} after {timeout} s: {manager.get(cluster_id)}")


def test_a_cell_attaches_to_the_servers_cluster_and_leaves_it_running(ip, capsys):
    manager = ClusterManager()
    try:
        model = manager.start({"size": 2, "name": "shared"})
        running = wait_for(manager, model["id"], "running")
        assert running["owner"]["kind"] == "server" and running["engines_up"] == 2

        with pytest.raises(UsageError, match="started from the sidebar with 2 ranks"):
            ip.run_cell_magic("taco_run", "-np 3 --cluster shared", "x = 1")
        value = ip.run_cell_magic("taco_run", "--cluster shared --gather", "import os\n(taco.size(), os.getpid())")
        assert isinstance(clusters["shared"], AttachedCluster)
        assert [size for size, _ in value] == [2, 2]
        owned_pids = sorted(r.pid for r in manager._clusters[model["id"]].ranks)
        assert sorted(pid for _, pid in value) == owned_pids  # the server's engines ran the cell
        assert "using cluster 'shared' started from the sidebar" in capsys.readouterr().out  # a notice: stdout

        ip.run_line_magic("taco_cluster", "stop --cluster shared")  # only disconnects
        assert wait_for(manager, model["id"], "running")["engines_up"] == 2
    finally:
        clusters.pop("shared", None)
        manager.shutdown()


def test_a_cell_waits_for_the_cluster_the_sidebar_is_starting(ip, capsys):
    """Run at once after the sidebar's Start (its entry says ``starting``), the cell waits and attaches instead
    of starting a second cluster of the same name."""
    manager = ClusterManager()
    try:
        model = manager.start({"size": 2, "name": "starting"})
        assert model["state"] == "starting"
        value = ip.run_cell_magic("taco_run", "--cluster starting --gather", "taco.size()")
        assert value == [2, 2] and isinstance(clusters["starting"], AttachedCluster)
        assert "waiting for cluster 'starting', which the sidebar is starting…" in capsys.readouterr().out
        assert sorted(r.pid for r in clusters["starting"].ranks) == \
            sorted(r.pid for r in manager._clusters[model["id"]].ranks)  # the server's engines, no others
    finally:
        clusters.pop("starting", None)
        manager.shutdown()
