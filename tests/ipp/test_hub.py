"""taco's controller (ipp/hub.py): ipyparallel's, with a hub that reads only the frame each
monitor message needs. What users can ask the hub must stay right: the queue of every engine while a request
runs and after it, and an engine that shuts down leaving the cluster at once (its ``shutdown_reply`` is the one
IOPub message the hub acts on); and a normal start logs no error. Real controller and engines (plain ipyparallel
engines, no MPI, started as ``benchmarks/cell_protocol.py`` starts them; a taco cluster for the log)."""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ..support.waiting import wait_until

pytest.importorskip("ipyparallel")
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def plain_cluster(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from cell_protocol import Plain

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))  # the usual soft limit, for the controller
    try:
        plain = Plain(3, timeout=120, controller="taco")  # taco's controller command and settings
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    controller = plain.cluster.controller.process
    try:
        yield plain.cluster, plain.client
    finally:
        plain.stop()
        assert not psutil.pid_exists(controller.pid) or \
            psutil.Process(controller.pid).status() == psutil.STATUS_ZOMBIE


def _nap(seconds: float) -> int:
    import os
    import time

    time.sleep(seconds)
    return os.getpid()


def queues(client, wanted: list) -> dict:
    """``client.queue_status()`` once each engine's (queue, completed) is ``wanted``: the hub reads its copy of a
    request or reply a moment after the engine or the client has it (ipyparallel's own hub too)."""
    def status() -> dict | None:
        now = client.queue_status()
        return now if [(now[i]["queue"], now[i]["completed"]) for i in range(len(wanted))] == wanted else None

    return wait_until(status, 10, f"the hub's queues reaching {wanted} (now {client.queue_status()})")


@pytest.mark.cluster
def test_the_hub_counts_each_engines_queue_and_lets_a_shut_down_engine_go(plain_cluster):
    cluster, client = plain_cluster
    controller = psutil.Process(cluster.controller.process.pid)
    assert "taco_notebook.controller" in controller.cmdline()
    soft, hard = controller.rlimit(psutil.RLIMIT_NOFILE)  # started under a soft limit of 1,024, raised to the hard
    assert soft == hard or soft == resource.RLIM_INFINITY, (soft, hard)
    from cell_protocol import PLAIN_SETUP

    setup = len(PLAIN_SETUP)  # requests Plain made to set each engine up as taco's
    queues(client, [(0, setup)] * 3)
    running = client[:].apply_async(_nap, 4.0)
    during = queues(client, [(1, setup)] * 3)
    assert not running.ready(), during
    running.get(timeout=60)
    client[0].apply_sync(_nap, 0.0)
    queues(client, [(0, setup + 2), (0, setup + 1), (0, setup + 1)])

    began = time.monotonic()  # gone from the hub's list long before a missed heartbeat (3 s) would say so
    client.shutdown(targets=[2], block=True)
    wait_until(lambda: client.ids == [0, 1], 10, f"engine 2 leaving the hub's list (now {client.ids})", poll=0.05)
    assert client.ids == [0, 1] and time.monotonic() - began < 2.5, client.ids
    assert client[:].apply_sync(_nap, 0.0)  # the others still answer
    log = open(cluster.controller.output_file, errors="replace").read()
    assert "Traceback" not in log, log[-2000:]


REFUSED = """
import os, resource, sys
import psutil
resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))
os.environ["TACO_MAX_RANKS"] = "1000"
from taco_notebook.cluster.session import TacoCluster
from taco_notebook.errors import ClusterStartError
try:
    TacoCluster(name="fds", size=200).start()
except ClusterStartError as exc:
    print("REFUSED:", exc)
print("children:", len(psutil.Process().children(recursive=True)))
"""


def test_a_size_the_hard_open_files_limit_cannot_hold_is_refused_before_anything_starts():
    """200 ranks need about 656 open files in the controller; under a hard limit of 300 the start says so, and
    how to raise it, without starting a process."""
    done = subprocess.run([sys.executable, "-c", REFUSED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "REFUSED: 200 ranks need about 656 open files in the controller" in done.stdout, done.stdout
    assert "hard limit is 300: raise it (`ulimit -Hn 656`" in done.stdout and "nothing was started" in done.stdout
    assert "children: 0" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.cluster
def test_a_normal_start_leaves_no_error_in_the_controllers_log():
    """Each engine's IOPub thread greets the controller's subscription with an ``iopub_welcome`` that carries no
    identities; the hub drops it instead of logging "Monitor message without topic" once per rank."""
    from taco_notebook.cluster.session import TacoCluster

    cluster = TacoCluster(name="hub-log", size=2).start()
    try:
        assert cluster.view.apply_sync(_nap, 0.0)
        log_path = Path(cluster.ipp_cluster.controller.output_file)
        time.sleep(1.0)  # the welcomes arrive as each engine's IOPub connects, before or just after registration
        log = log_path.read_text(errors="replace")
    finally:
        cluster.stop()
    errors = [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]
    assert not errors, "\n".join(errors)
