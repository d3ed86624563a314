"""One rank under real ``mpiexec``: the step is plain torch (no hook, no fusion copy, no collective, no
compression), DDP's hook answers at once, and ``taco.allreduce`` leaves the tensor in place (the
checks are in tests/mpi/single_rank.py)."""

from __future__ import annotations

from ..support.mpirun import run_mpi


def test_one_rank_copies_and_communicates_nothing(mpiexec):
    result = run_mpi(mpiexec, 1, "single_rank.py", timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK 0" in result.stdout, result.stdout + result.stderr
