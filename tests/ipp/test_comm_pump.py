"""``ipp/comm_pump.py``: a cell that blocks the kernel answers comm messages, and queued cells keep their order."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from jupyter_client.manager import start_new_kernel

from taco_notebook.ipp.comm_pump import CommPump

from ..conftest import IPYKERNEL6, kernel_env

ECHO_TARGET = """
def _echo(comm, msg):
    comm.on_msg(lambda m: comm.send({"echo": m["content"]["data"]}))
get_ipython().kernel.comm_manager.register_target("taco_echo", _echo)
"""
BLOCKING_CELL = """
import time
from taco_notebook.ipp.comm_pump import CommPump
pump = CommPump(interval=0.05)
print("pumping", pump.active, flush=True)
start = time.monotonic()
while time.monotonic() - start < {seconds}:
    pump()
    time.sleep(0.02)
print("dispatched", pump.dispatched, flush=True)
"""


def test_outside_a_kernel_the_pump_does_nothing():
    pump = CommPump()
    assert not pump.active
    assert pump(force=True) == 0


@pytest.fixture(params=["installed", IPYKERNEL6])
def client(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A real kernel: the installed ipykernel (7), and ipykernel 6."""
    options = kernel_env(request.getfixturevalue("ipykernel6")) if request.param == IPYKERNEL6 else {}
    manager, client = start_new_kernel(kernel_name="python3", **options)
    try:
        if request.param == IPYKERNEL6:
            _run(client, f"import ipykernel\nassert ipykernel.__version__ == {IPYKERNEL6!r}, ipykernel.__version__")
        yield client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)


def _send(client: Any, msg_type: str, content: dict[str, Any]) -> str:
    msg = client.session.msg(msg_type, content)
    client.shell_channel.send(msg)
    return msg["header"]["msg_id"]


def _run(client: Any, code: str) -> None:
    reply = client.execute_interactive(code, timeout=30, output_hook=lambda msg: None)
    assert reply["content"]["status"] == "ok", reply["content"]


@pytest.mark.server
def test_a_blocking_cell_answers_comm_messages_and_queued_cells_run_after_it_in_order(client):
    _run(client, ECHO_TARGET)
    started = time.monotonic()
    cell = client.execute(BLOCKING_CELL.format(seconds=6))
    iopub: list[tuple[float, dict[str, Any]]] = []
    replies: list[tuple[float, dict[str, Any]]] = []

    def read(until: Any, timeout: float) -> None:
        """Read both channels, interleaved (each message's time is when it came), until ``until()``."""
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, [m["msg_type"] for _, m in replies + iopub]
            for channel, into in ((client.get_shell_msg, replies), (client.get_iopub_msg, iopub)):
                try:
                    msg = channel(timeout=0.02)
                except Exception:  # queue.Empty
                    continue
                into.append((time.monotonic(), msg))

    def stream_of(msg_id: str) -> str:
        return "".join(m["content"]["text"] for _, m in iopub
                       if m["msg_type"] == "stream" and m["parent_header"].get("msg_id") == msg_id)

    read(lambda: "pumping" in stream_of(cell), timeout=30)
    assert "pumping True" in stream_of(cell)

    comm_id = "c0ffee"
    opened = _send(client, "comm_open", {"comm_id": comm_id, "target_name": "taco_echo", "data": {}})
    info = _send(client, "comm_info_request", {"target_name": "taco_echo"})
    second = client.execute("print('second', flush=True)")
    echoed = _send(client, "comm_msg", {"comm_id": comm_id, "data": {"n": 1}})
    third = client.execute("print('third', flush=True)")
    # comm_info's reply and the three cells' (comm_open and comm_msg have none)
    read(lambda: len(replies) == 4 and "third" in stream_of(third), timeout=60)

    order = [m["parent_header"]["msg_id"] for _, m in replies]
    assert order == [info, cell, second, third], [m["msg_type"] for _, m in replies]
    info_at, info_reply = replies[0]
    assert info_reply["content"]["comms"] == {comm_id: {"target_name": "taco_echo"}}
    cell_done = replies[1][0]
    assert cell_done - info_at > 2, "comm_info_request was answered only once the cell had ended"

    echo = [(t, m) for t, m in iopub if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == comm_id]
    assert len(echo) == 1 and echo[0][1]["content"]["data"] == {"echo": {"n": 1}}
    assert echo[0][1]["parent_header"]["msg_id"] == echoed, "the comm's reply is not parented to its request"
    assert echo[0][0] < cell_done - 2
    assert "dispatched 3" in stream_of(cell), stream_of(cell)  # its own output stayed under the cell
    for msg_id in (opened, info, echoed):  # dispatched concurrently: no busy/idle of their own mid-cell
        assert not [m for _, m in iopub if m["msg_type"] == "status" and m["parent_header"].get("msg_id") == msg_id]
    assert stream_of(second) == "second\n" and stream_of(third) == "third\n"
    assert time.monotonic() - started < 60
