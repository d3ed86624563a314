"""``--profile local|hosts``: the same ``%%taco_run`` cell on this machine and on emulated ssh hosts.

The hosts tests are real end to end: network namespaces on a shaped bridge with Debian's sshd in each
(:class:`~taco_notebook.emulate.hosts.EmulatedHosts`), mpich's hydra over ``ssh``, ipyparallel's
controller on the bridge address, and the cell run from a real IPython shell. They need root, iproute2 and
openssh-server and skip with the reason otherwise. The state lives under $HOME (sshd refuses keys below /tmp).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from IPython.core.error import UsageError

from taco_notebook.cluster.launch.profiles import (
    LOCAL,
    ProfileError,
    hosts_profile,
    parse_hosts,
    profile_for,
    read_hostfile,
    route_address,
)
from taco_notebook.cluster.session import TacoCluster, clusters
from taco_notebook.emulate.hosts import EmulatedHosts

from ...cli.test_emulate import SSH_SKIP
from ...conftest import assert_trait_refused, session_processes
from ...emulate.test_emulated import MPIEXEC
from ...support.slurm import job_processes_after

needs_hosts = pytest.mark.skipif(SSH_SKIP is not None or MPIEXEC is None,
                                 reason=SSH_SKIP or "needs mpich's hydra mpiexec")

CELL = """\
import socket
t = torch.full((3,), float(taco.rank() + 1))
taco.allreduce(t)
(taco.rank(), socket.gethostname(), t.tolist())
"""


def test_hosts_spec_and_hostfile(tmp_path: Path) -> None:
    assert parse_hosts("n0:2, n1:3") == (("n0", 2), ("n1", 3))
    assert parse_hosts("n0,n1:2") == (("n0", 1), ("n1", 2))
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# nodes\nn0:2\nn1 slots=2  # second\n\n")
    assert read_hostfile(hostfile) == (("n0", 2), ("n1", 2))
    for bad in ("", "n0:0", "n0:x", "n0:2,n0:2", "a b:2"):
        with pytest.raises(ProfileError, match="--hosts"):
            parse_hosts(bad)
    with pytest.raises(ProfileError, match="cannot be read"):
        read_hostfile(tmp_path / "missing")


def test_profiles_checked() -> None:
    assert profile_for(None) is LOCAL and profile_for("local") is LOCAL and LOCAL.mpiexec_args() == []
    with pytest.raises(ProfileError, match="not a profile: choose one of local, hosts, slurm"):
        profile_for("cloud")
    with pytest.raises(ProfileError, match="need --profile hosts"):
        profile_for("local", hosts="n0:2")
    with pytest.raises(ProfileError, match="one of them"):
        profile_for("hosts")
    with pytest.raises(ProfileError, match="never 0.0.0.0"):
        hosts_profile("localhost:2", controller_ip="0.0.0.0")
    profile = hosts_profile("localhost:2", controller_ip="127.0.0.1")
    assert profile.mpiexec_args() == ["-launcher", "ssh", "-localhost", "127.0.0.1", "-hosts", "localhost:2"]
    with pytest.raises(ProfileError, match="-np 3 does not fit the hosts' 2 slots"):
        profile.check_size(3)
    with pytest.raises(ProfileError, match="-np 3 does not fit"):
        TacoCluster("x", 3, profile=profile)
    assert route_address("127.0.0.1") == "127.0.0.1"


@pytest.mark.parametrize("line, message", [
    ("--profile cloud -np 2", "--profile must be one of local, hosts, slurm"),
    ("--profile hosts -np 2", "--hosts HOST:SLOTS"),
    ("--profile hosts --hosts n0:zero -np 2", "not HOST"),
    ("--profile hosts --hostfile /nonexistent/hosts -np 2", "cannot be read"),
    ("--hosts n0:1,n1:1 --controller-ip 127.0.0.1 -np 4", "unrecognized"),
])
def test_bad_input_is_a_usage_error_and_starts_nothing(ip, line: str, message: str) -> None:
    before = session_processes()
    with pytest.raises(UsageError, match=message):
        ip.run_cell_magic("taco_run", f"{line} --cluster badprofile", "1")
    assert "badprofile" not in clusters and session_processes() == before


def _unset_traits(ip) -> None:
    magics = ip.magics_manager.registry["TacoMagics"]
    magics.config.pop("TacoMagics", None)  # or the next %config would load these values again
    magics.profile = magics.hosts = magics.hostfile = magics.controller_ip = None


@pytest.mark.parametrize("line, message", [
    ('TacoMagics.profile = "cloud"', "TacoMagics.profile must be one of local, hosts, slurm, mpijob, got 'cloud'"),
    ('TacoMagics.hosts = "n0:x"', "TacoMagics.hosts: 'n0:x' is not HOST[:SLOTS]"),
    ('TacoMagics.controller_ip = "0.0.0.0"', "TacoMagics.controller_ip must be this machine's address"),
])
def test_a_bad_trait_is_refused_naming_it(ip, caplog, line: str, message: str) -> None:
    try:
        assert_trait_refused(ip, caplog, line, message, ("profile", "hosts", "controller_ip"))
    finally:
        _unset_traits(ip)


def test_np_larger_than_slots_is_a_usage_error(ip) -> None:
    ip.run_line_magic("config", "TacoMagics.controller_ip = '127.0.0.1'")
    try:
        with pytest.raises(UsageError, match="-np 4 does not fit the hosts' 2 slots"):
            ip.run_cell_magic("taco_run", "--profile hosts --hosts localhost:2 -np 4 --cluster badprofile", "1")
        with pytest.raises(UsageError, match="-n 3 does not fit|-np 3 does not fit"):
            ip.run_line_magic("taco_cluster", "start --profile hosts --hosts localhost:2 -n 3 --cluster badprofile")
    finally:
        _unset_traits(ip)
    assert "badprofile" not in clusters


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[EmulatedHosts]:
    """Two emulated nodes of 2 slots on a 1 Gbit/s bridge, their state under $HOME; removed afterwards."""
    home_dir = Path(tempfile.mkdtemp(prefix="taco-profiles-test-", dir=Path.home()))
    state = home_dir / "state"
    monkeypatch.setenv("TACO_EMULATE_DIR", str(state))
    try:
        with EmulatedHosts.up(2, 2, "1gbit", state) as hosts:
            yield hosts
    finally:
        shutil.rmtree(home_dir, ignore_errors=True)


def _link_bytes(veth: str) -> int:
    stats = Path("/sys/class/net", veth, "statistics")
    return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())


def _command(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline()[:4]) or str(pid)
    except psutil.Error:
        return str(pid)


def _left_on_nodes(hosts: EmulatedHosts, wait_s: float = 15.0) -> dict[str, list[str]]:
    """What still runs in each node's namespace besides its sshd (ranks reach there through ssh, so they are no
    children of this process and conftest's leak check would not see them)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = {}
        for host in hosts.nodes.nodes:
            pids = subprocess.run(["ip", "netns", "pids", hosts.nodes.namespace_of(host)], capture_output=True,
                                  text=True, timeout=30).stdout.split()
            others = [_command(int(p)) for p in pids if int(p) != hosts.sshd[host].pid and psutil.pid_exists(int(p))]
            if others:
                left[host] = others
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


@pytest.mark.services
@needs_hosts
@pytest.mark.timeout(300, method="signal")
def test_cell_runs_on_emulated_hosts_over_ssh(ip, emulated: EmulatedHosts, capsys) -> None:
    prefix = emulated.nodes.namespace_of("n0").rsplit("-", 1)[0]
    veths = [f"{prefix}-h{i}" for i in range(2)]
    try:
        began = time.monotonic()
        ip.run_line_magic("taco_cluster", "start --profile hosts --hosts n0:2,n1:2 -n 4 --cluster hosts")
        started = time.monotonic() - began
        cluster = clusters["hosts"]
        assert cluster.profile.controller_ip == emulated.nodes.bridge_address
        assert [r.host for r in cluster.ranks] == ["n0", "n0", "n1", "n1"]
        assert cluster.mpi is not None and cluster.mpi.launcher == "hydra"
        running = _left_on_nodes(emulated, wait_s=0)  # the ranks, seen in the namespaces: the check below sees
        assert sorted(running) == ["n0", "n1"] and all(len(p) >= 2 for p in running.values()), running
        # the profile as a settings file names it (c.TacoMagics.profile/hosts): the running cluster serves the cell
        ip.run_line_magic("config", 'TacoMagics.profile = "hosts"')
        ip.run_line_magic("config", 'TacoMagics.hosts = "n0:2,n1:2"')
        began = time.monotonic()
        ranks = ip.run_cell_magic("taco_run", "-np 4 --gather --cluster hosts --no-dashboard", CELL)
        first_cell = time.monotonic() - began
        assert clusters["hosts"] is cluster
        before = [_link_bytes(v) for v in veths]
        ip.run_cell_magic("taco_run", "--cluster hosts --profile hosts --hosts n0:2,n1:2 --no-dashboard",
                          "t = torch.ones(1 << 20); taco.allreduce(t); assert t[0].item() == 4")
        crossed = [_link_bytes(v) - b for v, b in zip(veths, before, strict=True)]
    finally:
        _unset_traits(ip)
        if "hosts" in clusters:
            ip.run_line_magic("taco_cluster", "stop --cluster hosts")
    left = _left_on_nodes(emulated)
    out = capsys.readouterr().out
    with capsys.disabled():
        print(f"\n2 emulated hosts x 2 ranks: start {started:.1f} s, first cell {first_cell:.2f} s; "
              f"bytes through each node's link in a 4 MiB allreduce: {crossed}")
    assert [(rank, host) for rank, host, _ in ranks] == [(0, "n0"), (1, "n0"), (2, "n1"), (3, "n1")]
    assert all(total == [10.0, 10.0, 10.0] for _, _, total in ranks), ranks
    assert "4 ranks on n0, n1" in out
    assert all(c >= 4 << 20 for c in crossed), crossed  # the allreduce crossed each node's shaped link
    assert left == {}, f"left running on the nodes after stop: {left}"


SLURM_CELL = """\
import os
t = torch.full((2,), float(taco.rank() + 1))
taco.allreduce(t)
(taco.rank(), os.environ["SLURM_JOB_ID"], int(os.environ["SLURM_PROCID"]), t.tolist())
"""


@pytest.mark.timeout(300, method="signal")
def test_slurm_profile_submits_runs_a_cell_and_stop_cancels(ip, slurm, capsys,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "self,sm")  # the test Slurm's one node is this machine; sbatch exports it
    ip.run_line_magic("config", "TacoMagics.controller_ip = '127.0.0.1'")
    job = ""
    try:
        began = time.monotonic()
        ip.run_line_magic("taco_cluster", "start --profile slurm -n 2 --cluster slurm")
        started = time.monotonic() - began
        cluster = clusters["slurm"]
        job = cluster._sets.launchers[0].job_id
        ranks = ip.run_cell_magic("taco_run", "--profile slurm -np 2 --gather --cluster slurm --no-dashboard",
                                  SLURM_CELL)
        assert clusters["slurm"] is cluster and cluster.state == "running"
    finally:
        _unset_traits(ip)
        if "slurm" in clusters:
            ip.run_line_magic("taco_cluster", "stop --cluster slurm")
    out = capsys.readouterr().out
    with capsys.disabled():
        print(f"\nslurm profile, 2 engines: start (sbatch to engines up) {started:.1f} s")
    assert f"job {job} submitted: 2 engine tasks" in out and f"job {job} RUNNING" in out
    assert ranks == [(0, job, 0, [3.0, 3.0]), (1, job, 1, [3.0, 3.0])]
    assert slurm.active_jobs() == ""
    assert job_processes_after(job) == []
