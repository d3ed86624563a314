"""Another kernel's cluster for a magic that reads it while this kernel may be idle and that one busy in a cell
(``%taco_cluster stacks``, ``%taco_peek``): found in the registry through a short-lived cluster manager."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from IPython.core.error import UsageError

__all__ = ["registry_cluster"]


@contextmanager
def registry_cluster(name: str, magic: str) -> Iterator[tuple[Any, dict[str, Any]]]:
    """The manager and the model of the registry's running cluster named (or with id) ``name``; UsageErrors,
    led by ``magic``, when none runs, when two share the name, or when the manager refuses."""
    from ..server.manager import ClusterManager
    from ..server.requests import ManagerError

    manager = ClusterManager(max_workers=1)
    try:
        models = [m for m in manager.list()["clusters"] if name in (m["name"], m["id"]) and m["state"] == "running"]
        if not models:
            raise UsageError(f"{magic} needs a running cluster; no cluster named {name!r} runs in this kernel or in "
                             "the registry (--cluster NAME or ID picks another)")
        if len(models) > 1:
            ids = ", ".join(m["id"] for m in models)
            raise UsageError(f"{len(models)} running clusters are named {name!r} (ids {ids}): --cluster ID picks one")
        yield manager, dict(models[0])
    except ManagerError as exc:
        raise UsageError(f"{magic}: {exc}") from None
    finally:
        manager.shutdown()
