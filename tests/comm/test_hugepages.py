"""The 2D allreduce's intra-node segment lives in huge pages when the node has them (root only)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest

from ..support.hugepages import (
    NEEDS_ROOT,
    NR_HUGEPAGES,
    hugepages_restored,
    hugetlbfs_dir,
    mount_hugetlbfs,
    reserve_hugepages,
)
from ..support.mpirun import run_mpi

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason=NEEDS_ROOT)

SCRIPT = """\
import torch, taco_notebook.comm as taco
from taco_notebook.comm.collectives import algorithms
t = torch.full((1_000_003,), float(taco.rank()))
taco.allreduce(t, algorithm="2d")
assert torch.equal(t, torch.full_like(t, 6.0)), t[:4]
# one write per report: ranks share one stdout, and print() with several arguments writes each apart
print(f"LOCATION {taco.rank()} {algorithms.hierarchy().segment.location}", flush=True)
"""


@pytest.fixture
def hugetlbfs() -> Iterator[str]:
    """64 huge pages and a hugetlbfs mount, both restored afterwards."""
    with hugepages_restored(), hugetlbfs_dir("taco-huge-") as mount:
        if reserve_hugepages(64) < 8:
            pytest.skip("the kernel granted too few huge pages")
        mount_hugetlbfs(mount)
        yield mount


def test_segment_uses_huge_pages_and_leaves_nothing(mpiexec, hugetlbfs, tmp_path):
    script = tmp_path / "huge.py"
    script.write_text(SCRIPT)
    result = run_mpi(mpiexec, 4, str(script), {"LIGHT_INTRA_SIZE": "2"})
    assert result.returncode == 0, result.stdout + result.stderr
    locations = dict(re.findall(r"LOCATION (\d) (\S+?)(?=LOCATION|\s|$)", result.stdout))
    assert sorted(locations) == ["0", "1", "2", "3"], result.stdout
    assert set(locations.values()) == {hugetlbfs}
    assert os.listdir(hugetlbfs) == []  # unlinked once mapped


def test_segment_falls_back_to_dev_shm_without_huge_pages(mpiexec, tmp_path):
    if int(NR_HUGEPAGES.read_text()) > 0:
        pytest.skip("this machine has huge pages reserved")
    script = tmp_path / "shm.py"
    script.write_text(SCRIPT)
    result = run_mpi(mpiexec, 4, str(script), {"LIGHT_INTRA_SIZE": "2"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(re.findall(r"LOCATION \d (\S+?)(?=LOCATION|\s|$)", result.stdout)) == {"/dev/shm"}, result.stdout
