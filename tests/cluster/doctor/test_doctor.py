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

from taco_notebook.cluster.doctor.collect import diagnose_nodes, measure_links, report_from_facts
from taco_notebook.cluster.doctor.nodefacts import _parse_gpu_csv, library_identity, node_facts
from taco_notebook.cluster.doctor.report import DoctorReport, HugePagesError, diagnose, require_hugepages
from taco_notebook.cluster.launch.mpi import find_mpi
from taco_notebook.comm.diagnostics.linkspeed import measure_link, receive, send, start_receiver
from taco_notebook.comm.group import hardware

from ...support.hugepages import (
    NEEDS_ROOT,
    POOL_2M,
    hugepages_restored,
    hugetlbfs_dir,
    mount_hugetlbfs,
    reserve_hugepages,
)

REPO = Path(__file__).resolve().parents[3]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason=NEEDS_ROOT)


@pytest.fixture(scope="module")
def facts() -> dict[str, Any]:
    return node_facts()


def _problems(facts: dict[str, Any]) -> list[str]:
    return [f.problem for f in diagnose(facts)]


def _meminfo(key: str) -> int:
    text = Path("/proc/meminfo").read_text()
    return int(re.search(rf"^{key}:\s+(\d+)", text, re.MULTILINE).group(1))  # type: ignore[union-attr]


# ---- facts against this machine ------------------------------------------------------------------------------
@pytest.mark.mpi
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
        assert f"{facts['node']}: {finding.problem}" in text and f"fix: {finding.remedy}" in text
        assert re.sub(r"[<>&'\"]", "", finding.remedy)[:40] in re.sub(r"&\w+;|&#x27;", "", page)


def test_without_huge_pages_the_report_says_how_to_reserve_them(facts: dict[str, Any]) -> None:
    if facts["hugepages"]["pools"]["2048"]["total"] > 0:
        pytest.skip("this machine has 2 MB huge pages reserved right now")
    findings = {f.problem: f.remedy for f in diagnose(facts)}
    two_mb = next(r for p, r in findings.items() if p.startswith("no 2 MB huge pages reserved"))
    assert "vm.nr_hugepages=" in two_mb and "/etc/sysctl.d/" in two_mb
    with pytest.raises(HugePagesError, match=rf"{re.escape(facts['node'])} \(0 free of 0 2 MB pages\)"):
        require_hugepages(report_from_facts([facts]), 1, "2M")


def test_missing_1gb_pages_are_information_and_only_on_gpu_nodes(facts: dict[str, Any]) -> None:
    """1 GB pages serve only a HARP-style network stack on GPU nodes: a CPU-only node hears nothing of them (no
    GRUB, no reboot), a GPU node hears it as information; this machine's facts, with and without GPUs listed."""
    cpu_only = {**facts, "gpus": {"tool": "missing", "gpus": [], "driver_gpus": 0}}
    said = diagnose(cpu_only)
    assert not [f for f in said if "1 GB" in f.problem or "grub" in f.remedy.lower() or "and reboot" in f.remedy
                or "and a reboot" in f.remedy], said
    for pool in ({"total": 0, "free": 0}, None):  # none reserved; none offered by the CPU
        pools = {k: v for k, v in facts["hugepages"]["pools"].items() if k != "1048576"}
        if pool is not None:
            pools["1048576"] = pool
        h100 = {"index": 0, "name": "H100", "memory_mib": 81559, "bus_id": None}
        gpu_node = {**facts, "hugepages": {**facts["hugepages"], "pools": pools},
                    "gpus": {"tool": "ok", "gpus": [h100], "driver_gpus": 1, "topology": "GPU0 X"}}
        one_gb = [f for f in diagnose(gpu_node) if "1 GB huge pages" in f.problem]
        assert [f.severity for f in one_gb] == ["info"], one_gb
        assert "HARP" in one_gb[0].problem and "hugepagesz=1GB" in one_gb[0].remedy


@pytest.fixture
def restore_hugepages() -> Iterator[str]:
    """A private directory to mount hugetlbfs on; afterwards it is unmounted and the reservation restored."""
    with hugepages_restored(), hugetlbfs_dir("taco-doctor-huge-") as mount:
        yield mount


@pytest.mark.mpi
@needs_root
def test_reserved_and_mounted_huge_pages_change_the_report(restore_hugepages: str) -> None:
    if hardware.hugepages() is None or hardware.hugepages()["page_kb"] != 2048:  # type: ignore[index]
        pytest.skip("the default huge page size here is not 2 MB")
    granted = reserve_hugepages(64)
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

    mount_hugetlbfs(restore_hugepages)
    mounted = node_facts()
    assert {"path": restore_hugepages, "page_kb": 2048} in mounted["hugepages"]["mounts"]
    assert not any("hugetlbfs" in p for p in _problems(mounted))
    report = report_from_facts([mounted])
    assert restore_hugepages in str(report) and f"{pool['free']} free of {granted}" in str(report)
    require_hugepages(report, 8, "2M")
    require_hugepages(report, 8)  # the default size is 2 MB here
    with pytest.raises(HugePagesError, match=rf"lack {granted + 1} free huge pages 2 MB: {mounted['node']} "):
        require_hugepages(report, granted + 1, "2M")


def test_mpi4py_on_another_mpi_than_mpiexec_is_found_with_the_fix() -> None:
    """The GPU machine's trap for real: mpi4py made to load a (private, unpacked) Open MPI beside mpich's mpiexec."""
    from tests.support.openmpi import prepare_openmpi

    try:
        ompi = prepare_openmpi()
    except RuntimeError as exc:
        pytest.skip(f"no Open MPI to load: {exc}")
    env = ompi.environment(_env(MPI4PY_MPIABI="openmpi"))
    probe = "import json; from taco_notebook.cluster.doctor.nodefacts import mpi_facts; print(json.dumps(mpi_facts()))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr
    mpi = json.loads(done.stdout)
    assert (mpi["implementation"], mpi["mpi4py"]["implementation"]) == ("mpich", "openmpi")
    assert mpi["mpi4py_with_ranks_env"]["implementation"] == "mpich"  # what taco gives its ranks fixes it
    [finding] = [f for f in diagnose({"mpi": mpi}) if "mpi4py" in f.problem]
    assert finding.severity == "warning" and "would run every rank alone" in finding.problem
    assert finding.remedy.startswith("`export MPI4PY_MPIABI=mpich LD_LIBRARY_PATH=")
    broken = {**mpi, "mpi4py_with_ranks_env": mpi["mpi4py"]}  # had taco's environment not helped either
    [error] = [f for f in diagnose({"mpi": broken}) if "mpi4py" in f.problem]
    assert error.severity == "error" and "--mpiexec PATH" in error.remedy


def test_nodes_on_different_mpis_and_an_unmeasurable_link_are_cluster_problems(
        facts: dict[str, Any], bare_python: str, tmp_path: Path) -> None:
    from tests.support.openmpi import prepare_openmpi

    try:
        ompi = prepare_openmpi()
    except RuntimeError as exc:
        pytest.skip(f"no Open MPI: {exc}")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "mpiexec").symlink_to(ompi.mpiexec)  # what Debian's alternatives link would be
    env = ompi.environment(_env(MPI4PY_MPIABI="openmpi"))
    other = _facts_from(bare_python, {**env, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}",
                                      "TACO_NODE_NAME": "ompi-node"})
    assert (other["node"], other["mpi"]["implementation"], other["mpi"]["mpi4py"]["implementation"]) == \
        ("ompi-node", "openmpi", "openmpi")
    assert not [f for f in diagnose(other) if "mpi" in f.problem.lower()]  # that node on its own is consistent
    links = measure_links({"here": [sys.executable], "ompi-node": [sys.executable]},
                          {"here": "127.0.0.1", "ompi-node": "192.0.2.1"})  # TEST-NET-1: not an address here
    assert links[0]["gbit_per_s"] is None and "Cannot assign requested address" in links[0]["error"]
    report = report_from_facts([{**facts, "node": "here"}, other], links)
    problems = {f.problem.split(" (")[0]: f for f in report.cluster_findings}
    assert problems["the nodes run different MPIs"].severity == "error"
    assert f"here {facts['mpi']['implementation']} {facts['mpi']['version']}; ompi-node openmpi " in \
        problems["the nodes run different MPIs"].problem
    assert any(p.startswith("the link here → ompi-node could not be measured") for p in problems)
    assert not report.ok and "cluster: the nodes run different MPIs" in str(report)
    assert "→ ompi-node: failed" in str(report)


@pytest.mark.mpi
def test_mpi_versions_are_read_from_the_mpis_own_words() -> None:
    info = find_mpi()
    said = subprocess.run([info.mpiexec, "--version"], capture_output=True, text=True, timeout=60).stdout
    assert library_identity(said) == (info.implementation, info.version)
    from mpi4py import MPI

    assert library_identity(MPI.Get_library_version()) == (info.implementation, info.version)
    assert library_identity("mpiexec (OpenRTE) 4.1.4\n\nReport bugs to http://www.open-mpi.org/") == \
        ("openmpi", "4.1.4")


def test_gpu_and_nic_findings_from_a_gpu_node_s_facts(facts: dict[str, Any]) -> None:
    """No GPU here: nvidia-smi's documented CSV (its --query-gpu=...,nounits form) stands in for one, on top of
    this machine's real facts. The parser and the count against NICs are what is checked, not nvidia-smi."""
    csv = "\n".join(f"{i}, NVIDIA H100 80GB HBM3, 81559, 00000000:{0x18 + i:02X}:00.0" for i in range(8))
    gpus = _parse_gpu_csv(csv + "\n")
    assert len(gpus) == 8 and gpus[3] == {"index": 3, "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559,
                                          "bus_id": "00000000:1B:00.0"}
    node = {**facts, "gpus": {"tool": "ok", "driver_gpus": 8, "visible": 8, "gpus": gpus, "topology": "GPU0 X"}}
    problems = _problems(node)
    up = [n for n in facts["nics"] if n["up"]]
    if 0 < len(up) < 8:
        assert any(p.startswith(f"8 GPUs share {len([n for n in up if n['hardware']]) or len(up)} NIC") for p in
                   problems), problems
    assert any("CPU build on a node with 8 GPU(s)" in p for p in problems)  # torch here is the CPU build
    assert "8 × NVIDIA H100 80GB HBM3, 80 GiB" in str(report_from_facts([node]))
    no_tool = {**node, "gpus": {**node["gpus"], "tool": "missing"}}
    assert any(p.startswith("nvidia-smi missing: the driver lists 8 GPU(s)") for p in _problems(no_tool))


def test_node_facts_on_real_mpi_engines(mpiexec: str, tmp_path: Path) -> None:
    """Applied on ipyparallel engines launched by mpiexec: each sees the MPI it runs on, in process."""
    import ipyparallel as ipp

    cluster = ipp.Cluster(engines="mpi", n=2, profile_dir=str(tmp_path / "profile"), controller_ip="127.0.0.1",
                          log_level=40)
    cluster.config.MPILauncher.mpi_cmd = [mpiexec]
    try:
        client = cluster.start_and_connect_sync()
        client.wait_for_engines(2, timeout=120)
        on_engines = client[:].apply_sync(node_facts)
        receiver = client[0].apply_sync(start_receiver, "127.0.0.1")  # the link, engine 1 → engine 0
        link = client[1].apply_sync(send, "127.0.0.1", receiver["port"], receiver["token"], 0.5)
        client.close()
    finally:
        cluster.stop_cluster_sync()
    info = find_mpi()
    for engine in on_engines:
        assert engine["mpi"]["mpi4py_in_process"] == {"implementation": info.implementation,
                                                      "version": info.version}
        assert not [f for f in diagnose(engine) if f.severity == "error"]
    assert report_from_facts(on_engines[:1]).nodes[0].name == socket.gethostname()
    assert link["to"] == "127.0.0.1" and link["bytes"] > 0 and link["gbit_per_s"] > 0


def test_a_node_that_cannot_be_read_is_an_error_not_a_crash(facts: dict[str, Any]) -> None:
    report = diagnose_nodes({"ghost": ["/nonexistent/python3"]})
    assert not report.ok and report.nodes[0].facts["node"] == "ghost"
    [(name, finding)] = report.findings
    assert name == "ghost" and finding.severity == "error" and "/nonexistent/python3" in finding.problem
    assert "unreadable" in str(report) and "n/a (one node)" in str(report)
    both = report_from_facts([facts, report.nodes[0].facts])
    with pytest.raises(HugePagesError, match=r"ghost \(could not be read: "):
        require_hugepages(both, 1)


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
    done = subprocess.run([sys.executable, "-m", "taco_notebook", "doctor"], capture_output=True, text=True,
                          env=_env(), timeout=180)
    assert done.returncode in (0, 1), done.stderr
    assert socket.gethostname() in done.stdout and "huge pages 1 GB" in done.stdout and "fix: " in done.stdout
    as_json = subprocess.run([sys.executable, "-m", "taco_notebook", "doctor", "--json", "--require-hugepages",
                              "100000", "--page-size", "1G"], capture_output=True, text=True, env=_env(),
                             timeout=180)
    assert as_json.returncode == 3, as_json.stderr
    assert json.loads(as_json.stdout)["nodes"][0]["facts"]["hostname"] == socket.gethostname()
    assert f"lack 100000 free huge pages 1 GB: {socket.gethostname()}" in as_json.stderr
    bad = subprocess.run([sys.executable, "-m", "taco_notebook", "doctor", "--require-hugepages", "0"],
                         capture_output=True, text=True, env=_env(), timeout=180)
    assert bad.returncode == 2 and "--require-hugepages must be a positive integer, got 0" in bad.stderr


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Python with the project's packages (torch, mpi4py, ...) but no mpiexec beside it."""
    bare = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    site = next((bare / "lib").glob("python*/site-packages"))
    import torch

    (site / "project.pth").write_text(str(Path(torch.__file__).parent.parent) + "\n")
    return str(bare / "bin" / "python")


def _facts_from(python: str, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run([python, "-m", "taco_notebook.cluster.doctor.nodefacts"], capture_output=True, text=True,
                          env=env, timeout=180)
    assert done.returncode == 0, done.stderr
    facts: dict[str, Any] = json.loads(done.stdout)
    return facts


def test_missing_nvidia_smi_and_mpiexec_are_reported_not_raised(bare_python: str) -> None:
    """No mpiexec beside the Python, and a PATH with neither mpiexec nor nvidia-smi."""
    path = os.pathsep.join(d for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
                           if not any(os.access(os.path.join(d, t), os.X_OK) for t in ("mpiexec", "nvidia-smi")))
    facts = _facts_from(bare_python, _env(PATH=path))
    assert facts["mpi"]["mpiexec"] == "missing" and facts["gpus"]["tool"] == "missing"
    findings = {f.problem: f for f in diagnose(facts)}
    assert findings["no mpiexec beside this Python or on PATH"].severity == "error"
    assert "pip install mpich mpi4py" in findings["no mpiexec beside this Python or on PATH"].remedy
    assert any("nvidia-smi" in p for p in findings)
    assert "mpiexec missing" in str(report_from_facts([facts]))


# ---- bandwidth between nodes -----------------------------------------------------------------------------------
def _netns_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return f"emulated nodes need root (running as uid {os.geteuid()})"
    missing = [tool for tool in ("ip", "tc", "unshare", "hostname") if shutil.which(tool) is None]
    return f"emulated nodes need {', '.join(missing)} on PATH" if missing else None


NETNS_SKIP = _netns_skip_reason()


def test_receiver_listens_only_on_the_address_given() -> None:
    ports: list[int] = []
    ready = threading.Event()
    results: list[dict[str, Any]] = []

    def serve() -> None:
        results.append(receive("127.0.0.1", "t0ken", ready=lambda port: (ports.append(port), ready.set())))

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        assert ready.wait(10)
        listening = [c.laddr for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == ports[0]]
        assert [addr.ip for addr in listening] == ["127.0.0.1"]
    finally:
        sent = send("127.0.0.1", ports[0], "t0ken", seconds=0.2)
        thread.join(10)
    assert results == [sent] and sent["bytes"] > 0 and sent["from"] == "127.0.0.1"


def test_loopback_is_much_faster_than_a_1gbit_link() -> None:
    result = measure_link([sys.executable], [sys.executable], "127.0.0.1")
    assert 0.9 <= result["seconds"] <= 1.2
    assert result["gbit_per_s"] > 3, result


@pytest.mark.services
@pytest.mark.skipif(NETNS_SKIP is not None, reason=NETNS_SKIP or "")
def test_two_emulated_nodes_report_their_own_nics_and_a_1gbit_link() -> None:
    from taco_notebook.emulate.nodes import EmulatedNodes

    with EmulatedNodes(2, rate="1gbit") as cluster:
        runners = {h: ["ip", "netns", "exec", cluster.namespace_of(h), sys.executable] for h in cluster.nodes}
        report = diagnose_nodes(runners, {h: cluster.address_of(h) for h in cluster.nodes})
    assert isinstance(report, DoctorReport) and [n.name for n in report.nodes] == ["n0", "n1"]
    for node in report.nodes:  # each node sees its own namespace: the shaped veth, not the machine's NICs
        assert [(n["name"], n["up"], n["hardware"]) for n in node.facts["nics"]] == [("taco0", True, False)]
    [link] = report.links
    assert (link["from"], link["to"]) == ("n0", "n1")
    assert 0.85 <= link["gbit_per_s"] <= 1.0, link  # TCP over a 1 Gbit/s htb: ~94 % of nominal
    text = str(report)
    assert f"→ n1: {link['gbit_per_s']:.2f} Gbit/s" in text and "taco0" in text
    assert "vertical-align:top;padding:2px 8px'>n0" in report._repr_html_()


def _ssh_skip_reason() -> str | None:
    if NETNS_SKIP is not None:
        return NETNS_SKIP
    from taco_notebook.emulate.sshd import find_sshd

    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None or find_sshd() is None:
        return "needs OpenSSH client and server (apt-get install -y openssh-server)"
    return None


SSH_SKIP = _ssh_skip_reason()


@pytest.mark.services
@pytest.mark.skipif(SSH_SKIP is not None, reason=SSH_SKIP or "")
def test_doctor_over_real_ssh_to_emulated_hosts() -> None:
    """What ``%taco_doctor --hosts n0,n1`` does: facts and the link through ``ssh HOST python``, each node its own."""
    from taco_notebook.emulate.hosts import EmulatedHosts

    home = Path(tempfile.mkdtemp(prefix="taco-doctor-ssh-", dir=Path.home()))  # sshd refuses keys under /tmp
    try:
        with EmulatedHosts.up(2, 1, "1gbit", state_dir=home / "state") as hosts:
            runners = {h: ["ssh", "-F", str(hosts.ssh_config), h, "env", f"PYTHONPATH={REPO}", sys.executable]
                       for h in hosts.nodes.nodes}
            report = diagnose_nodes(runners, {h: hosts.nodes.address_of(h) for h in hosts.nodes.nodes})
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert [(n.name, n.facts.get("hostname")) for n in report.nodes] == [("n0", "n0"), ("n1", "n1")], report
    [link] = report.links
    assert 0.85 <= link["gbit_per_s"] <= 1.0, link
    assert not report.cluster_findings and "→ n1: " in str(report)
