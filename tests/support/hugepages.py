"""Huge pages for a test, given back afterwards: the ``vm.nr_hugepages`` reservation and a private hugetlbfs mount.

Both are machine-wide (other tests and jobs on this machine see them), so a test changes them only inside
:func:`hugepages_restored` / :func:`hugetlbfs_dir`, which put them back also when the test fails. Root only:
tests that use these skip with :data:`NEEDS_ROOT` otherwise.

    with hugepages_restored() as before, hugetlbfs_dir("taco-huge-") as mount:
        if reserve_hugepages(64) < 8:
            pytest.skip("the kernel granted too few huge pages")
        mount_hugetlbfs(mount)
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["NR_HUGEPAGES", "POOL_2M", "NEEDS_ROOT", "hugepages_restored", "reserve_hugepages", "hugetlbfs_dir",
           "mount_hugetlbfs"]

NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")  # the reservation of the default page size
POOL_2M = Path("/sys/kernel/mm/hugepages/hugepages-2048kB")
NEEDS_ROOT = "reserving huge pages (vm.nr_hugepages) and mounting hugetlbfs need root"


@contextmanager
def hugepages_restored() -> Iterator[int]:
    """The reservation as it is now (yielded), written back afterwards and checked."""
    before = NR_HUGEPAGES.read_text().strip()
    try:
        yield int(before)
    finally:
        NR_HUGEPAGES.write_text(before + "\n")
        assert NR_HUGEPAGES.read_text().strip() == before


def reserve_hugepages(total: int) -> int:
    """Ask for ``total`` huge pages of the default size; how many the kernel granted (fewer when memory is
    fragmented). Call it inside :func:`hugepages_restored`."""
    NR_HUGEPAGES.write_text(f"{total}\n")
    return int(NR_HUGEPAGES.read_text())


@contextmanager
def hugetlbfs_dir(prefix: str) -> Iterator[str]:
    """A private directory to mount hugetlbfs on; afterwards unmounted (when it was) and removed."""
    mount = tempfile.mkdtemp(prefix=prefix)
    try:
        yield mount
    finally:
        subprocess.run(["umount", mount], capture_output=True)
        os.rmdir(mount)


def mount_hugetlbfs(mount: str) -> None:
    """Mount hugetlbfs (the default page size) on ``mount``; skip the test, saying why, when the kernel refuses."""
    result = subprocess.run(["mount", "-t", "hugetlbfs", "none", mount], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount hugetlbfs: {result.stderr.strip()}")
