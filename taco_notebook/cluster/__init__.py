"""Clusters of MPI-launched ipyparallel engines, owned by the notebook kernel.

Kept import-light: ``python -m taco_notebook.engine.rankwrap`` runs on every rank at launch.
"""

from __future__ import annotations

__all__ = ["TacoCluster", "RankInfo", "clusters", "stop_all"]


def __getattr__(name: str) -> object:
    if name in __all__:
        from . import session

        return getattr(session, name)
    raise AttributeError(name)
