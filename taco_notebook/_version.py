"""The package version, in a module of its own so that any layer can read it without importing the package root."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"  # keep equal to pyproject.toml's version
