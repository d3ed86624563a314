"""The Horovod face under real ``mpiexec``: ranks that disagree (shape, dtype, op, root, name, allgather and
alltoall dims) raise Horovod's RuntimeError on every rank within a second and the next call works; duplicate
names in flight raise ValueError everywhere; int16 and friends work; reducescatter, grouped allgather and sparse
allreduce give Horovod's results; ``join()`` feeds zeros to late allreduces."""

from __future__ import annotations

import re

import pytest

from ..support.mpirun import run_mpi


@pytest.mark.parametrize("n", [2, 3])
def test_mismatches_duplicate_names_dtypes_and_join(mpiexec: str, n: int) -> None:
    result = run_mpi(mpiexec, n, "agreement.py", args=["hvd"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(re.findall(r"OK (\d+) 20 checks", result.stdout)) == [str(k) for k in range(n)], result.stdout
