"""The rank-side tests under Debian's Open MPI, and the MPI-mismatch check against a real mismatch.

Open MPI is unpacked privately (``tests/support/openmpi.py``), never installed: a system Open MPI would change which
library mpi4py loads for every other process here. Needs root (apt-get) and the Debian mirror; skips saying so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from taco_notebook.cluster.launch.mpi import find_mpi, mpi4py_environment

from ..support.mpirun import run_in_session
from ..support.openmpi import OpenMPI, prepare_openmpi

SCRIPTS = Path(__file__).parents[1] / "mpi"
# one write() per rank, so the ranks' lines cannot interleave in mpiexec's output
MISMATCH_SCRIPT = "import os, taco_notebook.comm as taco; os.write(1, f'size {taco.size()}\\n'.encode())"


@pytest.fixture(scope="session")
def openmpi() -> OpenMPI:
    if os.geteuid() != 0:
        pytest.skip("unpacking Debian's Open MPI needs apt-get download as root")
    try:
        return prepare_openmpi()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"Debian's Open MPI could not be fetched: {exc}")


def _ompi_ranks_env(ompi: OpenMPI, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Open MPI's launcher, and mpi4py told to load Open MPI (what MPIInfo.environment gives such a cluster)."""
    env = ompi.environment()
    env.update(mpi4py_environment(ompi.mpiexec, "openmpi", base=env))
    env.update(extra or {})
    return env


@pytest.mark.mpi
def test_find_mpi_identifies_open_mpi_and_its_library(openmpi, monkeypatch):
    for key, value in openmpi.environment().items():
        monkeypatch.setenv(key, value)  # Open MPI's own mpiexec needs its prefix to run at all
    info = find_mpi(openmpi.mpiexec)
    assert info.implementation == "openmpi" and info.version.startswith("4.")
    assert "--oversubscribe" in info.extra_args
    assert info.environment["MPI4PY_MPIABI"] == "openmpi"
    assert info.environment["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(Path(openmpi.libmpi).parent)


@pytest.mark.parametrize(("n", "script", "extra"), [
    (2, "collectives.py", {}),
    (3, "collectives.py", {}),
    (2, "placement.py", {"TACO_GPUS": "auto"}),
])
@pytest.mark.mpi
def test_rank_scripts_under_open_mpi(openmpi, n, script, extra):
    result = run_in_session([*openmpi.mpiexec_args(n), sys.executable, str(SCRIPTS / script)],
                            env=_ompi_ranks_env(openmpi, extra), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert len(re.findall(r"OK \d+", result.stdout)) == n, result.stdout


@pytest.mark.mpi
def test_training_under_open_mpi_on_two_emulated_nodes(openmpi):
    result = run_in_session([*openmpi.mpiexec_args(4), sys.executable, str(SCRIPTS / "training.py")],
                            env=_ompi_ranks_env(openmpi, {"LIGHT_INTRA_SIZE": "2"}), timeout=420)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert len(re.findall(r"OK \d+", result.stdout)) == 4, result.stdout


def test_mpich_launch_with_open_mpi_loaded_fails_at_once_saying_why(openmpi, mpiexec):
    """The trap seen on the GPU machine: Open MPI's libraries first on the path, mpich's mpiexec."""
    env = {**openmpi.environment(), "MPI4PY_MPIABI": "openmpi"}
    result = run_in_session([mpiexec, "-n", "2", sys.executable, "-c", MISMATCH_SCRIPT], env=env, timeout=180)
    assert result.returncode != 0 and "size 1" not in result.stdout, result.stdout
    assert "MPIMismatchError: MPI mismatch: mpich/hydra mpiexec (PMI) started 2 ranks (PMI_SIZE=2) but " \
           "MPI.COMM_WORLD has 1 rank: mpi4py loaded 'Open MPI v4" in result.stderr, result.stderr[-3000:]
    assert "MPI4PY_MPIABI=mpich" in result.stderr


@pytest.mark.mpi
def test_open_mpi_launch_with_mpich_loaded_fails_at_once(openmpi):
    """The other way round the mpich wheel refuses Open MPI's PMIx in MPI_Init, before taco's check can run:
    it still fails at once instead of training alone, and says why (with our message where MPI does init)."""
    env = {**openmpi.environment(), "MPI4PY_MPIABI": "mpich"}
    # the ranks get only MPICH's lib dir (-x): its libmpi's RUNPATH yields to LD_LIBRARY_PATH, and Debian's
    # libfabric there would replace the wheel's own
    ranks_path = f"LD_LIBRARY_PATH={os.path.join(sys.prefix, 'lib')}"
    result = run_in_session([*openmpi.mpiexec_args(2), "-x", ranks_path, sys.executable, "-c", MISMATCH_SCRIPT],
                            env=env, timeout=180)
    assert result.returncode != 0 and "size 1" not in result.stdout, result.stdout
    ours = "Open MPI mpiexec started 2 ranks (OMPI_COMM_WORLD_SIZE=2)" in result.stderr
    assert ours or "unsupported PMI version PMIx" in result.stderr, result.stderr[-3000:]


def test_mpi_environment_of_the_cluster_prevents_the_mismatch(openmpi, mpiexec):
    """The same poisoned path, with what MPIInfo.environment adds for the engines: a world of 2."""
    poisoned = openmpi.environment()
    env = {**poisoned, **find_mpi(mpiexec).environment}
    env["LD_LIBRARY_PATH"] = os.pathsep.join([find_mpi(mpiexec).environment["LD_LIBRARY_PATH"],
                                              poisoned["LD_LIBRARY_PATH"]])
    result = run_in_session([mpiexec, "-n", "2", sys.executable, "-c", MISMATCH_SCRIPT], env=env, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("size 2") == 2, result.stdout


@pytest.mark.mpi
def test_cluster_start_shows_the_mismatch_not_an_engine_id_error(openmpi):
    """%%taco_run's cluster, its engines given Open MPI's library under mpich's mpiexec."""
    from taco_notebook.cluster.session import TacoCluster
    from taco_notebook.errors import ClusterStartError

    env = {key: value for key, value in openmpi.environment({}).items() if key != "PATH"}
    env["MPI4PY_MPIABI"] = "openmpi"
    cluster = TacoCluster("mismatch", 2, env=env, start_timeout=90)
    try:
        with pytest.raises(ClusterStartError) as info:
            cluster.start()
    finally:
        cluster.stop()
    text = str(info.value)
    assert "MPI mismatch" in text and "PMI_SIZE=2" in text and "engine ids" not in text, text
