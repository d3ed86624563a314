"""``python -m taco_notebook emulate up|status|down``: emulated nodes with a real sshd each, through the real CLI.

Everything runs for real: network namespaces, htb shaping, Debian's OpenSSH server and client, mpich's hydra
over ssh. Tests that make nodes need root, iproute2 and openssh-server (``apt-get install -y openssh-server``)
and skip with the reason otherwise. Every test runs ``down`` afterwards, also on failure, and the state lives
in a private directory under the home directory (sshd refuses keys below a world-writable ``/tmp``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from taco_notebook.cli.emulate import parse_spec
from taco_notebook.emulate.hosts import EmulatedHosts
from taco_notebook.emulate.saved import load_nodes, nodes_from_state
from taco_notebook.emulate.sshd import PRIVSEP_DIR, SshdProcess, find_sshd
from taco_notebook.private import write_private_json

from ..emulate.test_emulated import MPIEXEC, NETNS_SKIP
from ..support.mpirun import run_in_session

REPO = Path(__file__).resolve().parents[2]


def _install_openssh() -> None:
    """As root with namespaces at hand, apt-get Debian's openssh-server when sshd or the client is missing (as
    tests/support/slurm.py does for Slurm): CI then runs these tests instead of skipping them. Its service is not
    started here; a failed install leaves the skip below to say what is missing."""
    if NETNS_SKIP is not None or (find_sshd() and shutil.which("ssh") and shutil.which("ssh-keygen")):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run(["apt-get", "install", "-y", "-q", "openssh-server", "openssh-client"], env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.SubprocessError):
        pass


_install_openssh()
SSH_SKIP = NETNS_SKIP or next((f"needs `{tool}` (apt-get install -y openssh-server)" for tool in ("ssh", "ssh-keygen")
                               if shutil.which(tool) is None), None)
if SSH_SKIP is None and find_sshd() is None:
    SSH_SKIP = "needs sshd (apt-get install -y openssh-server)"
needs_sshd = pytest.mark.skipif(SSH_SKIP is not None, reason=SSH_SKIP or "")
needs_hydra_ssh = pytest.mark.skipif(SSH_SKIP is not None or MPIEXEC is None,
                                     reason=SSH_SKIP or "needs mpich's hydra mpiexec")
Cli = Callable[..., subprocess.CompletedProcess[str]]


def _cli(state_dir: Path, *args: str, env: dict[str, str] | None = None,
         prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    argv = [*prefix, sys.executable, "-m", "taco_notebook", "emulate", *args, "--state-dir", str(state_dir)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A state directory path (not yet made) below a private dir in $HOME; ``down`` and removal afterwards."""
    home_dir = Path(tempfile.mkdtemp(prefix="taco-emulate-test-", dir=Path.home()))
    state = home_dir / "state"
    try:
        yield state
    finally:
        if state.exists():
            _cli(state, "down")
        shutil.rmtree(home_dir, ignore_errors=True)


@pytest.fixture
def cli(state_dir: Path) -> Cli:
    return lambda *args, **kwargs: _cli(state_dir, *args, **kwargs)


def _status(cli: Cli) -> dict:
    result = cli("status", "--json")
    return {"rc": result.returncode, **json.loads(result.stdout)}


def _ssh(config: str, host: str, command: str) -> str:
    result = subprocess.run(["ssh", "-F", config, host, command], capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result
    return result.stdout.strip()


def _traces(prefix: str, state_dir: Path) -> list[str]:
    """What of a set is still there: namespaces, links, processes running its files, its state dir."""
    found = [f"netns {n}" for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                  check=True).stdout.split() if n.startswith(prefix)]
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
    found += [f"link {line.split()[0]}" for line in links.splitlines() if prefix in line]
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if str(state_dir) in " ".join(proc.info["cmdline"] or []):
            found.append(f"process {proc.pid}: {proc.info['cmdline']}")
    if state_dir.exists() or Path("/etc/netns", f"{prefix}-n0").exists():
        found.append(f"files {state_dir}")
    return found


# ---- no root needed ----------------------------------------------------------------------------------------
def test_parse_spec() -> None:
    assert parse_spec("2x2") == (2, 2) and parse_spec("3X8") == (3, 8)


def test_a_state_file_cannot_name_what_is_not_the_sets(tmp_path: Path) -> None:
    """``down`` deletes what the state names: a link or namespace without the set's prefix is refused."""
    state = {"version": 1, "prefix": "taco-1a2b3", "num_nodes": 2, "rate_bits_per_s": None, "interface": "taco0",
             "subnet": "10.213.7.0/24", "workdir": str(tmp_path / "netns"),
             "made": [["link", "taco-1a2b3-br"], ["netns", "taco-1a2b3-n0"]]}
    nodes = nodes_from_state(state)
    assert (nodes.prefix, nodes.bridge, nodes.address_of("n1")) == ("taco-1a2b3", "taco-1a2b3-br", "10.213.7.2")
    for bad in ({"made": [["link", "eth0"]]}, {"made": [["route", "taco-1a2b3-x"]]}, {"prefix": "eth"},
                {"version": 9}, {"subnet": "nonsense"}):
        with pytest.raises(ValueError, match="not a state file of emulated nodes"):
            nodes_from_state({**state, **bad})
    path = tmp_path / "nodes.json"
    write_private_json(path, state)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_nodes(path).nodes == ["n0", "n1"]


@pytest.mark.parametrize(("args", "message"), [
    (["up", "0x2"], "NODES in NODESxSLOTS must be 1..253, got 0"),
    (["up", "2x0"], "SLOTS in NODESxSLOTS must be 1..1024, got 0"),
    (["up", "2x"], "NODESxSLOTS such as 2x2"),
    (["up", "abc"], "NODESxSLOTS such as 2x2"),
    (["up", "2x2", "--link", "fast"], "rate must look like '1gbit'"),
    (["up", "2x2", "--down-with", "0"], "--down-with 0: no such process"),
    (["up"], "NODESxSLOTS"),
    (["sideways"], "invalid choice"),
])
def test_bad_input_is_a_clear_error_and_makes_nothing(cli: Cli, state_dir: Path, args: list[str],
                                                      message: str) -> None:
    result = cli(*args)
    assert result.returncode == 2, result
    assert message in result.stderr, result.stderr
    assert not state_dir.exists()


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None, reason="needs setpriv to drop root")
def test_refuses_without_root() -> None:
    """As root, run the CLI as ``nobody`` (in a directory of its own); otherwise as this user."""
    home = Path(tempfile.mkdtemp(prefix="taco-emulate-nobody-"))
    drop: tuple[str, ...] = ()
    if os.geteuid() == 0:
        drop = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
        os.chown(home, 65534, 65534)
    state_dir = home / "state"
    try:
        up = _cli(state_dir, "up", "2x2", prefix=drop)
        assert up.returncode == 2, up
        assert "need root" in up.stderr and "run it as root" in up.stderr, up.stderr
        down = _cli(state_dir, "down", prefix=drop)  # nothing up: nothing to do, whoever asks
        assert down.returncode == 0 and "nothing to remove" in down.stdout, down
        assert not state_dir.exists()
    finally:
        shutil.rmtree(home, ignore_errors=True)


# ---- root -----------------------------------------------------------------------------------------------------
@needs_sshd
def test_missing_tools_are_named_with_their_package(cli: Cli, state_dir: Path) -> None:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no ip, tc, unshare, ssh-keygen here
    result = cli("up", "2x2", env=env)
    assert result.returncode == 2, result
    assert "ip, tc, unshare" in result.stderr and "apt-get install -y" in result.stderr, result.stderr
    assert "iproute2" in result.stderr and "openssh-client" in result.stderr, result.stderr
    assert not state_dir.exists()


@needs_sshd
def test_state_dir_below_a_world_writable_dir_is_refused(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o777)
    result = _cli(tmp_path / "state", "up", "1x1")
    assert result.returncode == 2 and "others may write" in result.stderr, result
    assert not (tmp_path / "state").exists()


@pytest.mark.services
@needs_sshd
@pytest.mark.timeout(120, method="signal")
def test_up_ssh_status_down_leaves_no_trace(cli: Cli, state_dir: Path) -> None:
    privsep_before = PRIVSEP_DIR.exists()
    up = cli("up", "2x2", "--link", "1gbit")
    assert up.returncode == 0, up
    assert PRIVSEP_DIR.is_dir()
    assert "hosts:   n0:2,n1:2" in up.stdout and "1 Gbit/s each way" in up.stdout, up.stdout
    status = _status(cli)
    assert status["rc"] == 0 and status["healthy"] and status["hosts"] == "n0:2,n1:2", status
    assert status["rate_bits_per_s"] == 10**9
    config, prefix = status["ssh_config"], status["nodes"][0]["namespace"].rsplit("-", 1)[0]
    own_netns = os.readlink("/proc/self/ns/net")
    for node in status["nodes"]:
        host, address = node["host"], node["address"]
        # the node's own hostname, network namespace and interface, over real ssh with no prompt
        assert _ssh(config, host, "hostname") == host
        assert _ssh(config, host, "readlink /proc/self/ns/net") != own_netns
        assert _ssh(config, host, "echo $GLOO_SOCKET_IFNAME") == "taco0"
        listening = subprocess.run(["ip", "netns", "exec", node["namespace"], "ss", "-ltnH"], capture_output=True,
                                   text=True, check=True).stdout.split("\n")
        assert [line.split()[3] for line in listening if line] == [f"{address}:22"], listening
    for path in [state_dir, *state_dir.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == 0o700 if path.is_dir() or path.name.endswith("launcher") or path.name == "ssh" else \
            mode == 0o600, f"{path} {oct(mode)}"
    # up again: refused, nothing changed
    again = cli("up", "2x2")
    assert again.returncode == 1 and "already up" in again.stderr, again
    assert _status(cli)["nodes"] == status["nodes"]
    # a dead sshd shows in status, with a nonzero exit
    os.kill(status["nodes"][1]["sshd_pid"], signal.SIGKILL)
    dead = _status(cli)
    assert dead["rc"] == 1 and not dead["healthy"] and not dead["nodes"][1]["sshd_alive"], dead
    assert dead["nodes"][0]["sshd_alive"]
    text = cli("status")
    assert text.returncode == 1 and "sshd dead" in text.stdout, text
    # down: nothing of it is left, and down again is fine
    down = cli("down")
    assert down.returncode == 0 and "removed 2 emulated nodes" in down.stdout, down
    assert _traces(prefix, state_dir) == []
    if not privsep_before and not any(p.info["name"] == "sshd" for p in psutil.process_iter(["name"])):
        assert not PRIVSEP_DIR.exists(), "down left sshd's /run/sshd that up made"
    assert cli("down").returncode == 0
    assert cli("status").returncode == 3


# ---- mpich's hydra over real ssh ---------------------------------------------------------------------------------
def _link_bytes(veth: str) -> int:
    stats = Path("/sys/class/net", veth, "statistics")
    return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())


@pytest.mark.mpi
@needs_hydra_ssh
@pytest.mark.timeout(120, method="signal")
def test_hydra_runs_ranks_on_the_nodes_over_real_ssh(cli: Cli, tmp_path: Path) -> None:
    assert cli("up", "2x2", "--link", "1gbit").returncode == 0
    status = _status(cli)
    prefix = status["nodes"][0]["namespace"].rsplit("-", 1)[0]
    veths = [f"{prefix}-h{i}" for i in range(2)]
    before = [_link_bytes(v) for v in veths]
    outdir = tmp_path / "out"
    outdir.mkdir()
    # hydra's ssh is the generated `ssh -F config "$@"`; the ranks' environment travels from mpiexec, which
    # must carry the node interface and no per-node identity (mpiexec_env drops the caller's)
    hosts = EmulatedHosts.load(Path(status["state_dir"]))
    assert hosts is not None and MPIEXEC is not None
    assert Path(status["launcher"]).read_text().endswith(f"-F '{status['ssh_config']}' \"$@\"\n")
    env = hosts.mpiexec_env({**os.environ, "GLOO_SOCKET_IFNAME": "lo", "TACO_NODE_NAME": "wrong"})
    argv = [MPIEXEC, *hosts.mpiexec_args(), "-n", "4", sys.executable, str(REPO / "tests/mpi/node_identity.py"),
            str(outdir)]
    assert argv[1:9] == ["-launcher", "ssh", "-launcher-exec", status["launcher"], "-localhost",
                         hosts.nodes.bridge_address, "-hosts", "n0:2,n1:2"]
    # on timeout this kills mpiexec and its ssh clients; the ranks, children of the nodes' sshd, end when their
    # proxies lose the connection, and the `state_dir` fixture's `down` kills whatever still runs in the namespaces
    done = run_in_session(argv, env=env, timeout=90)
    assert done.returncode == 0, f"mpiexec exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    ranks = {r["rank"]: r for r in (json.loads(f.read_text()) for f in outdir.glob("*.json"))}
    assert sorted(ranks) == [0, 1, 2, 3]
    assert [ranks[r]["hostname"] for r in range(4)] == ["n0", "n0", "n1", "n1"]
    assert [(ranks[r]["node"], ranks[r]["local_rank"]) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(ranks[r]["ssh"] and ranks[r]["ifname"] == "taco0" and ranks[r]["allreduce_ok"] for r in range(4))
    assert ranks[0]["netns"] == ranks[1]["netns"] != ranks[2]["netns"] == ranks[3]["netns"]
    assert os.readlink("/proc/self/ns/net") not in {ranks[0]["netns"], ranks[2]["netns"]}
    assert ranks[0]["uts"] != ranks[2]["uts"] and ranks[0]["num_nodes"] == 2
    # the 4 MiB allreduce crossed each node's shaped link (its veth), at least 1x the payload
    crossed = [_link_bytes(v) - b for v, b in zip(veths, before, strict=True)]
    print(f"bytes through each node's link during the job: {crossed}")
    assert all(c >= 4 << 20 for c in crossed), crossed


@pytest.mark.services
@needs_sshd
@pytest.mark.timeout(120, method="signal")
def test_failed_up_removes_what_it_made(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """n0's sshd really starts; starting n1's fails: n0's sshd, the namespaces, links and files all go."""
    from taco_notebook.emulate import hosts as emulated_hosts

    real_start = emulated_hosts.start_sshd
    started: list[tuple[str, SshdProcess]] = []

    def fail_on_second(sshd: str, namespace: str, *args: Any, **kwargs: Any) -> SshdProcess:
        if started:
            raise RuntimeError("injected sshd failure")
        started.append((namespace, real_start(sshd, namespace, *args, **kwargs)))
        return started[-1][1]

    monkeypatch.setattr(emulated_hosts, "start_sshd", fail_on_second)
    with pytest.raises(RuntimeError, match="injected"):
        EmulatedHosts.up(2, 1, "1gbit", state_dir)
    assert len(started) == 1
    namespace, sshd = started[0]
    assert not psutil.pid_exists(sshd.pid) or psutil.Process(sshd.pid).status() == psutil.STATUS_ZOMBIE
    assert _traces(namespace.rsplit("-", 1)[0], state_dir) == []


def _wait_gone(pid: int, timeout: float = 60.0) -> bool:
    """Wait for a process that is not our child (``up``'s watcher, reparented once ``up`` exits) to end."""
    try:
        psutil.Process(pid).wait(timeout=timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


@pytest.mark.services
@needs_sshd
@pytest.mark.timeout(180, method="signal")
def test_nodes_go_down_when_the_named_process_is_killed(cli: Cli, state_dir: Path) -> None:
    """``up --down-with PID``: a SIGKILL of PID (as a notebook client kills its kernel) takes the nodes down; a
    ``down`` before that leaves the watcher nothing to do, and it ends too."""
    owners = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
    try:
        up = cli("up", "1x1", "--link", "none", "--down-with", str(owners[0].pid))
        assert up.returncode == 0, up
        watcher = int(re.search(r"watcher pid (\d+)", up.stdout)[1])
        prefix = _status(cli)["nodes"][0]["namespace"].rsplit("-", 1)[0]
        assert not _wait_gone(watcher, timeout=1.5) and _status(cli)["healthy"]  # up while its owner runs
        owners[0].kill()
        owners[0].wait()
        assert _wait_gone(watcher), "the watcher did not end after its process was killed"
        assert _traces(prefix, state_dir) == []
        # down first: the watcher ends by itself, its process still running
        up = cli("up", "1x1", "--link", "none", "--down-with", str(owners[1].pid))
        assert up.returncode == 0, up
        watcher = int(re.search(r"watcher pid (\d+)", up.stdout)[1])
        assert cli("down").returncode == 0
        assert _wait_gone(watcher, timeout=15) and owners[1].poll() is None
    finally:
        for owner in owners:
            owner.kill()
            owner.wait()
