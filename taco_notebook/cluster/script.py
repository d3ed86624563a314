"""An existing Python script run on every rank, as ``python script.py ARGS`` would run it
(``%taco_run -np 4 train.py --epochs 1``, ``python -m taco_notebook launch -np 4 train.py --epochs 1``).

The kernel (or the ``launch`` command) resolves the path against its own working directory and reads the
script once (:func:`load_script`), so a missing file, a directory or an unreadable one is refused before
anything starts. What travels to the ranks is the script's *source* with its absolute path and argv
(:class:`Script`), not just a path: every rank runs the same code even where the ranks do not share the
kernel's filesystem (the hosts, slurm and mpijob profiles), and an edit saved while the job runs cannot reach
some ranks and not others. Modules the script imports from its own directory are found only where that
directory exists on the rank's host (always on the local profile; elsewhere, a shared filesystem).

On the rank (:func:`run_on_rank`, called with ``view.apply``) the script runs as python runs it: in a fresh
``__main__`` module (``__name__ == "__main__"``, ``__file__`` set, classes it defines picklable),
``sys.argv == [path, *args]``, its directory first on ``sys.path``; all three are put back afterwards, so the
engine is ready for the next cell. ``sys.exit(0)``/``sys.exit()`` ends the run normally; any other exit status
fails the rank, naming it.
"""

from __future__ import annotations

import linecache
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Script", "ScriptExit", "load_script", "run_on_rank"]


@dataclass(frozen=True)
class Script:
    """A script to run on the ranks: its absolute path (``__file__``, ``sys.argv[0]``), source and arguments."""

    path: str
    source: str
    args: tuple[str, ...] = ()

    def command(self) -> str:
        """How the user would have run it, for messages and the sidebar: ``train.py --epochs 1``."""
        import shlex

        return shlex.join([self.path, *self.args])


class ScriptExit(RuntimeError):
    """A script called ``sys.exit`` with a non-zero status (raised on the rank in place of SystemExit, which
    would end the engine)."""


def load_script(path: str | os.PathLike[str], args: list[str] | tuple[str, ...] = (),
                cwd: str | os.PathLike[str] | None = None) -> Script:
    """The script at ``path`` (relative to ``cwd``, else this process's working directory), read now; a
    ValueError naming the path and the fix when it is missing, a directory, unreadable or not Python text."""
    given = str(path)
    if not given.strip():
        raise ValueError("no script given: name a Python file, e.g. train.py --epochs 1")
    full = Path(cwd or os.getcwd(), os.path.expanduser(given)).resolve()
    if full.is_dir():
        raise ValueError(f"{given} is a directory ({full}), not a script: name the Python file to run in it")
    if not full.exists():
        raise ValueError(f"no script at {given} (looked for {full}; relative paths start at {cwd or os.getcwd()})")
    try:
        source = full.read_bytes().decode("utf-8")
    except PermissionError:
        raise ValueError(f"cannot read the script {full}: permission denied; make it readable "
                         f"(chmod u+r {full})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{full} is not a Python source file (not UTF-8 text: {exc.reason} at byte "
                         f"{exc.start})") from None
    except OSError as exc:
        raise ValueError(f"cannot read the script {full}: {exc.strerror or exc}") from None
    return Script(str(full), source, tuple(args))


def run_on_rank(script: Script) -> None:
    """Run ``script`` in this process as ``python path args`` would, then put ``__main__``, ``sys.argv`` and
    ``sys.path`` back (the engine runs further cells). On ipyparallel engines, called with ``view.apply``."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=script.path, __builtins__=__builtins__, __cached__=None)
    directory = os.path.dirname(script.path)
    saved = sys.modules.get("__main__"), list(sys.argv), list(sys.path)
    # the sent source is what runs: tracebacks show its lines even on a host without the file
    lines = script.source.splitlines(keepends=True)
    linecache.cache[script.path] = (len(script.source), None, lines, script.path)
    sys.modules["__main__"], sys.argv = main, [script.path, *script.args]
    sys.path.insert(0, directory)
    try:
        code = compile(script.source, script.path, "exec", dont_inherit=True)
        exec(code, main.__dict__)  # noqa: S102 - running the user's script is the point
    except SystemExit as exc:
        status = exc.code
        if status not in (None, 0):
            detail = f"status {status}" if isinstance(status, int) else repr(status)
            raise ScriptExit(f"{os.path.basename(script.path)} called sys.exit({detail})") from None
    finally:
        _restore(*saved)
        _flush_metrics()


def _restore(main: types.ModuleType | None, argv: list[str], path: list[str]) -> None:
    if main is not None:
        sys.modules["__main__"] = main
    sys.argv = argv
    sys.path[:] = path


def _flush_metrics() -> None:
    """A cell's end sends the dashboard its final picture (engine.py's post_execute hook); an applied call
    fires no post_execute, so the run does it here."""
    from . import engine

    engine.flush_metrics()
