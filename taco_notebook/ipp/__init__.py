"""The one door to ipyparallel and ipykernel: their public names that taco uses, re-exported here, and in
submodules every override of their internals (the lean client, the hub, the quiet kernel, the streams, the
comm pump). No other module of the package imports ipyparallel."""

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
