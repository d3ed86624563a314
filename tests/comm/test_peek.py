"""``%taco_peek``'s rank side in this process: the listener evaluates an expression in the main thread's user
frame over the namespace it was given, bounded in time and in how many run at once, and says why when it cannot."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from taco_notebook.comm.diagnostics import listener, peek
from taco_notebook.remote.autopsy_reader import ask, peek_request


@pytest.fixture
def socket_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv(listener.DIR_ENV, str(tmp_path / "stacks"))
    peek.set_namespace(lambda: {"from_the_cell": 7, "shadowed": "global"})
    yield listener.listen()
    listener.stop_listening()
    peek.set_namespace(dict)


def test_a_peek_sees_the_cells_names_under_the_running_functions_locals(socket_path: Path) -> None:
    shadowed, step = "local", 41  # noqa: F841 - read by the peek, from this frame
    reply = ask(socket_path, 3.0, peek_request("(from_the_cell, shadowed, step + 1)", 1.0))
    assert reply["peek"] == {"value": "(7, 'local', 42)"}


def test_a_peek_that_raises_or_is_no_expression_says_so(socket_path: Path) -> None:
    said = ask(socket_path, 3.0, peek_request("1 / 0", 1.0))["peek"]
    assert said == {"error": "raised ZeroDivisionError: division by zero"}
    said = ask(socket_path, 3.0, peek_request("x = 1", 1.0))["peek"]["error"]
    assert said.startswith("SyntaxError") and "peek takes an expression, not a statement" in said


def test_a_blocked_peek_is_answered_in_time_and_a_pile_of_them_is_refused(socket_path: Path) -> None:
    release = threading.Event()
    peek.set_namespace(lambda: {"release": release})
    try:
        for _ in range(peek.MAX_RUNNING):
            said = ask(socket_path, 3.0, peek_request("release.wait(30)", 0.2))["peek"]
            assert said == {"error": "still running after 0.2 s (it waits on something the cell holds?); left to "
                                     "finish on its own"}
        refused = ask(socket_path, 3.0, peek_request("1", 0.2))["peek"]["error"]
        assert refused == f"{peek.MAX_RUNNING} earlier peeks on this rank are still running; try again when they end"
        stacks = ask(socket_path, 3.0)  # the stacks are still answered while the peeks wait
        assert not any(t["name"].startswith("taco-autopsy") for t in stacks["now"]["threads"])
    finally:
        release.set()
    for _ in range(50):  # the peeks end once released, and their places free up
        if ask(socket_path, 3.0, peek_request("1 + 1", 0.5))["peek"] == {"value": "2"}:
            break
    else:
        pytest.fail("the released peeks never freed their places")


def test_a_long_value_is_cut(socket_path: Path) -> None:
    value = ask(socket_path, 3.0, peek_request("'x' * 10000", 1.0))["peek"]["value"]
    assert len(value) == peek.VALUE_CHARS and value.endswith("…")
