"""``%taco_doctor --hosts/--hostfile/--profile`` and ``python -m taco_notebook doctor --hosts``: nodes where no
cluster runs, read through a temporary cluster of one engine per node.

The emulated tests are real end to end: two network namespaces on a bridge shaped to 1 Gbit/s, Debian's sshd in
each, mpich's hydra over ssh, and the report read from a real IPython shell or the real command line. They need
root, iproute2 and openssh-server, and skip with the reason otherwise.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from taco_notebook.cluster.session import clusters
from taco_notebook.emulate.hosts import EmulatedHosts
from taco_notebook.errors import ClusterStartError
from taco_notebook.plan.output import RankOutput

from ..cluster.launch.test_profiles import _left_on_nodes, emulated, needs_hosts  # noqa: F401 - the fixture
from ..conftest import REPO
from ..support.slurm import slurm  # noqa: F401 - the fixture

pytestmark = pytest.mark.cluster
LINK_GBIT = 1.0  # the emulated fixture's --link rate


def _doctor_entries() -> list[str]:
    """Registry entries of temporary doctor clusters (this test session's registry, see conftest)."""
    return [name for name in os.listdir(os.environ["TACO_REGISTRY_DIR"]) if name.startswith("doctor-")]


def _nothing_left(hosts: EmulatedHosts) -> None:
    assert not [name for name in clusters if name.startswith("doctor-")], sorted(clusters)
    assert _doctor_entries() == []
    assert _left_on_nodes(hosts) == {}  # engines and hydra proxies on the nodes (conftest sees only this side)


@pytest.mark.parametrize("line, message", [
    ("--hosts n0:x", "'n0:x' is not HOST[:SLOTS]"),
    ("--hosts n0,n0", "host 'n0' is named twice"),
    ("--hostfile /nonexistent/hosts", "--hostfile '/nonexistent/hosts' cannot be read"),
    ("--profile nosuch", "--profile must be one of local, hosts, slurm, mpijob, got 'nosuch'"),
    ("--profile local --hosts n0", "--hosts/--hostfile need --profile hosts"),
    ("--profile hosts", "--profile hosts needs --hosts HOST:SLOTS"),
    ("--cluster default --hosts n0", "--cluster reads a running cluster's nodes"),
    ("--hosts nosuch-host.invalid:1", "host 'nosuch-host.invalid'"),
])
def test_bad_hosts_are_usage_errors_and_start_nothing(ip, line: str, message: str) -> None:
    before = set(clusters)
    began = time.monotonic()
    with pytest.raises(UsageError) as caught:
        ip.run_line_magic("taco_doctor", line)
    assert message in str(caught.value)
    assert time.monotonic() - began < 30  # refused before anything starts (conftest: no process left)
    assert set(clusters) == before and _doctor_entries() == []


@pytest.mark.timeout(300, method="signal")
def test_doctor_hosts_localhost_starts_a_temporary_engine_and_leaves_nothing(ip, capsys) -> None:
    # hydra starts a local host's ranks without ssh: the temporary cluster's whole path, without root
    report = ip.run_line_magic("taco_doctor", "--hosts localhost:4 --json")
    [node] = report["nodes"]
    assert node["facts"]["node"] == socket.gethostname() == node["facts"]["hostname"]
    assert report["links"] == []  # one node: nothing to measure
    assert not [name for name in clusters if name.startswith("doctor-")] and _doctor_entries() == []


class _InterruptWhenReading(RankOutput):
    """Ctrl-C, as the kernel receives it (SIGINT to this process), once the temporary cluster is up."""

    def notice(self, text: str) -> None:
        super().notice(text)
        if text.startswith("reading"):
            signal.raise_signal(signal.SIGINT)


@pytest.mark.timeout(300, method="signal")
def test_ctrl_c_while_reading_stops_the_temporary_cluster(capsys, sigint_as_in_a_kernel) -> None:
    from taco_notebook.cluster.launch.profiles import profile_for
    from taco_notebook.plan.doctor import examine_nodes

    with pytest.raises(KeyboardInterrupt):
        examine_nodes(profile_for("hosts", "localhost"), _InterruptWhenReading())
    assert "reading the node…" in capsys.readouterr().out
    assert not [name for name in clusters if name.startswith("doctor-")] and _doctor_entries() == []
    # and conftest fails the test if an engine, mpiexec or the controller is left


@needs_hosts
@pytest.mark.timeout(300, method="signal")
def test_doctor_hosts_reads_each_emulated_node_and_the_link(ip, emulated: EmulatedHosts,  # noqa: F811
                                                            capsys) -> None:
    began = time.monotonic()
    report = ip.run_line_magic("taco_doctor", "--hosts n0:1,n1:1 --json")
    took = time.monotonic() - began
    assert capsys.readouterr().out == ""  # --json: no progress lines either
    names = [node["facts"]["node"] for node in report["nodes"]]
    assert names == ["n0", "n1"]
    for node in report["nodes"]:  # each row is the node's own: its name and its namespace's NIC
        facts = node["facts"]
        assert "error" not in facts and facts["hostname"] == facts["node"]
        assert [nic["name"] for nic in facts["nics"]] == [emulated.nodes.interface]
    [link] = report["links"]
    assert (link["from"], link["to"], link.get("error")) == ("n0", "n1", None)
    assert link["address"] == emulated.nodes.address_of("n1")  # measured to n1's own address on the bridge
    assert LINK_GBIT * 0.25 < link["gbit_per_s"] < LINK_GBIT, link  # within the shaped link's rate
    _nothing_left(emulated)
    with capsys.disabled():
        print(f"\n%taco_doctor --hosts n0,n1 on 2 emulated nodes: {took:.1f} s, link {link['gbit_per_s']:.3f} "
              f"Gbit/s of {LINK_GBIT:g}")


@needs_hosts
@pytest.mark.timeout(300, method="signal")
def test_doctor_hostfile_shows_progress_and_require_hugepages_names_both_nodes(
        ip, emulated: EmulatedHosts, capsys, tmp_path: Path) -> None:  # noqa: F811
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the emulated nodes\nn0 slots=2\nn1:2\n")
    need = 1 << 20  # 2 TiB of 2 MB pages: more than any node here has, whatever other jobs reserve meanwhile
    with pytest.raises(UsageError) as caught:
        ip.run_line_magic("taco_doctor", f"--hostfile {hostfile} --require-hugepages {need}")
    out = capsys.readouterr().out
    assert "starting one engine on each of 2 nodes (n0, n1)…" in out
    assert "huge pages 2 MB" in out and "n0" in out and "n1" in out  # the table, shown before the refusal
    assert f"--require-hugepages {need}" in str(caught.value)
    assert "n0" in str(caught.value) and "n1" in str(caught.value)
    _nothing_left(emulated)


@needs_hosts
@pytest.mark.timeout(300, method="signal")
def test_doctor_unreachable_emulated_node_is_named_within_bounded_time(ip, emulated: EmulatedHosts,  # noqa: F811
                                                                       capsys) -> None:
    prefix = emulated.nodes.namespace_of("n0").rsplit("-", 1)[0]
    veth = f"{prefix}-h1"  # n1's link on the bridge side: its address stops answering
    subprocess.run(["ip", "link", "set", veth, "down"], check=True, timeout=30)
    began = time.monotonic()
    try:
        with pytest.raises(ClusterStartError) as caught:
            ip.run_line_magic("taco_doctor", "--hosts n0:1,n1:1")
        took = time.monotonic() - began
        with pytest.raises(ClusterStartError, match=r"^cannot reach n1 over ssh \(host n1: .*nothing was started$"):
            ip.run_cell_magic("taco_run", "--profile hosts --hosts n0:1,n1:1 -np 2 --cluster unreachable", "pass")
        assert "unreachable" not in clusters  # %%taco_run asks the hosts first too (start_cluster)
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True, timeout=30)
    message = str(caught.value)
    assert message.startswith("the nodes could not be examined: cannot reach n1 over ssh (host n1: "), message
    assert "n0" not in message and message.endswith("nothing was started")  # the node that answers is not blamed
    assert took < 90, f"took {took:.0f} s"
    with capsys.disabled():
        print(f"\n%taco_doctor --hosts n0,n1 with n1's link down: refused in {took:.1f} s: {message}")
    _nothing_left(emulated)


@needs_hosts
@pytest.mark.timeout(300, method="signal")
def test_cli_hosts_prints_a_table_of_both_nodes(emulated: EmulatedHosts) -> None:  # noqa: F811
    run = subprocess.run([sys.executable, "-m", "taco_notebook", "doctor", "--hosts", "n0:1,n1:1"], cwd=REPO,
                         capture_output=True, text=True, timeout=240)  # TACO_EMULATE_DIR: the fixture's
    assert run.returncode in (0, 1), run.stderr  # 1: a finding of severity error (say, no huge pages)
    assert "starting one engine on each of 2 nodes (n0, n1)…" in run.stderr
    rows = [line.split("|")[0].strip() for line in run.stdout.splitlines() if "|" in line]
    assert [name for name in rows if name and name != "node" and not name.startswith("-")] == ["n0", "n1"], \
        run.stdout
    assert "→ n1:" in run.stdout and "Gbit/s" in run.stdout
    _nothing_left(emulated)


def test_cli_bad_hosts_exit_2_and_an_unresolvable_host_is_named() -> None:
    run = subprocess.run([sys.executable, "-m", "taco_notebook", "doctor", "--hosts", "n0:x"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "'n0:x' is not HOST[:SLOTS]" in run.stderr
    run = subprocess.run([sys.executable, "-m", "taco_notebook", "doctor", "--hosts", "nosuch-host.invalid"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "host 'nosuch-host.invalid'" in run.stderr


@pytest.mark.timeout(300, method="signal")
def test_doctor_profile_slurm_reads_the_job_node_and_cancels_the_job(ip, slurm, capsys,  # noqa: F811
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "self,sm")  # the test Slurm's one node is this machine; sbatch exports it
    ip.run_line_magic("config", "TacoMagics.controller_ip = '127.0.0.1'")
    try:
        ip.run_line_magic("taco_doctor", "--profile slurm")
    finally:
        ip.run_line_magic("config", "TacoMagics.controller_ip = None")
    out = capsys.readouterr().out
    assert "starting one engine on each of 1 node…" in out and " submitted: 1 engine task" in out
    rows = [line.split("|")[0].strip() for line in out.splitlines() if "|" in line]
    assert socket.gethostname() in rows  # the job's node (this machine: the test Slurm's one node)
    assert slurm.run("squeue", "-h", "-o", "%i %T").stdout.strip() == ""  # the job was cancelled
    assert not [name for name in clusters if name.startswith("doctor-")] and _doctor_entries() == []
