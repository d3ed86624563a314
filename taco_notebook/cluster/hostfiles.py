"""The hosts of the Kubeflow MPIJob this notebook runs in (``--profile mpijob``), read from the job's hostfile.

A notebook in the launcher pod of an MPIJob (MPI Operator v2, ``kubeflow.org/v2beta1``) attaches to the job's
worker pods the way the launcher's own ``mpirun`` would: through the hostfile the operator mounts into the
launcher. What the operator writes (``pkg/controller/mpi_job_controller.go`` in kubeflow/mpi-operator, read
2026-11-23): a ConfigMap ``<job>-config`` mounted at ``/etc/mpi``, its ``hostfile`` one line per worker pod,

* Open MPI (``mpiImplementation: OpenMPI``): ``<job>-worker-0.<job>-worker.<namespace>.svc slots=8``, and the
  launcher's environment sets ``OMPI_MCA_orte_default_hostfile=/etc/mpi/hostfile``;
* Intel MPI and MPICH: ``<job>-worker-0.<job>-worker.<namespace>.svc:8``, with ``I_MPI_HYDRA_HOST_FILE``
  (Intel) or ``HYDRA_HOST_FILE`` (MPICH) pointing at it;

``slots`` is the job's ``slotsPerWorker`` (1 when unset). The names resolve through the workers' headless Service,
the workers run ``sshd`` and launcher and workers mount the same generated ssh key (``sshAuthMountPath``), so
mpich's hydra over ssh from the launcher pod reaches them: the ``mpijob`` profile is the ``hosts`` profile over
these hosts. The launcher's environment also clears ``NVIDIA_VISIBLE_DEVICES`` (the launcher gets no GPU).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["HOSTFILE_VARIABLES", "MPIJOB_HOSTFILE", "mpijob_hostfile", "read_mpijob_hosts"]

# The variables MPI Operator sets in the launcher, in the order they are looked at: Open MPI, Intel MPI, MPICH.
HOSTFILE_VARIABLES = ("OMPI_MCA_orte_default_hostfile", "I_MPI_HYDRA_HOST_FILE", "HYDRA_HOST_FILE")
MPIJOB_HOSTFILE = "/etc/mpi/hostfile"  # where the operator mounts it (its configMountPath + hostfile)


def mpijob_hostfile(environ: Mapping[str, str] | None = None,
                    default: str = MPIJOB_HOSTFILE) -> tuple[str, str]:
    """The MPIJob's hostfile and what named it: the first of :data:`HOSTFILE_VARIABLES` set, else ``default``
    when it exists; a ProfileError saying where the profile works (and what to use instead) when none is there."""
    from .profiles import ProfileError

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
    from .profiles import read_hostfile

    path, source = mpijob_hostfile(environ, default)
    what = f"the MPIJob's hostfile {path!r}" + ("" if source == path else f" (from {source})")
    return read_hostfile(path, what)
