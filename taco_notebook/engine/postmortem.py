"""The rank's side of ``%taco_debug``: the failed cell's exception kept for a post-mortem pdb in its frames.

When a cell (or a script) raises on this rank, the runner keeps the exception, with its traceback and so its
frames' variables, until the next cell begins: a reference, nothing copied, nothing run. ``%taco_debug`` then
opens a pdb session here and sends it one command at a time (:func:`command`); pdb's output comes back as the
reply, so the notebook shows it under the magic and reads the next command from the kernel's stdin, as
``%debug`` does. The rank's engine stays free: other ranks, and this one's listener, go on as before.

The session starts in the innermost frame of the user's code (``%debug`` starts in the innermost frame of all;
``down`` reaches the library's frames below it); the engine's own frames above the cell are cut, so ``up`` stops
at the cell (or the script's top level).
"""

from __future__ import annotations

import io
import pdb
import re
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ..comm.diagnostics.userframes import library_file
from .calls import RESULT_NAME

__all__ = ["Failure", "keep", "drop", "failure", "start", "command", "end", "NoFailureError"]

# the kernel's rewrite of a cell's last expression (cluster/cells/result.py), shown as the user wrote it
_RESULT_LINE = re.compile(rf"{RESULT_NAME} = \((.*)\)$", re.M)
_OUTPUT_CHARS = 64 * 1024  # one command's output at most: a `p` of a huge tensor is cut, the session goes on


class NoFailureError(RuntimeError):
    """``%taco_debug`` asked a rank that holds no failed cell."""


@dataclass
class Failure:
    """The exception of this rank's last cell, when it raised."""

    error: BaseException
    traceback: TracebackType | None  # as it was kept: raising the error again prepends the runner's frames
    at: float  # time.time() when it was kept: the first failed rank is the earliest

    def describe(self) -> dict[str, Any]:
        return {"type": type(self.error).__name__, "message": str(self.error)[:500], "at": self.at}


_kept: list[Failure] = []
_session: list[_Session] = []


def keep(error: BaseException) -> None:
    """The cell's runner: this rank's cell raised ``error``."""
    drop()
    _kept.append(Failure(error, error.__traceback__, time.time()))


def drop() -> None:
    """A new cell begins: the last one's failure, its frames and any session on it go."""
    _kept.clear()
    _session.clear()


def failure() -> dict[str, Any] | None:
    """``{type, message, at}`` of the failure this rank keeps, or None."""
    return _kept[0].describe() if _kept else None


def _user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from its first frame of user code on (the cell, a script): the engine's frames above are cut."""
    first = tb
    while first is not None and library_file(first.tb_frame.f_code.co_filename):
        first = first.tb_next
    return first or tb


class _Session(pdb.Pdb):
    """A pdb whose commands come from :func:`command` and whose output is returned, not printed."""

    def __init__(self, tb: TracebackType) -> None:
        self.out = io.StringIO()
        # nosigint: `c` must not take over the engine's SIGINT handler (the Ctrl-C ladder needs it)
        super().__init__(stdin=io.StringIO(), stdout=self.out, nosigint=True, readrc=False)
        self.prompt = "(Pdb) "
        self.reset()
        self.setup(None, tb)  # type: ignore[arg-type]  # pdb.post_mortem's own call: no frame, a traceback
        users = [i for i, (frame, _) in enumerate(self.stack) if not library_file(frame.f_code.co_filename)]
        if users:  # the user's innermost frame, not taco's or torch's below it (`down` still reaches those)
            self.curindex = users[-1]
            self.curframe = self.stack[self.curindex][0]
            self.curframe_locals = self.curframe.f_locals

    def taken(self) -> str:
        text = _RESULT_LINE.sub(r"\1", self.out.getvalue())
        self.out.seek(0)
        self.out.truncate()
        if len(text) > _OUTPUT_CHARS:
            text = text[:_OUTPUT_CHARS] + f"\n... (output cut at {_OUTPUT_CHARS // 1024} KiB)\n"
        return text


def start() -> str:
    """Open the session on the kept failure: the exception and where the innermost frame is."""
    if not _kept:
        raise NoFailureError("this rank holds no failed cell: its last cell did not raise, or another cell ran "
                             "since")
    error = _kept[0].error
    tb = _user_traceback(_kept[0].traceback)
    if tb is None:
        raise NoFailureError(f"this rank's {type(error).__name__} carries no traceback to debug")
    session = _Session(tb)
    _session[:] = [session]
    session.message(f"{type(error).__name__}: {error}")
    session.print_stack_entry(session.stack[session.curindex])
    return session.taken()


def command(line: str) -> tuple[str, bool]:
    """Run one pdb command in the open session: its output, and whether the session ended (``q``, ``c``)."""
    if not _session:
        raise NoFailureError("no %taco_debug session is open on this rank")
    session = _session[0]
    try:
        ended = bool(session.onecmd(session.precmd(line)))
    except Exception as exc:  # noqa: BLE001 - pdb reports its own errors; anything else ends nothing
        session.message(f"*** {type(exc).__name__}: {exc}")
        ended = False
    if ended:
        _session.clear()
    return session.taken(), ended


def end() -> None:
    """Close the session (the notebook's loop ended: EOF, Ctrl-C, the last ``-c`` command)."""
    _session.clear()
