"""The ``slurm`` profile inside :class:`~taco_notebook.cluster.session.TacoCluster`: which ipyparallel engine
launcher, its config, and how a start waits and a running cluster is judged alive.

Everything Slurm-specific is :mod:`.launchers`' (sbatch outside an allocation, srun inside one); this module only
wires it in, so that the session keeps one branch per place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .options import SlurmOptions

__all__ = ["engine_config", "wait", "job_alive"]


def engine_config(config: Any, options: SlurmOptions, engine_cmd: list[str], environment: Mapping[str, str],
                  progress: Callable[[str], None] | None) -> type:
    """Write the slurm launcher's section into ``config``; returns the launcher class for ``ipp.Cluster(engines=)``."""
    from . import launchers as slurm_launchers

    launcher = slurm_launchers.engine_launcher()
    slurm_launchers.configure(config, launcher, options, engine_cmd, environment, progress)
    return launcher


def wait(client: Any, launcher: Any, n: int, timeout: float) -> None:
    """Until ``n`` engines registered; a job that failed or never brought its engines up is a SlurmError."""
    from .launchers import wait_for_engines

    wait_for_engines(client, launcher, n, timeout)


def job_alive(launcher: Any) -> bool:
    """The engines' batch job has not ended under the cluster (no ``failure`` recorded by its watcher)."""
    return not getattr(launcher, "failure", "")
