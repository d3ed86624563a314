"""``%taco_peek``'s rank side: evaluate an expression in this rank's namespace while a cell runs, from the
autopsy listener (:mod:`.listener`), without stopping the cell.

The namespace is the innermost frame of user code on the main thread (so a loop inside ``def train():`` shows
its locals) over the cell's globals, the engine's user namespace. The expression runs on a thread of its own,
which the listener waits for at most the asked time: an expression that blocks (a lock the cell holds, a
collective) is answered "still running" and left to finish; at most :data:`MAX_RUNNING` run at once, so a
stuck peek never piles up threads. It runs beside the cell, as a second thread of the same process: reading
(``loss.item()``, ``opt.param_groups[0]["lr"]``, ``torch.cuda.memory_allocated()``) is what it is for;
an expression that writes, writes.

Only the rank's own user reaches the listener (a 0700 directory and ``SO_PEERCRED``), so only the owner of
the cluster can peek.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from .userframes import library_file

__all__ = ["MAX_RUNNING", "VALUE_CHARS", "set_namespace", "evaluate"]

MAX_RUNNING = 4  # peeks still evaluating at once (each a daemon thread); past that a peek is refused
VALUE_CHARS = 2000  # of a value's repr sent back

_namespace: list[Callable[[], Mapping[str, Any]]] = []
_running = threading.BoundedSemaphore(MAX_RUNNING)


def set_namespace(provider: Callable[[], Mapping[str, Any]]) -> None:
    """Where peeks read names: the engine's user namespace (engine/calls.py sets it at engine setup)."""
    _namespace[:] = [provider]


def _scope() -> dict[str, Any]:
    """The cell's globals under the main thread's innermost frame of user code, whose locals win."""
    scope = dict(_namespace[0]()) if _namespace else {}
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    while frame is not None and library_file(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is not None and frame.f_locals is not frame.f_globals:
        scope.update(frame.f_locals)
    return scope


def _shown(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 - a broken __repr__ is the value's, reported as such
        return f"<repr failed: {type(exc).__name__}: {exc}>"
    return text if len(text) <= VALUE_CHARS else text[: VALUE_CHARS - 1] + "…"


def evaluate(expression: str, timeout: float) -> dict[str, Any]:
    """``{"value": repr}`` of ``expression`` here and now, or ``{"error": why}``: it does not compile, it
    raised, it still runs after ``timeout`` seconds, or :data:`MAX_RUNNING` earlier peeks still run."""
    try:
        code = compile(expression, "<peek>", "eval")
    except SyntaxError as exc:
        return {"error": f"SyntaxError: {exc.msg} (peek takes an expression, not a statement)"}
    if not _running.acquire(blocking=False):
        return {"error": f"{MAX_RUNNING} earlier peeks on this rank are still running; try again when they end"}
    answer: dict[str, Any] = {}

    def run() -> None:
        try:
            answer["value"] = _shown(eval(code, _scope()))  # noqa: S307 - the owner's expression, by design
        except BaseException as exc:  # noqa: BLE001 - the expression's own error is the answer
            answer["error"] = f"raised {type(exc).__name__}: {exc}"
        finally:
            _running.release()

    worker = threading.Thread(target=run, name="taco-autopsy-peek", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return {"error": f"still running after {timeout:g} s (it waits on something the cell holds?); left to "
                         "finish on its own"}
    return dict(answer)
