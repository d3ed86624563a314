"""``--profile local|hosts``: the same ``%%taco_run`` cell on this machine and on emulated ssh hosts.

The hosts tests are real end to end: network namespaces on a shaped bridge with Debian's sshd in each
(:class:`~taco_notebook.cluster.emulated_hosts.EmulatedHosts`), mpich's hydra over ``ssh``, ipyparallel's
controller on the bridge address, and the cell run from a real IPython shell. They need root, iproute2 and
openssh-server and skip with the reason otherwise. The state lives under $HOME (sshd refuses keys below /tmp).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from taco_notebook.cluster.emulated_hosts import EmulatedHosts
from taco_notebook.cluster.profiles import (
    LOCAL,
    ProfileError,
    hosts_profile,
    parse_hosts,
    profile_for,
    read_hostfile,
    route_address,
)
from taco_notebook.cluster.session import TacoCluster, clusters

from ..conftest import session_processes
from .test_emulate_cli import SSH_SKIP
from .test_emulated import MPIEXEC

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
    with pytest.raises(ProfileError, match="not a profile: choose one of local, hosts"):
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
    ("--profile cloud -np 2", "--profile must be one of local, hosts"),
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


def test_np_larger_than_slots_is_a_usage_error(ip) -> None:
    ip.run_line_magic("config", "TacoMagics.controller_ip = '127.0.0.1'")
    try:
        with pytest.raises(UsageError, match="-np 4 does not fit the hosts' 2 slots"):
            ip.run_cell_magic("taco_run", "--profile hosts --hosts localhost:2 -np 4 --cluster badprofile", "1")
        with pytest.raises(UsageError, match="-n 3 does not fit|-np 3 does not fit"):
            ip.run_line_magic("taco_cluster", "start --profile hosts --hosts localhost:2 -n 3 --cluster badprofile")
    finally:
        ip.run_line_magic("config", "TacoMagics.controller_ip = None")
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


@needs_hosts
@pytest.mark.timeout(300, method="signal")
def test_cell_runs_on_emulated_hosts_over_ssh(ip, emulated: EmulatedHosts, capsys) -> None:
    began = time.monotonic()
    try:
        ranks = ip.run_cell_magic("taco_run", "--profile hosts --hosts n0:2,n1:2 -np 4 --gather --cluster hosts "
                                  "--no-dashboard", CELL)
        elapsed = time.monotonic() - began
        cluster = clusters["hosts"]
        assert cluster.profile.controller_ip == emulated.nodes.bridge_address
        assert [r.host for r in cluster.ranks] == ["n0", "n0", "n1", "n1"]
        assert cluster.mpi is not None and cluster.mpi.launcher == "hydra"
    finally:
        if "hosts" in clusters:
            ip.run_line_magic("taco_cluster", "stop --cluster hosts")
    print(f"start + first cell on 2 emulated hosts: {elapsed:.1f} s")
    assert [(rank, host) for rank, host, _ in ranks] == [(0, "n0"), (1, "n0"), (2, "n1"), (3, "n1")]
    assert all(total == [10.0, 10.0, 10.0] for _, _, total in ranks), ranks
    assert "4 ranks on n0, n1" in capsys.readouterr().out
