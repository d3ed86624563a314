"""A normal run in a real Jupyter server leaves its log clean: examples 01 and 02 in a notebook session's kernel
(clusters started and stopped, a training loop under the live dashboard, its metrics flowing from the ranks), the
last cluster left running when the kernel is shut down, as a user closing the notebook does. Nothing that taco,
ipyparallel or the ranks write to the server's log may be a warning or a traceback.

The kernel is driven over its own channels (jupyter_client), not a browser: what is under test is the server's
log, which a browser would only add its own lines to.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from ..support.waiting import wait_until
from .conftest import REPO, LabServer

pytestmark = pytest.mark.cluster

EXAMPLES = REPO / "examples"
API = "/taco-notebook/api/clusters"


def example_cells(name: str) -> list[str]:
    """The example's code cells of a normal run: not those tagged ``raises-exception`` (example 01's stall
    demonstration fails on purpose, and its traceback is the user's, not the log's), nor the ``%taco_debug``
    that opens pdb in that failure's frames."""
    return [cell.source for cell in nbformat.read(EXAMPLES / name, as_version=4).cells
            if cell.cell_type == "code" and "raises-exception" not in cell.get("metadata", {}).get("tags", [])
            and not cell.source.startswith("%taco_debug")]


# the notebook's own kernel, which the Jupyter server starts on TCP (its KernelManager.transport, the server's
# configuration, not taco's: `taco-notebook run` starts its kernel on IPC, tests/cli/test_run.py)
SERVER_KERNEL_TCP = "[IPKernelApp] WARNING | Kernel is running over TCP without encryption"
NOISE = re.compile(r"\bWARNING\b|\bWARN\b|\[W |Traceback|Error\b|unhandled|Failed to", re.IGNORECASE)


def _execute(client, code: str, timeout: float = 300) -> str:
    """Run ``code`` in the kernel; its text output (AssertionError with it if the cell failed)."""
    shown: list[str] = []

    def keep(msg) -> None:
        content = msg["content"]
        if msg["msg_type"] == "stream":
            shown.append(content["text"])
        elif msg["msg_type"] == "error":
            shown.append("\n".join(content["traceback"]))

    reply = client.execute_interactive(code, timeout=timeout, output_hook=keep)
    assert reply["content"]["status"] == "ok", "".join(shown)
    return "".join(shown)


def test_a_normal_run_and_shutdown_leave_no_warning_in_the_server_log(lab: LabServer) -> None:
    from jupyter_client import BlockingKernelClient

    start = lab.log_path.stat().st_size
    # the sidebar's "new cluster": the server starts it (its ipyparallel logs to the server's log) and the
    # notebook's cells attach to it
    shared = lab.api("POST", API, {"name": "default", "size": 4}, timeout=120)
    wait_until(lambda: lab.api("GET", f"{API}/{shared['id']}")["state"] == "running", 120, "the sidebar's cluster")
    session = lab.api("POST", "/api/sessions", {"path": "log-check.ipynb", "type": "notebook", "name": "log-check",
                                                 "kernel": {"name": "python3"}})
    kernel_id = session["kernel"]["id"]
    connection = lab.root_dir.parent / "runtime" / f"kernel-{kernel_id}.json"
    wait_until(connection.exists, 60, "the kernel's connection file")
    client = BlockingKernelClient()
    client.load_connection_info(json.loads(connection.read_text()))
    client.start_channels()
    try:
        # not wait_for_ready: without a kernel manager it reads a heartbeat not yet beating as a dead kernel
        client.kernel_info(reply=True, timeout=60)
        shown = [_execute(client, code) for code in example_cells("01-quickstart.ipynb")]
        assert "using cluster 'default' started from the sidebar" in shown[1], shown
        assert "cluster 'default' stopped" in shown[-1], shown
        second = example_cells("02-train-with-dashboard.ipynb")
        assert second[-1].strip() == "%taco_cluster stop"
        shown = [_execute(client, code) for code in second[:-1]]  # its cluster goes with the kernel
        assert "120/120 (100%)" in "".join(shown), shown
    finally:
        client.stop_channels()
    lab.api("DELETE", f"/api/sessions/{session['id']}", timeout=60)  # the kernel goes, its cluster with it
    for model in lab.api("GET", API)["clusters"]:  # what is left the user stops from the sidebar
        if model.get("this_server") and model["state"] == "running":
            lab.api("DELETE", f"{API}/{model['id']}", timeout=120)
    wait_until(lambda: all(m["state"] == "stopped" or not m.get("this_server")
                           for m in lab.api("GET", API)["clusters"]), 120, "every cluster stopped")
    left = lab.wait_children_gone(60)
    assert not left, left
    log = Path(lab.log_path).read_text(errors="replace")[start:]
    noise = [line for line in log.splitlines() if NOISE.search(line) and not line.startswith(SERVER_KERNEL_TCP)]
    assert not noise, log
