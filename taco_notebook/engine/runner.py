"""A cell's (or a script's) runner on the rank: the per-cell set-up, the code, and the reply, in one request.

``%%taco_run`` sends each rank one ``view.apply`` of :func:`run_cell` (a script: :func:`run_script`), which does
the per-cell set-up of :mod:`.calls` (``begin_cell``, ``configure_cell``), runs the code, holds back the stdout of
ranks whose output is not shown (``--output``), resets the cell's settings, and answers in its reply what the
kernel needs back: the value of the last expression and whether this rank has replicas to check. So a cell is
one request per rank. Like :mod:`.calls`, it travels as a reference to this module, which the engines import.
"""

from __future__ import annotations

import io
import linecache
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

from ..ipp.quiet_kernel import end_silently, iopub_mark
from . import postmortem, undo
from .calls import (
    begin_cell,
    configure_cell,
    fetch_result,
    reset_settings,
    send_end_state,
    settings_in_force,
    user_shell,
)
from .script import Script
from .wire import CellReply, CellSetup

__all__ = ["run_cell", "run_script", "ScriptExit", "HELD_CHARS"]


HELD_CHARS = 64 * 1024  # the most of a quiet rank's stdout kept, to show if the rank fails


class _Held(io.StringIO):
    """A quiet rank's stdout: kept (the last :data:`HELD_CHARS`), not sent, unless the rank fails."""

    def write(self, text: str) -> int:
        written = super().write(text)
        if self.tell() > 2 * HELD_CHARS:
            tail = self.getvalue()[-HELD_CHARS:]
            self.seek(0)
            self.truncate()
            super().write(tail)
        return written


@contextmanager
def _quiet_unless_failed(output: str) -> Iterator[_Held | None]:
    """While the code runs: this rank's stdout held back when ``output`` says it is not shown (``--output``).
    The caller shows what was held when the rank fails (:func:`_show_held`); stderr always goes through."""
    from ..comm import rank

    if output == "all" or (output == "rank0" and rank() == 0):
        yield None
        return
    held, real = _Held(), sys.stdout
    sys.stdout = held
    try:
        yield held
    finally:
        sys.stdout = real


@contextmanager
def _horovod_names(wanted: bool) -> Iterator[None]:
    """``--horovod``: the script's ``horovod`` imports give taco's face while it runs (``horovod/shadow.py``)."""
    if not wanted:
        yield
        return
    from ..horovod.shadow import as_horovod

    with as_horovod():
        yield


def _show_held(held: _Held | None, output: str) -> None:
    """A quiet rank failed: what it printed is context for its traceback, so it is shown after all."""
    text = held.getvalue() if held is not None else ""
    if text:
        cut = " (its last 64 KiB)" if len(text) >= HELD_CHARS else ""
        print(f"[taco] this rank's output, held back by --output {output} until it failed{cut}:\n{text}",
              end="" if text.endswith("\n") else "\n", flush=True)


def _around(setup: CellSetup) -> None:
    """The per-cell set-up the runners do in the same request as the code: no message of its own. Settings a
    previous cell left in force (a Ctrl-C that landed in its reset) are reset first. The last cell's failure,
    kept for ``%taco_debug``, goes. First, the copy ``%taco_cluster undo`` restores (it never fails the cell)."""
    undo.before_cell()
    postmortem.drop()
    begin_cell(setup.dashboard, setup.interval)
    if settings_in_force() and not setup.reset:
        reset_settings()
    if setup.settings:
        configure_cell(setup.settings)


def run_cell(source: str, setup: CellSetup, captured: bool) -> CellReply:
    """A ``%%taco_run`` cell, in one request (``view.apply``): the per-cell set-up, then ``source`` run by the
    engine's IPython shell as an ``execute`` would run it (input transformers, so magics and ``!`` lines;
    history and ``In``; the events, so the metrics' post-execute flush), then what the kernel needs back:
    the value of the last expression (``captured``; only from the rank ``setup.value_from`` names, when it
    names one) and whether this rank has replicas to check.

    A failure is raised again, so the reply is an error named by the user's exception (``StallError``,
    ``KeyboardInterrupt``…); its traceback starts in the engine's machinery, which the kernel cuts at the
    cell's first frame (``reporting.render_traceback``). ``run_cell`` has already shown it once, on this
    request's IOPub, where the kernel does not read it."""
    from ..comm.diagnostics.replicas import wanted

    mark = iopub_mark() if setup.silent else None
    try:
        _around(setup)
        with _quiet_unless_failed(setup.output) as held:
            result = user_shell().run_cell(source, store_history=True)
    finally:
        if setup.reset:
            reset_settings()
    error = result.error_before_exec or result.error_in_exec
    if error is not None:
        postmortem.keep(error)
        _show_held(held, setup.output)
        raise error
    # end_silently last: it reads whether anything before it in this request was sent on IOPub
    return CellReply(fetch_result() if captured and _value_wanted(setup) else None, wanted(), end_silently(mark))


def _value_wanted(setup: CellSetup) -> bool:
    """Whether this rank's reply brings back the value of the cell's last expression (``setup.value_from``).
    A rank that does not know its rank yet sends it (asking MPI could be collective)."""
    from ..comm.state import state

    topology = state.topology
    return setup.value_from is None or topology is None or topology.rank == setup.value_from


class ScriptExit(RuntimeError):
    """A script called ``sys.exit`` with a non-zero status (raised in place of SystemExit, which would end the
    engine)."""


def run_script(script: Script, setup: CellSetup) -> CellReply:
    """Run ``script`` (``%taco_run SCRIPT ARGS``, :mod:`.script`) in this engine as ``python path args`` would,
    after the per-cell set-up (as :func:`run_cell`), then put ``__main__``, ``sys.argv`` and ``sys.path`` back
    for the next cell, and send the dashboard its end state (an applied call fires no post_execute)."""
    from ..comm.diagnostics.replicas import wanted

    mark = iopub_mark() if setup.silent else None
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=script.path, __builtins__=__builtins__, __cached__=None)
    saved = sys.modules.get("__main__"), sys.argv, list(sys.path)
    # the sent source is what runs: tracebacks show its lines even on a host without the file
    linecache.cache[script.path] = (len(script.source), None, script.source.splitlines(keepends=True), script.path)
    sys.modules["__main__"], sys.argv = main, [script.path, *script.args]
    sys.path.insert(0, os.path.dirname(script.path))
    held = None
    try:
        _around(setup)
        with _quiet_unless_failed(setup.output) as held, _horovod_names(script.horovod):
            exec(compile(script.source, script.path, "exec", dont_inherit=True), main.__dict__)  # noqa: S102
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _show_held(held, setup.output)
            status = f"status {exc.code}" if isinstance(exc.code, int) else repr(exc.code)
            raise ScriptExit(f"{os.path.basename(script.path)} called sys.exit({status})") from None
    except BaseException as exc:
        postmortem.keep(exc)
        _show_held(held, setup.output)
        raise
    finally:
        if saved[0] is not None:
            sys.modules["__main__"] = saved[0]
        sys.argv, sys.path[:] = saved[1], saved[2]
        send_end_state()
        if setup.reset:
            reset_settings()
    return CellReply(None, wanted(), end_silently(mark))
