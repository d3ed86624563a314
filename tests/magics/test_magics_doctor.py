"""``%taco_doctor``, ``%taco_cluster manifest --k8s`` and ``--require-hugepages`` in a real IPython shell, against
real MPI-launched engines and this machine's /proc and /sys."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import yaml
from IPython.core.error import UsageError

from taco_notebook.cluster.session import clusters

from ..support.hugepages import NEEDS_ROOT, NR_HUGEPAGES, POOL_2M, hugepages_restored, reserve_hugepages

pytestmark = pytest.mark.cluster

MANIFEST = "manifest --k8s -np 16 --gpus-per-node 8 --controller-address 10.0.0.5 --controller-port 45123"


def meminfo() -> dict[str, int]:
    with open("/proc/meminfo") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)}


def sys_int(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def check_facts_against_proc(facts: dict) -> None:
    """The doctor's facts of this machine, read again here from /proc and /sys."""
    assert facts["hostname"] == socket.gethostname()
    pools = facts["hugepages"]["pools"]
    assert pools["2048"]["total"] == sys_int(f"{POOL_2M}/nr_hugepages")
    assert pools["2048"]["free"] == sys_int(f"{POOL_2M}/free_hugepages")
    assert facts["hugepages"]["default_kb"] == meminfo()["Hugepagesize"]
    assert facts["cpu"]["cpus"] == os.cpu_count()
    assert facts["cpu"]["usable_cpus"] == len(os.sched_getaffinity(0))
    assert {n["name"] for n in facts["nics"]} == set(os.listdir("/sys/class/net")) - {"lo"}


@contextmanager
def stopped_after(name: str) -> Iterator[None]:
    try:
        yield
    finally:
        cluster = clusters.pop(name, None)
        if cluster is not None:
            cluster.stop()


# ---------------------------------------------------------------- %taco_doctor

def test_doctor_without_a_cluster_reports_this_machine(ip, capsys):
    running = clusters.get("default")
    ip.run_line_magic("taco_doctor", "")
    out = capsys.readouterr().out
    assert "huge pages 2 MB" in out and "link (1 s TCP)" in out
    assert socket.gethostname() in out
    report = ip.run_line_magic("taco_doctor", "--json")
    assert capsys.readouterr().out == ""  # --json returns the dict instead of showing it
    assert set(report) == {"nodes", "links", "cluster_findings"}
    if running is None or not running.running:  # no cluster: this machine alone, no link to measure
        assert len(report["nodes"]) == 1 and report["links"] == []
    check_facts_against_proc(report["nodes"][0]["facts"])
    if meminfo()["HugePages_Free"] == 0:  # every problem is shown with its remedy, not raised
        assert any("vm.nr_hugepages" in f["remedy"] for f in report["nodes"][0]["findings"])


def test_doctor_reads_every_node_through_the_engines_and_measures_the_link(ip, capsys):
    with stopped_after("doctor2"):
        ip.run_cell_magic("taco_run", "-np 2 --intra-size 1 --cluster doctor2 --no-dashboard --quiet", "pass")
        capsys.readouterr()
        host = socket.gethostname()
        ip.run_line_magic("taco_doctor", "--cluster doctor2")
        out = capsys.readouterr().out
        assert f"{host}/node0" in out and f"{host}/node1" in out
        report = ip.run_line_magic("taco_doctor", "--cluster doctor2 --json")
        names = [n["facts"]["node"] for n in report["nodes"]]
        assert names == [f"{host}/node0", f"{host}/node1"]  # one engine per (emulated) node
        for node in report["nodes"]:
            check_facts_against_proc(node["facts"])
        [link] = report["links"]
        assert (link["from"], link["to"]) == (names[0], names[1])
        assert link.get("error") is None and link["gbit_per_s"] > 0 and link["bytes"] > 0
        assert clusters["doctor2"].running  # the doctor leaves the cluster as it was


def test_doctor_errors_are_usage_errors(ip):
    with pytest.raises(UsageError, match="no cluster named 'nosuch' is running"):
        ip.run_line_magic("taco_doctor", "--cluster nosuch")
    with pytest.raises(UsageError, match="--require-hugepages must be a positive integer"):
        ip.run_line_magic("taco_doctor", "--require-hugepages 0")


def test_doctor_require_hugepages_names_the_nodes_short_of_them(ip, capsys):
    free = meminfo()["HugePages_Free"]
    with pytest.raises(UsageError) as caught:
        ip.run_line_magic("taco_doctor", f"--require-hugepages {free + 1}")
    assert socket.gethostname() in str(caught.value) and "vm.nr_hugepages" in str(caught.value)
    assert "huge pages 2 MB" in capsys.readouterr().out  # the report is shown before the refusal


# ---------------------------------------------------------------- %taco_cluster manifest

def test_manifest_prints_yaml_with_the_asked_workers_and_slots(ip, capsys):
    ip.run_line_magic("taco_cluster", f"{MANIFEST} --hugepages 1Gi:50 --image reg.example/taco:1 --name run1")
    job = yaml.safe_load(capsys.readouterr().out)
    assert job["kind"] == "MPIJob" and job["metadata"]["name"] == "run1"
    assert job["spec"]["slotsPerWorker"] == 8
    worker = job["spec"]["mpiReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2
    container = worker["template"]["spec"]["containers"][0]
    assert container["image"] == "reg.example/taco:1"
    assert container["resources"]["limits"]["hugepages-1Gi"] == "50Gi"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_manifest_written_to_a_private_file(ip, capsys, tmp_path):
    path = tmp_path / "job.yaml"
    ip.run_line_magic("taco_cluster", f"{MANIFEST} -o {path}")
    assert str(path) in capsys.readouterr().out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert yaml.safe_load(path.read_text())["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 2


@pytest.mark.parametrize("line, message", [
    ("manifest -np 16", "needs the kind of manifest: --k8s"),
    ("manifest --k8s --controller-address a --controller-port 1", "needs -np N"),
    (f"{MANIFEST} --gpus-per-node 0", "--gpus-per-node: must be a positive number of GPUs"),
    (MANIFEST.replace("-np 16", "-np 12"), "-np: 12 ranks do not fill nodes of 8 GPUs"),
    (f"{MANIFEST} --image-pull-policy Sometimes", "--image-pull-policy: 'Sometimes' is not one of"),
    (f"{MANIFEST} --hugepages 3Gi:5", "--hugepages: expected SIZE:COUNT"),
    (f"{MANIFEST} --gpus-per-node eight", "--gpus-per-node must be an integer"),
    ("manifest --k8s -np 16 --controller-port 45123", "--controller-address: expected the host name"),
    (f"{MANIFEST} --name Bad_Name", "--name: 'Bad_Name' is not a DNS-1123 label"),
    (f"{MANIFEST} -o /nonexistent-dir/job.yaml", "the folder /nonexistent-dir does not exist"),
])
def test_bad_manifest_options_are_usage_errors(ip, line, message):
    with pytest.raises(UsageError) as caught:
        ip.run_line_magic("taco_cluster", line)
    assert message in str(caught.value)


# ---------------------------------------------------------------- --require-hugepages

def test_require_hugepages_bad_values_start_nothing(ip, monkeypatch):
    with pytest.raises(UsageError, match="--require-hugepages must be a positive integer"):
        ip.run_line_magic("taco_cluster", "start -n 2 --cluster hp --require-hugepages -3")
    monkeypatch.setenv("TACO_REQUIRE_HUGEPAGES", "lots")
    with pytest.raises(UsageError, match="TACO_REQUIRE_HUGEPAGES must be"):
        ip.run_cell_magic("taco_run", "-np 2 --cluster hp --no-dashboard", "pass")
    assert "hp" not in clusters


@pytest.mark.skipif(meminfo()["HugePages_Free"] > 0, reason="this machine has free huge pages reserved")
@pytest.mark.parametrize("how", ["cluster_start", "taco_run", "trait"])
def test_require_hugepages_without_pages_stops_the_cluster_and_names_the_node(ip, how):
    with stopped_after("hp"), pytest.raises(UsageError) as caught:
        if how == "cluster_start":
            ip.run_line_magic("taco_cluster", "start -n 2 --cluster hp --require-hugepages 1")
        elif how == "taco_run":
            ip.run_cell_magic("taco_run", "-np 2 --cluster hp --no-dashboard --require-hugepages 1", "pass")
        else:
            ip.run_line_magic("config", "TacoMagics.require_hugepages = 1")
            try:
                ip.run_cell_magic("taco_run", "-np 2 --cluster hp --no-dashboard", "pass")
            finally:
                ip.run_line_magic("config", "TacoMagics.require_hugepages = None")
    message = str(caught.value)
    assert "cluster 'hp' stopped" in message and socket.gethostname() in message
    assert "0 free of 0 2 MB pages" in message and "sysctl -w vm.nr_hugepages" in message
    assert "hp" not in clusters  # and conftest fails the test if any of its processes is left


@pytest.mark.skipif(os.geteuid() != 0, reason=NEEDS_ROOT)
def test_require_hugepages_passes_with_2mb_pages_reserved(ip, capsys):
    # 16 pages (32 MB) beyond what is reserved now, 2 required: other jobs on this machine (an MPICH job's
    # shared memory) may take a few of the free ones while the cluster starts
    with hugepages_restored() as before:
        reserve_hugepages(before + 16)
        if meminfo()["HugePages_Free"] < 4:
            pytest.skip(f"the kernel reserved only {meminfo()['HugePages_Free']} free 2 MB pages (memory too "
                        "fragmented, or taken by another job)")
        with stopped_after("hp"):
            ip.run_line_magic("taco_cluster", "start -n 2 --cluster hp --require-hugepages 2")
            assert clusters["hp"].running
            assert all(r.hugepages["total"] >= before + 4 for r in clusters["hp"].ranks)
            report = ip.run_line_magic("taco_doctor", "--cluster hp --json --require-hugepages 2")
            pool = report["nodes"][0]["facts"]["hugepages"]["pools"]["2048"]
            assert pool["total"] == sys_int(f"{POOL_2M}/nr_hugepages") and pool["free"] >= 2
    assert sys_int(str(NR_HUGEPAGES)) == before


# ---------------------------------------------------------------- in a notebook's kernel

def test_doctor_in_a_jupyter_kernel_displays_the_html_table():
    from jupyter_client.manager import start_new_kernel

    from .test_kernel import execute

    manager, client = start_new_kernel(kernel_name="python3")
    try:
        reply, messages = execute(client, "%load_ext taco_notebook\n%taco_doctor")
        assert reply["status"] == "ok"
        [shown] = [m["content"]["data"] for _, m in messages if m["msg_type"] == "display_data"]
        assert "<table" in shown["text/html"] and socket.gethostname() in shown["text/html"]
        assert "huge pages 2 MB" in shown["text/plain"]  # the text table beside it, for other front ends
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)
