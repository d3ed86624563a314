"""Host lists and hostfiles: ``--hosts n0:2,n1:2``, ``--hostfile FILE``, and the hosts of the Kubeflow MPIJob this
notebook runs in (``--profile mpijob``), read from the job's hostfile.

A notebook in the launcher pod of an MPIJob (MPI Operator v2, ``kubeflow.org/v2beta1``) attaches to the job's
worker pods the way the launcher's own ``mpirun`` would: through the hostfile the operator mounts into the
launcher. What the operator writes (``pkg/controller/mpi_job_controller.go`` in kubeflow/mpi-operator): a
ConfigMap ``<job>-config`` mounted at ``/etc/mpi``, its ``hostfile`` one line per worker pod,

* Open MPI (``mpiImplementation: OpenMPI``): ``<job>-worker-0.<job>-worker.<namespace>.svc slots=8``, and the
  launcher's environment sets ``OMPI_MCA_orte_default_hostfile=/etc/mpi/hostfile``;
* Intel MPI and MPICH: ``<job>-worker-0.<job>-worker.<namespace>.svc:8``, with ``I_MPI_HYDRA_HOST_FILE``
  (Intel) or ``HYDRA_HOST_FILE`` (MPICH) pointing at it;

``slots`` is the job's ``slotsPerWorker`` (1 when unset). The names resolve through the workers' headless Service,
the workers run ``sshd`` and launcher and workers mount the same generated ssh key (``sshAuthMountPath``), so
mpich's hydra over ssh from the launcher pod reaches them: the ``mpijob`` profile is the ``hosts`` profile over
these hosts. The launcher's environment also clears ``NVIDIA_VISIBLE_DEVICES`` (the launcher gets no GPU).

The engines need no shared filesystem to find the controller: ipyparallel hands them its connection info (the
registration address and the key that signs every message) in ``$IPP_CONNECTION_INFO``
(``Cluster.send_engines_connection_env``, on by default), and hydra copies mpiexec's environment to every rank,
so an engine on a worker pod reads it from there instead of the controller's file under ``~/.ipython``. That key
crosses the pod network inside hydra's own (unencrypted) launch connection to each worker's proxy.
``%taco_cluster manifest --k8s`` writes the other arrangement (the notebook outside the job, the connection file
in a Secret, the launcher running ``mpirun``); for this profile the launcher's container runs the notebook.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

__all__ = ["ProfileError", "parse_hosts", "read_hostfile", "HOSTFILE_VARIABLES", "MPIJOB_HOSTFILE",
           "mpijob_hostfile", "read_mpijob_hosts"]

_HOST = re.compile(r"^[A-Za-z0-9_.\-]+$")

# The variables MPI Operator sets in the launcher, in the order they are looked at: Open MPI, Intel MPI, MPICH.
HOSTFILE_VARIABLES = ("OMPI_MCA_orte_default_hostfile", "I_MPI_HYDRA_HOST_FILE", "HYDRA_HOST_FILE")
MPIJOB_HOSTFILE = "/etc/mpi/hostfile"  # where the operator mounts it (its configMountPath + hostfile)


class ProfileError(ValueError):
    """A bad profile, hosts spec, hostfile or size: the message names the thing and the fix."""


def parse_hosts(spec: str, what: str = "--hosts") -> tuple[tuple[str, int], ...]:
    """``"n0:2,n1:2"`` → ``(("n0", 2), ("n1", 2))``; a host without ``:SLOTS`` has 1 slot."""
    entries = [part.strip() for part in re.split(r"[,\n]", spec) if part.strip()]
    if not entries:
        raise ProfileError(f"{what} names no host: give HOST:SLOTS,… such as n0:2,n1:2")
    hosts: dict[str, int] = {}
    for entry in entries:
        host, _, slots_text = entry.partition(":")
        host = host.strip()
        try:
            slots = int(slots_text) if slots_text.strip() else 1
        except ValueError:
            slots = 0
        if not _HOST.match(host) or slots <= 0:
            raise ProfileError(f"{what}: {entry!r} is not HOST[:SLOTS] with SLOTS a positive integer "
                               f"(example: n0:2,n1:2)")
        if host in hosts:
            raise ProfileError(f"{what}: host {host!r} is named twice; give it once with all its slots")
        hosts[host] = slots
    return tuple(hosts.items())


def read_hostfile(path: str | os.PathLike[str], what: str | None = None) -> tuple[tuple[str, int], ...]:
    """A hostfile's hosts: ``HOST[:SLOTS]`` (MPICH's form) or ``HOST slots=N`` (Open MPI's) per line, ``#`` starts
    a comment; errors name ``what`` (default ``--hostfile 'PATH'``)."""
    what = what or f"--hostfile {str(path)!r}"
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ProfileError(f"{what} cannot be read ({exc.strerror or exc}): give an existing "
                           f"file with one HOST:SLOTS per line") from None
    lines = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.match(r"^(\S+)\s+slots\s*=\s*(\S+)$", line)
        lines.append(f"{match.group(1)}:{match.group(2)}" if match else line)
    return parse_hosts("\n".join(lines), what)


def mpijob_hostfile(environ: Mapping[str, str] | None = None,
                    default: str = MPIJOB_HOSTFILE) -> tuple[str, str]:
    """The MPIJob's hostfile and what named it: the first of :data:`HOSTFILE_VARIABLES` set, else ``default``
    when it exists; a ProfileError saying where the profile works (and what to use instead) when none is there."""
    environ = os.environ if environ is None else environ
    for name in HOSTFILE_VARIABLES:
        value = (environ.get(name) or "").strip()
        if value:
            return value, f"${name}"
    if Path(default).is_file():
        return default, default
    raise ProfileError(f"--profile mpijob is for a notebook running inside a Kubeflow MPIJob (its launcher pod), "
                       f"which has the job's hostfile: none of {', '.join('$' + n for n in HOSTFILE_VARIABLES)} is "
                       f"set and {default} does not exist. To run on Kubernetes from here, write an MPIJob with "
                       f"%taco_cluster manifest --k8s -np N --gpus-per-node G; elsewhere use --profile hosts or local")


def read_mpijob_hosts(environ: Mapping[str, str] | None = None,
                      default: str = MPIJOB_HOSTFILE) -> tuple[tuple[str, int], ...]:
    """``(host, slots)`` of every worker, in the hostfile's order (both of the operator's line formats)."""
    path, source = mpijob_hostfile(environ, default)
    what = f"the MPIJob's hostfile {path!r}" + ("" if source == path else f" (from {source})")
    return read_hostfile(path, what)
