"""``python -m taco_notebook run|launch|doctor|emulate``: the command line of :mod:`taco_notebook.cli`."""

from __future__ import annotations

from taco_notebook.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m taco_notebook"))
