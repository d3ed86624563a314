"""taco's controller (cluster/launch/controller.py): ipyparallel's, with a hub that reads only the frame each
monitor message needs. What users can ask the hub must stay right: the queue of every engine while a request
runs and after it, and an engine that shuts down leaving the cluster at once (its ``shutdown_reply`` is the one
IOPub message the hub acts on). Real controller and engines (plain ipyparallel engines, no MPI)."""

from __future__ import annotations

import os
import tempfile
import time

import psutil
import pytest

ipp = pytest.importorskip("ipyparallel")


@pytest.fixture
def plain_cluster():
    from traitlets.config import Config

    from taco_notebook.cluster.launch.engineset import CONTROLLER_CMD, controller_args

    home = tempfile.mkdtemp(prefix="taco-controller-test-")
    os.chmod(home, 0o700)
    config = Config()
    config.LocalControllerLauncher.controller_cmd = CONTROLLER_CMD
    cluster = ipp.Cluster(n=3, engines="local", profile_dir=home, controller_ip="127.0.0.1", log_level=40,
                          shutdown_atexit=False, config=config, controller_args=controller_args(3))
    try:
        cluster.start_cluster_sync()
        client = cluster.connect_client_sync()
        client.wait_for_engines(3, timeout=120, interactive=False)
        yield cluster, client
    finally:
        controller = getattr(cluster.controller, "process", None)
        cluster.stop_cluster_sync()
        assert controller is None or not psutil.pid_exists(controller.pid) or \
            psutil.Process(controller.pid).status() == psutil.STATUS_ZOMBIE


def _nap(seconds: float) -> int:
    import os
    import time

    time.sleep(seconds)
    return os.getpid()


def test_the_hub_counts_each_engines_queue_and_lets_a_shut_down_engine_go(plain_cluster):
    cluster, client = plain_cluster
    assert "taco_notebook.cluster.launch.controller" in psutil.Process(cluster.controller.process.pid).cmdline()
    running = client[:].apply_async(_nap, 2.0)
    time.sleep(0.5)
    during = client.queue_status()
    assert [during[i]["queue"] for i in range(3)] == [1, 1, 1], during
    running.get(timeout=60)
    client[0].apply_sync(_nap, 0.0)
    after = client.queue_status()
    assert [(after[i]["queue"], after[i]["completed"]) for i in range(3)] == [(0, 2), (0, 1), (0, 1)], after

    began = time.monotonic()  # gone from the hub's list long before a missed heartbeat (3 s) would say so
    client.shutdown(targets=[2], block=True)
    while 2 in client.ids and time.monotonic() - began < 10:
        time.sleep(0.05)
    assert client.ids == [0, 1] and time.monotonic() - began < 2.5, client.ids
    assert client[:].apply_sync(_nap, 0.0)  # the others still answer
    log = open(cluster.controller.output_file, errors="replace").read()
    assert "Traceback" not in log, log[-2000:]
