"""Which frames are the user's: the hang autopsy shows where the user's code is, ``%taco_peek`` reads its
locals, ``%taco_debug`` starts at it. Python's, installed packages' and taco_notebook's own files are not."""

from __future__ import annotations

import sysconfig
from pathlib import Path

__all__ = ["library_file"]

_LIBRARY_ROOTS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                       | {str(Path(__file__).resolve().parents[2])})  # taco_notebook itself: never the user's place


def library_file(filename: str) -> bool:
    """Whether ``filename`` is Python's, an installed package's or taco_notebook's: not where a user's code is."""
    return filename.startswith(_LIBRARY_ROOTS) or filename.startswith("<frozen ")
