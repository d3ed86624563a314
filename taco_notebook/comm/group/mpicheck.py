"""Catch an mpi4py that loaded a different MPI than the one that launched the job.

mpi4py picks its MPI library at import. Where a system Open MPI sits beside the mpich wheel (or the other way
round), ``mpiexec -n 2`` of one with the library of the other gives every rank ``MPI.COMM_WORLD`` of size 1:
each rank trains alone and nothing fails. The launcher's own variables still say how many ranks it started,
so a different world size is caught here, at once, with what was loaded and how to fix it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["MPIMismatchError", "launcher_size", "check_world", "mismatch_message", "mismatch_in"]

# (variable, what sets it); Slurm's only count under srun (SLURM_STEP_NUM_TASKS is set by srun alone): inside a
# batch script, SLURM_NTASKS describes the allocation, not this process.
_LAUNCHERS = (("PMI_SIZE", "mpich/hydra mpiexec (PMI)"), ("OMPI_COMM_WORLD_SIZE", "Open MPI mpiexec"),
              ("PMIX_SIZE", "a PMIx launcher"))
_SLURM = (("SLURM_STEP_NUM_TASKS", "Slurm srun"), ("SLURM_NTASKS", "Slurm srun"), ("SLURM_NPROCS", "Slurm srun"))


class MPIMismatchError(RuntimeError):
    """The launcher started N ranks but MPI reports another world size: mpi4py loaded the wrong MPI."""


def launcher_size(env: Mapping[str, str] | None = None) -> tuple[int, str, str] | None:
    """(ranks the launcher started, the variable, who set it), or None when no launcher says."""
    env = os.environ if env is None else env
    candidates = list(_LAUNCHERS) + (list(_SLURM) if "SLURM_STEP_NUM_TASKS" in env else [])
    for key, who in candidates:
        raw = env.get(key, "").strip()
        if raw.isdigit() and int(raw) > 0:
            return int(raw), key, who
    return None


def _fix_for(who: str) -> str:
    venv_lib = os.path.join(sys.prefix, "lib")
    if "Open MPI" in who:
        return ("launch with the mpiexec of the MPI mpi4py loads, or make mpi4py load Open MPI: "
                "MPI4PY_MPIABI=openmpi and Open MPI's lib directory (the one with libmpi.so.40) first on "
                "LD_LIBRARY_PATH")
    return ("launch with the mpiexec of the MPI mpi4py loads, or make mpi4py load MPICH: MPI4PY_MPIABI=mpich and "
            f"MPICH's lib directory (the one with libmpi.so.12, e.g. {venv_lib} for the mpich wheel) first on "
            "LD_LIBRARY_PATH")


def mismatch_message(world: int, expected: int, key: str, who: str, library: str) -> str:
    library = library.replace("\x00", "").strip()
    first = library.splitlines()[0] if library else "an unknown MPI library"
    return (f"MPI mismatch: {who} started {expected} ranks ({key}={expected}) but MPI.COMM_WORLD has {world} "
            f"rank{'s' if world != 1 else ''}: mpi4py loaded {first!r}, which is not the MPI that launched this "
            f"process, so every rank would run alone. Fix: {_fix_for(who)}.")


def check_world(comm: Any, env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`MPIMismatchError` when the launcher's rank count differs from ``comm``'s size."""
    said = launcher_size(env)
    if said is None:
        return
    expected, key, who = said
    world = comm.Get_size()
    if world == expected:
        return
    from mpi4py import MPI

    raise MPIMismatchError(mismatch_message(world, expected, key, who, MPI.Get_library_version()))


def mismatch_in(error: BaseException) -> str | None:
    """The :class:`MPIMismatchError` message a remote error carries (ipyparallel's RemoteError has ``ename``
    and ``evalue``, its CompositeError an ``elist`` of ``(ename, evalue, ...)``), or None."""
    if getattr(error, "ename", None) == "MPIMismatchError":
        return str(getattr(error, "evalue", error))
    for cause in getattr(error, "elist", None) or []:
        if cause and cause[0] == "MPIMismatchError":
            return str(cause[1])
    return None
