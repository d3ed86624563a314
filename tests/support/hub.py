"""What ipyparallel's hub reports, awaited (its counts lag the client's by a moment)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def queues_when(client: Any, wanted: Callable[[dict[Any, Any]], bool], timeout: float = 10.0) -> dict[Any, Any]:
    """``client.queue_status()`` once it is ``wanted``: the hub reads its copy of a request or reply a moment after
    the engine or the client has it (ipyparallel's own hub too), so the count is awaited, not sampled once."""
    deadline = time.monotonic() + timeout
    status = client.queue_status()
    while not wanted(status) and time.monotonic() < deadline:
        time.sleep(0.05)
        status = client.queue_status()
    assert wanted(status), status
    return status
