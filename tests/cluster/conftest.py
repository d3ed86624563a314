"""Fixtures for the cluster tests: the private Slurm of tests/support/slurm.py (module-scoped, skips saying why when it
cannot run here), offered here so that each test module asks for it by name instead of importing it."""

from __future__ import annotations

from ..support.slurm import slurm

__all__ = ["slurm"]
