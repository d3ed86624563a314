"""The node report behind ``%taco_doctor``, against this machine's real /proc and /sys.

Root-only parts reserve 2 MB huge pages and mount hugetlbfs in a private directory (both restored), and
measure the link between two emulated namespace nodes shaped to 1 Gbit/s; they skip with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from taco_notebook.cluster.doctor import (
    DoctorReport,
    HugePagesError,
    diagnose,
    diagnose_nodes,
    local_report,
    report_from_facts,
    require_hugepages,
)
from taco_notebook.cluster.mpi import find_mpi
from taco_notebook.comm import hardware
from taco_notebook.comm.linkspeed import measure_link, receive, send
from taco_notebook.comm.nodefacts import _parse_gpu_csv, library_identity, node_facts

REPO = Path(__file__).resolve().parent.parent
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
POOL_2M = Path("/sys/kernel/mm/hugepages/hugepages-2048kB")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to reserve huge pages and mount hugetlbfs")


@pytest.fixture(scope="module")
def facts() -> dict[str, Any]:
    return node_facts()


def _problems(facts: dict[str, Any]) -> list[str]:
    return [f.problem for f in diagnose(facts)]


def _meminfo(key: str) -> int:
    text = Path("/proc/meminfo").read_text()
    return int(re.search(rf"^{key}:\s+(\d+)", text, re.MULTILINE).group(1))  # type: ignore[union-attr]


# ---- facts against this machine ------------------------------------------------------------------------------
def test_facts_agree_with_other_readings_of_this_machine(facts: dict[str, Any]) -> None:
    assert json.loads(json.dumps(facts)) == facts  # JSON-able, as an engine must return it
    assert facts["hostname"] == socket.gethostname()
    huge = facts["hugepages"]
    assert huge["default_kb"] == _meminfo("Hugepagesize")
    assert huge["pools"][str(huge["default_kb"])]["total"] == _meminfo("HugePages_Total")
    mounted = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
               if line.split()[2] == "hugetlbfs"]
    assert [m["path"] for m in huge["mounts"]] == mounted
    cpu = facts["cpu"]
    assert cpu["cpus"] == os.cpu_count()
    assert len(cpu["numa_nodes"]) == len(list(Path("/sys/devices/system/node").glob("node[0-9]*")))
    assert sum(n["cpu_count"] for n in cpu["numa_nodes"]) == os.cpu_count()
    if shutil.which("ip"):  # iproute2's own view of the interfaces (netlink, not sysfs)
        links = json.loads(subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True,
                                          check=True).stdout)
        expected = {link["ifname"]: link["mtu"] for link in links if link["ifname"] != "lo"}
        assert {n["name"]: n["mtu"] for n in facts["nics"]} == expected
    info = find_mpi()
    assert (facts["mpi"]["implementation"], facts["mpi"]["version"]) == (info.implementation, info.version)
    assert facts["mpi"]["mpi4py"]["implementation"] == info.implementation  # the venv's mpi4py is on its mpich
    import torch

    assert facts["torch"]["version"] == torch.__version__
    assert facts["gpus"]["driver_gpus"] == len(hardware.gpu_names()) or hardware.visible_gpus() == 0


def test_single_node_report_renders_as_text_and_html(facts: dict[str, Any]) -> None:
    report = report_from_facts([facts])
    text, page = str(report), report._repr_html_()
    assert "n/a (one node)" in text and "n/a (one node)" in page
    assert text.count(facts["hostname"]) >= 1 and "huge pages 2 MB" in text
    assert page.count("<tr>") == 2  # header and one node
    for finding in report.nodes[0].findings:  # every problem is shown with its remedy, in both
        assert finding.problem in text and f"fix: {finding.remedy}" in text
        assert re.sub(r"[<>&'\"]", "", finding.remedy)[:40] in re.sub(r"&\w+;|&#x27;", "", page)


def test_without_huge_pages_the_report_says_how_to_reserve_them(facts: dict[str, Any]) -> None:
    if facts["hugepages"]["pools"]["2048"]["total"] > 0:
        pytest.skip("this machine has 2 MB huge pages reserved right now")
    findings = {f.problem: f.remedy for f in diagnose(facts)}
    two_mb = next(r for p, r in findings.items() if p.startswith("no 2 MB huge pages reserved"))
    assert "vm.nr_hugepages=" in two_mb and "/etc/sysctl.d/" in two_mb
    if "1048576" in facts["hugepages"]["pools"] and facts["hugepages"]["pools"]["1048576"]["total"] == 0:
        one_gb = next(r for p, r in findings.items() if p.startswith("no 1 GB huge pages reserved"))
        assert "default_hugepagesz=1GB hugepagesz=1GB hugepages=50" in one_gb and "reboot" in one_gb
    with pytest.raises(HugePagesError, match=rf"{re.escape(facts['node'])} \(0 free of 0 2 MB pages\)"):
        require_hugepages(report_from_facts([facts]), 1, "2M")


@pytest.fixture
def restore_hugepages() -> Iterator[str]:
    """A private directory to mount hugetlbfs on; afterwards it is unmounted and the reservation restored."""
    before = NR_HUGEPAGES.read_text().strip()
    mount = tempfile.mkdtemp(prefix="taco-doctor-huge-")
    try:
        yield mount
    finally:
        subprocess.run(["umount", mount], capture_output=True)
        os.rmdir(mount)
        NR_HUGEPAGES.write_text(before + "\n")
        assert NR_HUGEPAGES.read_text().strip() == before


@needs_root
def test_reserved_and_mounted_huge_pages_change_the_report(restore_hugepages: str) -> None:
    if hardware.hugepages() is None or hardware.hugepages()["page_kb"] != 2048:  # type: ignore[index]
        pytest.skip("the default huge page size here is not 2 MB")
    NR_HUGEPAGES.write_text("64\n")
    granted = int((POOL_2M / "nr_hugepages").read_text())
    if granted < 8:
        pytest.skip(f"the kernel granted only {granted} huge pages")
    reserved = node_facts()
    pool = reserved["hugepages"]["pools"]["2048"]
    assert pool["total"] == granted and pool["free"] == int((POOL_2M / "free_hugepages").read_text())
    problems = _problems(reserved)
    assert not any(p.startswith("no 2 MB huge pages reserved") for p in problems)
    unmounted = next(f for f in diagnose(reserved) if "no hugetlbfs is mounted" in f.problem)
    assert f"{granted} 2 MB huge pages reserved" in unmounted.problem
    assert "mount -t hugetlbfs -o pagesize=2M none /dev/hugepages" in unmounted.remedy

    result = subprocess.run(["mount", "-t", "hugetlbfs", "none", restore_hugepages], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount hugetlbfs: {result.stderr.strip()}")
    mounted = node_facts()
    assert {"path": restore_hugepages, "page_kb": 2048} in mounted["hugepages"]["mounts"]
    assert not any("hugetlbfs" in p for p in _problems(mounted))
    report = report_from_facts([mounted])
    assert restore_hugepages in str(report) and f"{pool['free']} free of {granted}" in str(report)
    require_hugepages(report, 8, "2M")
    require_hugepages(report, 8)  # the default size is 2 MB here
    with pytest.raises(HugePagesError, match=rf"lack {granted + 1} free huge pages 2 MB: {mounted['node']} "):
        require_hugepages(report, granted + 1, "2M")


def test_require_hugepages_refuses_bad_input(facts: dict[str, Any]) -> None:
    report = report_from_facts([facts])
    for bad in (0, -1, "8", True):
        with pytest.raises(ValueError, match="positive integer"):
            require_hugepages(report, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2M or 1G"):
        require_hugepages(report, 1, "3M")


# ---- the command line and missing tools ----------------------------------------------------------------------
def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def test_cli_prints_this_machines_report() -> None:
    done = subprocess.run([sys.executable, "-m", "taco_notebook.doctor"], capture_output=True, text=True,
                          env=_env(), timeout=180)
    assert done.returncode in (0, 1), done.stderr
    assert socket.gethostname() in done.stdout and "huge pages 1 GB" in done.stdout and "fix: " in done.stdout
    as_json = subprocess.run([sys.executable, "-m", "taco_notebook.doctor", "--json", "--require-hugepages",
                              "100000", "--page-size", "1G"], capture_output=True, text=True, env=_env(),
                             timeout=180)
    assert as_json.returncode == 3, as_json.stderr
    assert json.loads(as_json.stdout)["nodes"][0]["facts"]["hostname"] == socket.gethostname()
    assert f"lack 100000 free huge pages 1 GB: {socket.gethostname()}" in as_json.stderr
    bad = subprocess.run([sys.executable, "-m", "taco_notebook.doctor", "--require-hugepages", "0"],
                         capture_output=True, text=True, env=_env(), timeout=180)
    assert bad.returncode == 2 and "--require-hugepages must be a positive integer, got 0" in bad.stderr


def test_missing_nvidia_smi_and_mpiexec_are_reported_not_raised(tmp_path: Path) -> None:
    """A Python with the project's packages but no mpiexec beside it, and a PATH with neither tool."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    site = next((tmp_path / "bare" / "lib").glob("python*/site-packages"))
    import torch

    (site / "project.pth").write_text(str(Path(torch.__file__).parent.parent) + "\n")
    path = os.pathsep.join(d for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
                           if not any(os.access(os.path.join(d, t), os.X_OK) for t in ("mpiexec", "nvidia-smi")))
    done = subprocess.run([str(tmp_path / "bare" / "bin" / "python"), "-m", "taco_notebook.comm.nodefacts"],
                          capture_output=True, text=True, env=_env(PATH=path), timeout=180)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout)
    assert facts["mpi"]["mpiexec"] == "missing" and facts["gpus"]["tool"] == "missing"
    findings = {f.problem: f for f in diagnose(facts)}
    assert findings["no mpiexec beside this Python or on PATH"].severity == "error"
    assert "pip install mpich mpi4py" in findings["no mpiexec beside this Python or on PATH"].remedy
    assert any("nvidia-smi" in p for p in findings)
    assert "mpiexec missing" in str(report_from_facts([facts]))
