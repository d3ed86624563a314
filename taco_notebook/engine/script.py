"""An existing Python script run on every rank, as ``python script.py ARGS`` would run it
(``%taco_run -np 4 train.py --epochs 1``, ``python -m taco_notebook launch -np 4 train.py --epochs 1``).

The kernel (or the ``launch`` command) resolves the path against its own working directory and reads the
script once (:func:`load_script`), so a missing file, a directory or an unreadable one is refused before
anything starts. What travels to the ranks is the script's *source* with its absolute path and argv
(:class:`Script`), not just a path: every rank runs the same code even where the ranks do not share the
kernel's filesystem (the hosts, slurm and mpijob profiles), and an edit saved while the job runs cannot reach
some ranks and not others. Modules the script imports from its own directory are found only where that
directory exists on the rank's host (always on the local profile; elsewhere, a shared filesystem).

On the rank (:func:`~.runner.run_script`, called with ``view.apply``) the script runs as python runs it: in a
fresh ``__main__`` module (``__name__ == "__main__"``, ``__file__`` set, classes it defines picklable),
``sys.argv == [path, *args]``, its directory first on ``sys.path``; all three are put back afterwards, so the
engine is ready for the next cell. ``sys.exit(0)``/``sys.exit()`` ends the run normally; any other exit status
fails the rank, naming it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Script", "load_script"]


@dataclass(frozen=True)
class Script:
    """A script to run on the ranks: its absolute path (``__file__``, ``sys.argv[0]``), source and arguments."""

    path: str
    source: str
    args: tuple[str, ...] = ()
    horovod: bool = False  # --horovod: its ``horovod`` imports give taco's face (:mod:`taco_notebook.horovod.shadow`)

    def command(self) -> str:
        """How the user would have run it, for messages and the sidebar: ``train.py --epochs 1``."""
        import shlex

        return shlex.join([self.path, *self.args])


def load_script(path: str | os.PathLike[str], args: list[str] | tuple[str, ...] = (),
                cwd: str | os.PathLike[str] | None = None, horovod: bool = False) -> Script:
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
    return Script(str(full), source, tuple(args), horovod)
