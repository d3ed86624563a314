"""The cluster registry: atomic entries, stale owners, and the kernel-side watcher that obeys the sidebar."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from taco_notebook.cluster.processes.tree import CLUSTER_ID_ENV
from taco_notebook.cluster.registry import files as registry
from taco_notebook.cluster.registry import writer as registry_writer
from taco_notebook.cluster.session import TacoCluster


@pytest.fixture
def registry_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "registry"
    monkeypatch.setenv(registry.ENV_VAR, str(directory))
    return directory


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def make_entry(directory: Path, cluster_id: str, owner_pid: int, owner_created: float | None,
               processes: Sequence[tuple[int, float]] = (), rank_pids: Sequence[tuple[int, int]] = (),
               state: str = "running", kind: str = "kernel") -> None:
    """An entry as a kernel would write it, for owners and ranks the test controls."""
    model = {
        "id": cluster_id, "name": cluster_id, "profile": "taco", "owner": {"kind": kind, "pid": owner_pid},
        "state": state, "size": len(rank_pids) or 1, "engines_up": len(rank_pids) or 1, "mpi": "mpich",
        "nodes": [{"node": 0, "host": "h", "ranks": [r for r, _ in rank_pids], "gpus": 0}], "gpus": 0,
        "hugepages": None, "started_at": time.time(), "updated_at": time.time(), "run": None, "pending": None,
        "error": None,
    }
    entry = {"model": model, "owner_create_time": owner_created, "processes": list(processes),
             "rank_pids": list(rank_pids)}
    registry.write_atomic(directory / f"{cluster_id}.json", entry)


@pytest.fixture
def sleeper() -> Iterator[Callable[..., psutil.Process]]:
    """Start throwaway processes (stand-ins for a dead kernel's leftovers); all are killed and reaped.

    ``sleeper(cluster_id)`` marks it as that cluster's, as TacoCluster marks the processes it launches.
    """
    started: list[subprocess.Popen[bytes]] = []

    def start(cluster_id: str | None = None) -> psutil.Process:
        env = {**os.environ, CLUSTER_ID_ENV: cluster_id} if cluster_id else None
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env))
        return psutil.Process(started[-1].pid)

    yield start
    for proc in started:
        proc.kill()
        proc.wait(10)


def dead_pid() -> tuple[int, float]:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    created = psutil.Process(proc.pid).create_time()
    proc.wait(10)
    return proc.pid, created


def test_writes_are_atomic(tmp_path: Path) -> None:
    """A reader polling while the owner rewrites never sees half a file, and no temporary is left."""
    path = tmp_path / "x.json"
    stop = threading.Event()

    def writer() -> None:
        n = 0
        while not stop.is_set():
            registry.write_atomic(path, {"n": n, "pad": "x" * 200_000})
            n += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        wait_for(path.exists, 5, "the first write")
        reads = 0
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            with open(path) as f:
                assert len(json.load(f)["pad"]) == 200_000
            reads += 1
    finally:
        stop.set()
        thread.join()
    assert reads > 10
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_dead_and_reused_owners_are_stale(registry_dir: Path) -> None:
    me = psutil.Process()
    pid, created = dead_pid()
    make_entry(registry_dir, "alive", me.pid, me.create_time())
    make_entry(registry_dir, "dead", pid, created)
    make_entry(registry_dir, "reused", me.pid, me.create_time() - 100)  # our pid, another process's birth
    states = {m["id"]: m["state"] for m in registry.read_models(registry_dir)}
    assert states == {"alive": "running", "dead": "stale", "reused": "stale"}
    stale = registry.read_model(registry_dir, "dead")
    assert stale is not None and stale["engines_up"] == 0
    assert stale["error"] == f"its kernel (pid {pid}) died; nothing it started is still running"


def test_dead_local_rank_marks_cluster_broken(registry_dir: Path, sleeper: Callable[[], psutil.Process]) -> None:
    me = psutil.Process()
    rank0 = sleeper()
    gone, gone_created = dead_pid()
    make_entry(registry_dir, "c", me.pid, me.create_time(),
               processes=[(rank0.pid, rank0.create_time()), (gone, gone_created)],
               rank_pids=[(0, rank0.pid), (1, gone)])
    model = registry.read_model(registry_dir, "c")
    assert model is not None
    assert (model["state"], model["engines_up"]) == ("broken", 1)
    assert model["error"] == f"rank 1 (pid {gone}) exited"


def test_discard_stale_kills_only_recorded_processes(registry_dir: Path,
                                                     sleeper: Callable[..., psutil.Process]) -> None:
    """Killed: recorded, same create time, and marked as this cluster's. Not: a reused pid, a process of the same
    user without the marker, one marked for another cluster (the marker is required)."""
    left_behind, reused, unmarked, other = sleeper("old"), sleeper("old"), sleeper(), sleeper("other")
    owner, owner_created = dead_pid()
    make_entry(registry_dir, "old", owner, owner_created,
               processes=[(left_behind.pid, left_behind.create_time()), (reused.pid, reused.create_time() - 50),
                          (unmarked.pid, unmarked.create_time()), (other.pid, other.create_time())])
    registry.write_request(registry_dir, "old", "stop", None)
    model = registry.read_model(registry_dir, "old")
    assert model is not None and model["state"] == "stale"
    assert model["error"] == (f"its kernel (pid {owner}) died; 1 process it started is still running: "
                              "Stop kills it")
    assert registry.discard_stale(registry_dir, "old") == [left_behind.pid]
    left_behind.wait(10)
    assert reused.is_running() and unmarked.is_running() and other.is_running()
    assert list(registry_dir.iterdir()) == []


@pytest.mark.cluster
def test_watcher_scales_and_stops_a_kernel_cluster(registry_dir: Path) -> None:
    """The server's requests, carried out by the kernel's watcher between cells (never during one)."""
    cluster = registry_writer.track(TacoCluster("regtest", 2))
    try:
        cluster.start()
        cluster_id = cluster.cluster_id or ""
        model = registry.read_model(registry_dir, cluster_id)
        assert model is not None
        assert (model["state"], model["engines_up"], model["owner"]) == ("running", 2, {
            "kind": "kernel", "pid": os.getpid(), "notebook": None, "server_pid": None})  # pytest: no JPY_* env
        assert [n["ranks"] for n in model["nodes"]] == [[0, 1]]
        assert model["hugepages"] is None or set(model["hugepages"]) == {"total", "free", "page_kb"}
        cluster.set_run({"cell": "x = 1", "started_at": 1.0, "step": 3, "total": None, "samples_per_s": 2.5})
        assert registry.read_model(registry_dir, cluster_id)["run"]["step"] == 3  # type: ignore[index]

        registry.write_request(registry_dir, cluster_id, "scale", 1)
        wait_for(lambda: (m := registry.read_model(registry_dir, cluster_id)) and m["size"] == 1
                 and m["state"] == "running", what="the scale to 1 rank")
        assert cluster.size == 1 and len(cluster.view) == 1 and cluster.cluster_id == cluster_id

        with cluster.busy:  # a cell is running (and hangs, so the runner kills the engines): the stop waits
            cluster.kill_engines("killed by the test")
            registry.write_request(registry_dir, cluster_id, "stop", None)
            time.sleep(3 * registry_writer.POLL_INTERVAL)
            model = registry.read_model(registry_dir, cluster_id)
            assert model is not None and model["pending"] is not None
            assert (model["state"], model["error"]) == ("broken", "killed by the test")
        wait_for(lambda: registry.read_model(registry_dir, cluster_id) is None, what="the stop")
        assert cluster.ipp_cluster is None
        if not any(c.owner_kind == "kernel" for c in registry_writer.tracked()):  # the suite's shared cluster
            wait_for(lambda: registry_writer._watcher is None, 5, "the watcher to end with no cluster left")
    finally:
        cluster.stop()
    assert list(registry_dir.iterdir()) == []


def _same_model(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Equal but for ``updated_at`` (the time each was built)."""
    assert {**a, "updated_at": 0} == {**b, "updated_at": 0}


@pytest.mark.cluster
def test_events_in_order_and_one_model_everywhere(registry_dir: Path) -> None:
    """A real 2-rank cluster tells a subscriber starting → running → (run) → stopping → stopped, in order;
    its model is built once: what it says, what its registry file holds and what a manager serves are the same."""
    from taco_notebook.server.manager import ClusterManager

    cluster = registry_writer.track(TacoCluster("events", 2))
    seen: list[tuple[str, str]] = []
    cluster.subscribe(lambda c, event: seen.append((event, c.state)))
    manager = ClusterManager(registry_dir)
    try:
        cluster.start()
        assert seen == [("starting", "starting"), ("running", "running")]
        cluster_id = cluster.cluster_id or ""
        on_file = registry.read_model(registry_dir, cluster_id)
        assert on_file is not None and on_file["state"] == "running" and on_file["engines_up"] == 2
        _same_model(cluster.model(), on_file)  # type: ignore[arg-type]
        _same_model(manager.get(cluster_id), on_file)  # type: ignore[arg-type]
        cluster.set_run({"cell": "x = 1", "started_at": 1.0, "step": 7, "total": 10, "samples_per_s": None})
        assert seen[-1] == ("run", "running")
        _same_model(cluster.model(), registry.read_model(registry_dir, cluster_id))  # type: ignore[arg-type]
    finally:
        cluster.stop()
        manager.shutdown()
    assert [event for event, _ in seen] == ["starting", "running", "run", "stopping", "stopped"]
    assert seen[-2:] == [("stopping", "stopping"), ("stopped", "stopped")]
    assert cluster not in registry_writer.tracked() and list(registry_dir.iterdir()) == []


def wait_for_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still running (not zombies) after up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


_EXIT_JOB = """
import atexit, json, sys
registered = []  # every atexit registration from here on, by module and name (they still register)
_register = atexit.register
def register(function, *args, **kwargs):
    registered.append(f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', function)}")
    return _register(function, *args, **kwargs)
atexit.register = register
from taco_notebook.cluster.session import TacoCluster
from taco_notebook.cluster.registry.writer import track
from taco_notebook.server.manager import ClusterManager
ClusterManager(sys.argv[1]).shutdown()
cluster = track(TacoCluster("atexit", 1)).start()
print(json.dumps({"registered": registered, "id": cluster.cluster_id, "pids": [p.pid for p in cluster.processes]}),
      flush=True)
# exits with the cluster running: the one exit hook must stop it and remove its entry
"""


@pytest.mark.cluster
def test_one_exit_hook_stops_a_running_cluster(registry_dir: Path) -> None:
    """The registry writer, the manager and a started cluster (ipyparallel's hook off) register no
    atexit hook of their own; the process's one hook (session's) stops the cluster it left running at exit."""
    out = subprocess.run([sys.executable, "-c", _EXIT_JOB, str(registry_dir)], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    ours = [name for name in report["registered"] if name.startswith(("taco_notebook", "ipyparallel.cluster"))]
    assert ours == ["taco_notebook.cluster.session._stop_at_exit"]
    assert report["pids"] and report["id"].startswith("atexit-")
    left = wait_for_gone(report["pids"])
    assert not left, f"left running after exit: {left}"
    assert list(registry_dir.iterdir()) == [], "the exit left the registry entry behind"
    assert "Stopping cluster" not in out.stderr  # ipyparallel's own exit hook did not run
