"""``%%taco_run`` in a real Jupyter kernel, as a notebook front end drives it: live output, interrupt, exit."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from jupyter_client.manager import start_new_kernel

from ..conftest import IPYKERNEL6, kernel_env, session_processes

pytestmark = pytest.mark.cluster


def execute(client: Any, code: str, timeout: float = 120,
            during: Any = None) -> tuple[dict[str, Any], list[tuple[float, dict[str, Any]]]]:
    """Run ``code``; returns the execute reply and every iopub message of it with its arrival time."""
    msg_id = client.execute(code)
    messages = []
    deadline = time.monotonic() + timeout
    while True:
        msg = client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append((time.monotonic(), msg))
        if during is not None:
            during(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    reply = client.get_shell_msg(timeout=10)
    return reply["content"], messages


def stream_text(messages: list[tuple[float, dict[str, Any]]], name: str = "stdout") -> str:
    return "".join(m["content"]["text"] for _, m in messages
                   if m["msg_type"] == "stream" and m["content"]["name"] == name)


@pytest.fixture
def kernel(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    """A real kernel with the extension loaded: the installed ipykernel, or ipykernel 6 where a test is
    parametrized with ``kernel`` = IPYKERNEL6 (indirectly)."""
    options = kernel_env(request.getfixturevalue("ipykernel6")) if getattr(request, "param", None) else {}
    manager, client = start_new_kernel(kernel_name="python3", **options)
    try:
        reply, _ = execute(client, "%load_ext taco_notebook")
        assert reply["status"] == "ok"
        yield manager, client
    finally:
        if manager.has_kernel:  # a test may have shut it down already
            client.stop_channels()
            manager.shutdown_kernel(now=False)


def test_cell_output_streams_live_and_interrupt_keeps_the_cluster(kernel):
    manager, client = kernel
    cell = "%%taco_run -np 2\nimport time\nprint('tick', taco.rank(), flush=True)\ntime.sleep(4)\ntaco.rank()"
    reply, messages = execute(client, cell)
    assert reply["status"] == "ok"
    end = messages[-1][0]
    ticks = [t for t, m in messages if m["msg_type"] == "stream" and "tick" in m["content"]["text"]]
    assert ticks and end - min(ticks) > 3, "rank output arrived only at the end"
    assert "[rank 0] tick 0" in stream_text(messages) and "[rank 1] tick 1" in stream_text(messages)
    results = [m["content"]["data"]["text/plain"] for _, m in messages if m["msg_type"] == "execute_result"]
    assert results == ["0"]

    _, pids = execute(client, "from taco_notebook.cluster.session import clusters\n"
                              "print(sorted(r.pid for r in clusters['default'].ranks))")
    interrupted_at: list[float] = []

    def interrupt_once_running(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream" and "looping" in msg["content"]["text"] and not interrupted_at:
            interrupted_at.append(time.monotonic())
            manager.interrupt_kernel()

    reply, messages = execute(client, "%%taco_run\nimport time\nprint('looping', flush=True)\n"
                                      "while True:\n    time.sleep(0.1)", during=interrupt_once_running)
    # What the user sees: the cell ends with CellInterrupted, taco's KeyboardInterrupt showing the ranks' own
    # tracebacks (errors.py). (ipykernel 7 sometimes replies "ok" to the
    # first interrupt of a kernel although it shows the error; plain cells do not hit that, and neither
    # does any later interrupt: the reply status is ipykernel's, the error message is ours.)
    errors = [m["content"]["ename"] for _, m in messages if m["msg_type"] == "error"]
    assert errors == ["CellInterrupted"] and reply["status"] in ("error", "ok")
    assert messages[-1][0] - interrupted_at[0] < 5
    reply, after = execute(client, "%%taco_run --gather\ntaco.rank()")
    assert reply["status"] == "ok"
    _, pids_after = execute(client, "print(sorted(r.pid for r in clusters['default'].ranks))")
    assert stream_text(pids) == stream_text(pids_after), "the interrupt restarted the engines"


@pytest.mark.parametrize("kernel", [None, IPYKERNEL6], indirect=True, ids=["installed", IPYKERNEL6])
def test_a_running_cell_answers_widget_requests_while_queued_cells_wait_their_turn(kernel):
    """A page reloaded mid-run asks for its widgets over the shell channel; the wait loop answers it
    (``ipp/comm_pump.py``) while an ``execute_request`` sent meanwhile still runs after the cell, in order."""
    _, client = kernel
    cell = client.execute("%%taco_run -np 2\nimport time\nprint('training', flush=True)\ntime.sleep(6)")
    deadline = time.monotonic() + 120
    while True:  # the cluster starts, then the ranks print
        msg = client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["msg_type"] == "stream" and "training" in msg["content"]["text"]:
            break
    info = client.comm_info(target_name="jupyter.widget")
    after = client.execute("print('after', flush=True)")
    replies = []
    while len(replies) < 3:
        reply = client.get_shell_msg(timeout=60)
        replies.append((time.monotonic(), reply))
    assert [m["parent_header"]["msg_id"] for _, m in replies] == [info, cell, after]
    assert replies[0][1]["content"]["status"] == "ok"
    assert replies[1][0] - replies[0][0] > 3, "comm_info_request was answered only once the cell had ended"
    assert replies[1][1]["content"]["status"] == "ok" and replies[2][1]["content"]["status"] == "ok"
    assert replies[2][1]["content"]["execution_count"] == replies[1][1]["content"]["execution_count"] + 1


def test_kernel_shutdown_stops_its_clusters(kernel):
    manager, client = kernel
    before = set(session_processes())  # the kernel, and the suite's shared cluster if an earlier test started it
    reply, _ = execute(client, "%%taco_run -np 2 --cluster left-running\npass")
    assert reply["status"] == "ok"
    assert any("ipyparallel.engine" in cmd for pid, cmd in session_processes().items() if pid not in before)
    kernel_pid = manager.provisioner.pid
    client.stop_channels()
    manager.shutdown_kernel(now=False)  # a graceful shutdown, as JupyterLab's "Shut Down Kernel"

    def left() -> dict[int, str]:
        return {pid: cmd for pid, cmd in session_processes().items() if pid not in before or pid == kernel_pid}

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and left():
        time.sleep(0.2)
    assert left() == {}


def test_a_killed_kernel_leaves_nothing_running(kernel, tmp_path):
    """SIGKILL runs no exit hook: the kernel's reaper stops its cluster (controller, mpiexec, ranks) and removes
    its registry entry and MPI segments."""
    manager, client = kernel
    registry = tmp_path / "registry"
    reply, _ = execute(client, f"import os\nos.environ['TACO_REGISTRY_DIR'] = {str(registry)!r}")
    assert reply["status"] == "ok"
    before = set(session_processes())
    reply, _ = execute(client, "%%taco_run -np 2 --cluster orphaned\npass")
    assert reply["status"] == "ok"
    _, shm = execute(client, "from taco_notebook.cluster.session import clusters\n"
                             "import json; print(json.dumps(sorted(clusters['orphaned'].shared_memory)))")
    started = {pid: cmd for pid, cmd in session_processes().items() if pid not in before}
    assert any("ipyparallel.engine" in cmd for cmd in started.values())
    assert any("taco_notebook.cluster.registry.reaper" in cmd for cmd in started.values())
    assert [p.name for p in registry.glob("*.json")], "the cluster was not written to the registry"
    kernel_pid = manager.provisioner.pid
    client.stop_channels()
    manager.shutdown_kernel(now=True)  # SIGKILL, as a client does when a kernel ignores its shutdown request

    def left() -> dict[int, str]:
        return {pid: cmd for pid, cmd in session_processes().items() if pid in started or pid == kernel_pid}

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and left():
        time.sleep(0.2)
    assert left() == {}
    assert list(registry.glob("*.json")) == []
    segments = json.loads(stream_text(shm))
    assert [path for path in segments if os.path.exists(path)] == []
