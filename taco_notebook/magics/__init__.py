"""IPython magics: ``%%taco_run``, ``%taco_cluster``, ``%taco_doctor``, and the debugger's ``%taco_debug``,
``%taco_peek`` and ``%taco_diff``."""

from __future__ import annotations

from .core import TacoMagics
from .debugger import TacoDebugMagics

__all__ = ["TacoMagics", "TacoDebugMagics"]
