"""ipyparallel's public names that the rest of the package uses, imported here only."""

from __future__ import annotations

from ipyparallel import Client, Cluster
from ipyparallel.cluster.launcher import MPIEngineSetLauncher, SlurmEngineSetLauncher
from ipyparallel.error import RemoteError
from ipyparallel.util import shlex_join

__all__ = ["Client", "Cluster", "MPIEngineSetLauncher", "SlurmEngineSetLauncher", "RemoteError", "shlex_join",
           "publish_data"]


def publish_data(data: dict[str, object]) -> None:
    """Send ``data`` on this engine's IOPub as ipyparallel's datapub does (engine side only)."""
    from ipyparallel.datapub import publish_data as publish

    publish(data)
