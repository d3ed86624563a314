"""Wait for the event that proves a behaviour, not for a span of wall time.

A test that sleeps and then looks (``sleep(2); assert seen``) passes or fails with the machine's speed; one that
polls a condition until it holds, under a deadline that only bounds a failure, does not. The deadline is the
longest a broken run may take, so make it generous: a passing run returns as soon as the event happens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["wait_until", "gate_code"]

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float, what: str, poll: float = 0.01) -> T:
    """``condition()``'s first truthy value, polled until ``timeout`` seconds have passed; AssertionError naming
    ``what`` did not happen otherwise.

    >>> wait_until(lambda: sent, 10, "the first send")  # doctest: +SKIP
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout:g} s")
        time.sleep(poll)


def gate_code(gate: Path, what: str, timeout: float = 120.0) -> str:
    """Python source defining ``wait_for_gate()`` for a cell: it returns once the file ``gate`` exists, so a rank
    moves on when the test (or nobody) opens the gate, instead of sleeping and hoping. After ``timeout`` seconds
    it raises ``RuntimeError(what)``: a run in which nothing opened the gate or interrupted the rank says so."""
    return (f"def wait_for_gate():\n"
            f"    import os, time\n"
            f"    deadline = time.monotonic() + {timeout!r}\n"
            f"    while not os.path.exists({str(gate)!r}):\n"
            f"        if time.monotonic() > deadline:\n"
            f"            raise RuntimeError({what!r})\n"
            f"        time.sleep(0.02)\n")
