"""How many ranks a cluster may have: one limit for ``%%taco_run``, ``%taco_cluster``, the REST API and the
registry's request files, checked before anything starts.

A local cluster puts every rank on this machine, so its limit follows the cores: ``4 × cores`` (at least 8),
enough to oversubscribe a laptop for tests, far below what would exhaust the process table. ``TACO_MAX_RANKS``
raises or lowers it (for every profile), and ``%config TacoMagics.max_ranks`` for one notebook's magics; other
profiles will state their own capacity here.
"""

from __future__ import annotations

import os

__all__ = ["MAX_RANKS_ENV", "max_ranks", "check_size", "SizeLimitError"]

MAX_RANKS_ENV = "TACO_MAX_RANKS"


class SizeLimitError(ValueError):
    """A cluster size that is not a positive integer or is over the profile's limit; the message says how to fix it."""


def _default_local_limit() -> int:
    return max(8, 4 * (os.cpu_count() or 1))


def max_ranks(profile: str = "local") -> int:
    """The most ranks a cluster of ``profile`` may have (``TACO_MAX_RANKS`` when set)."""
    raw = os.environ.get(MAX_RANKS_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            raise SizeLimitError(f"{MAX_RANKS_ENV} must be a positive integer, got {raw!r}") from None
        if value < 1:
            raise SizeLimitError(f"{MAX_RANKS_ENV} must be a positive integer, got {raw!r}")
        return value
    return _default_local_limit()


def check_size(size: object, what: str = "size", profile: str = "local", limit: int | None = None) -> int:
    """``size`` as an int in 1..max_ranks(profile), or :class:`SizeLimitError` naming ``what`` and the fix.

    ``limit``: the notebook's own limit (``%config TacoMagics.max_ranks``), in place of the environment's.

    >>> check_size(4, "-np")
    4
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        shown = repr(size) if len(repr(size)) <= 40 else repr(size)[:37] + "..."
        raise SizeLimitError(f"{what} must be a positive integer, got {shown}")
    fix = "raise it with %config TacoMagics.max_ranks = N" if limit is not None else (
        f"set {MAX_RANKS_ENV}=N in the environment of the kernel (and the Jupyter server) to raise it")
    limit = max_ranks(profile) if limit is None else limit
    if size > limit:
        cores = os.cpu_count() or 1
        shown = str(size) if len(str(size)) <= 20 else str(size)[:17] + "..."
        raise SizeLimitError(f"{what} {shown} is over the limit of {limit} ranks for a {profile} cluster "
                             f"(this machine has {cores} cores); {fix}")
    return size
