"""IPython magics: ``%%taco_run`` and ``%taco_cluster``."""

from __future__ import annotations

from .core import TacoMagics

__all__ = ["TacoMagics"]
