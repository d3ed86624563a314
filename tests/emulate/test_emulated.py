"""Emulated multi-node cluster: namespaces come and go, MPI ranks land on their nodes, the link limit is real.

Tests that build namespaces need root and a working ``ip netns``; those that launch ranks also need mpich's
hydra ``mpiexec``. Each skips with the reason when that is missing. Fixtures always stop what they started;
the timeouts use the "signal" method (not the project's "thread") so a timed-out test still tears down.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from taco_notebook.emulate.netns_launch import build_command, parse_ssh_args
from taco_notebook.emulate.nodes import EmulatedNodes, parse_rate

from ..support.mpirun import run_in_session

MIB16_FLOATS = 4 << 20  # 16 MiB of float32


def _netns_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return f"emulated nodes need root (running as uid {os.geteuid()})"
    for tool in ("ip", "tc", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"emulated nodes need `{tool}` on PATH"
    result = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if result.returncode != 0:
        return f"`ip netns` does not work here: {result.stderr.strip()}"
    return None


def _hydra_mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    path = str(beside) if beside.exists() else shutil.which("mpiexec")
    if path is None:
        return None
    version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
    return path if "hydra" in (version.stdout + version.stderr).lower() else None


NETNS_SKIP = _netns_skip_reason()
needs_netns = pytest.mark.skipif(NETNS_SKIP is not None, reason=NETNS_SKIP or "")
MPIEXEC = _hydra_mpiexec() if NETNS_SKIP is None else None
needs_hydra = pytest.mark.skipif(MPIEXEC is None, reason="needs root, `ip netns` and mpich's hydra mpiexec")


@pytest.fixture
def emulated() -> Iterator[Callable[..., EmulatedNodes]]:
    """Factory of started clusters; every one is stopped afterwards, whatever the test did."""
    made: list[EmulatedNodes] = []

    def make(*args: Any, **kwargs: Any) -> EmulatedNodes:
        nodes = EmulatedNodes(*args, **kwargs)
        made.append(nodes)
        return nodes.start()

    yield make
    for nodes in made:
        nodes.stop()


def _run_ranks(cluster: EmulatedNodes, ranks_per_node: int, script: Path,
               env: dict[str, str] | None = None, timeout: float = 90) -> Path:
    """Run ``script OUTDIR`` on every rank of ``cluster``; return OUTDIR, where ranks write their results.

    Files, not stdout: hydra interleaves the ranks' output. On timeout mpiexec and every process it started
    (the launcher wrappers and the ranks inside the namespaces included) are killed (tests/support/mpirun.py).
    """
    outdir = Path(tempfile.mkdtemp(prefix=f"{script.stem}-", dir=script.parent))
    assert MPIEXEC is not None
    argv = [MPIEXEC, *cluster.mpiexec_args(ranks_per_node), "-n", str(ranks_per_node * len(cluster.nodes)),
            sys.executable, str(script), str(outdir)]
    done = run_in_session(argv, env=env or cluster.mpiexec_env(), timeout=timeout)
    assert done.returncode == 0, f"mpiexec exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return outdir


def _ip_lines(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


# ---- no root needed ----------------------------------------------------------------------------------------
def test_parse_rate() -> None:
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("100mbit") == 10**8
    assert parse_rate("125mbps") == 10**9
    assert parse_rate(5000) == 5000
    with pytest.raises(ValueError, match="1gbit"):
        parse_rate("fast")


def test_parse_ssh_args_as_hydra_calls_it() -> None:
    hydra = ["-x", "n1", '"/venv/bin/hydra_pmi_proxy"', "--control-port", "10.213.7.254:4000",
             "--proxy-id", "1"]
    expected = '"/venv/bin/hydra_pmi_proxy" --control-port 10.213.7.254:4000 --proxy-id 1'
    assert parse_ssh_args(hydra) == ("n1", expected)
    assert parse_ssh_args(["-p", "22", "-o", "BatchMode=yes", "user@n0", "true"]) == ("n0", "true")
    with pytest.raises(ValueError, match="no command"):
        parse_ssh_args(["-x", "n0"])


def test_build_command_gives_the_node_its_identity() -> None:
    mapping = {"interface": "taco0", "hosts": {"n0": "ns-a", "n1": "ns-b"}, "env": {"UCX_TLS": "self,tcp"}}
    argv, env = build_command("n1", "echo hi", mapping)
    assert argv[:6] == ["ip", "netns", "exec", "ns-b", "unshare", "--uts"]
    assert argv[-2:] == ["n1", "echo hi"]
    assert (env["TACO_NODE_NAME"], env["GLOO_SOCKET_IFNAME"], env["UCX_TLS"]) == ("n1", "taco0", "self,tcp")
    with pytest.raises(ValueError, match="unknown emulated host 'n7'"):
        build_command("n7", "true", mapping)


def test_start_refuses_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="root"):
        EmulatedNodes(2).start()


# ---- namespaces ------------------------------------------------------------------------------------------
@pytest.mark.services
@needs_netns
@pytest.mark.timeout(120, method="signal")
def test_namespaces_bridge_and_veths_exist_only_inside_the_context() -> None:
    with EmulatedNodes(2, rate="1gbit") as cluster:
        namespaces = [cluster.namespace_of(h) for h in cluster.nodes]
        veths = [f"{cluster.prefix}-h{i}" for i in range(2)]
        listed = _ip_lines("netns", "list")
        assert all(ns in listed for ns in namespaces)
        links = _ip_lines("-br", "link")
        assert all(name in links for name in [cluster.bridge, *veths])
        assert f"{cluster.bridge_address}/24" in _ip_lines("-4", "addr", "show", "dev", cluster.bridge)
        inside = _ip_lines("-n", namespaces[1], "-4", "addr", "show", "dev", cluster.interface)
        assert f"{cluster.address_of('n1')}/24" in inside
        assert "UP" in _ip_lines("-n", namespaces[1], "-br", "link", "show", "lo")
        for where in ([], ["-n", namespaces[0]]):  # into the node, out of the node
            dev = cluster.interface if where else veths[0]
            qdisc = subprocess.run(["tc", *where, "qdisc", "show", "dev", dev],
                                   capture_output=True, text=True)
            assert "htb" in qdisc.stdout, (where, qdisc)
        assert cluster.rate_bits_per_s == 10**9
        args = cluster.mpiexec_args([1, 3])
        assert args[args.index("-localhost") + 1] == cluster.bridge_address
        assert args[args.index("-hosts") + 1] == "n0:1,n1:3"
        assert os.access(args[args.index("-launcher-exec") + 1], os.X_OK)
        workdir = Path(cluster.launcher).parent
    listed = _ip_lines("netns", "list")
    links = _ip_lines("-br", "link")
    assert not any(ns in listed for ns in namespaces)
    assert cluster.prefix not in links
    assert not workdir.exists() and not Path("/etc/netns", namespaces[0]).exists()
    cluster.stop()  # idempotent


@pytest.mark.services
@needs_netns
@pytest.mark.timeout(120, method="signal")
def test_failed_start_removes_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    original = EmulatedNodes._create_node

    def fail_on_second_node(self: EmulatedNodes, host: str) -> None:
        original(self, host)
        if host == "n1":
            raise RuntimeError("injected failure")

    monkeypatch.setattr(EmulatedNodes, "_create_node", fail_on_second_node)
    cluster = EmulatedNodes(3)
    with pytest.raises(RuntimeError, match="injected"):
        cluster.start()
    assert cluster.prefix not in _ip_lines("netns", "list") + _ip_lines("-br", "link")


@pytest.mark.services
@needs_netns
@pytest.mark.timeout(120, method="signal")
def test_stop_ends_processes_left_in_the_namespaces() -> None:
    cluster = EmulatedNodes(1, rate=None).start()
    try:
        straggler = subprocess.Popen(["ip", "netns", "exec", cluster.namespace_of("n0"), "sleep", "600"])
        deadline = time.monotonic() + 10
        while Path(f"/proc/{straggler.pid}/cmdline").read_bytes() != b"sleep\x00600\x00":  # exec'd in the ns
            assert time.monotonic() < deadline and straggler.poll() is None, "sleep did not start"
            time.sleep(0.01)
    finally:
        cluster.stop()
    assert straggler.wait(timeout=10) == -signal.SIGTERM
    assert cluster.prefix not in _ip_lines("netns", "list")


# ---- MPI ranks on the nodes -------------------------------------------------------------------------------
PLACEMENT_SCRIPT = """
import json, os, socket, sys
rank = int(os.environ["PMI_RANK"])
with open(os.path.join(sys.argv[1], f"{rank}.json"), "w") as f:
    json.dump({"rank": rank, "node": os.environ.get("TACO_NODE_NAME"), "host": socket.gethostname(),
               "netns": os.readlink("/proc/self/ns/net"), "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}, f)
"""


@pytest.mark.services
@needs_hydra
@pytest.mark.timeout(120, method="signal")
def test_mpiexec_places_two_ranks_on_each_node(
    emulated: Callable[..., EmulatedNodes], tmp_path: Path
) -> None:
    cluster = emulated(2)
    script = tmp_path / "place.py"
    script.write_text(PLACEMENT_SCRIPT)
    # A TACO_NODE_NAME in the caller's environment must not leak onto the nodes: mpiexec_env drops it.
    env = cluster.mpiexec_env({**os.environ, "TACO_NODE_NAME": "wrong"})
    outdir = _run_ranks(cluster, 2, script, env=env)
    places = {p["rank"]: p for p in (json.loads(f.read_text()) for f in outdir.glob("*.json"))}
    assert sorted(places) == [0, 1, 2, 3]
    assert [places[r]["node"] for r in range(4)] == ["n0", "n0", "n1", "n1"]
    assert [places[r]["host"] for r in range(4)] == ["n0", "n0", "n1", "n1"]
    assert {places[r]["ifname"] for r in range(4)} == {cluster.interface}
    assert places[0]["netns"] == places[1]["netns"] and places[2]["netns"] == places[3]["netns"]
    assert len({places[0]["netns"], places[2]["netns"], os.readlink("/proc/self/ns/net")}) == 3


# ---- the link limit ---------------------------------------------------------------------------------------
ALLREDUCE_SCRIPT = f"""
import json, os, sys, time
import torch
import taco_notebook.comm as taco

taco.init()
check = torch.full(({MIB16_FLOATS},), float(taco.rank() + 1))
taco.allreduce(check)
t = torch.ones({MIB16_FLOATS})
taco.allreduce(t)  # warm-up
times = []
for _ in range(5):
    taco.barrier()
    start = time.perf_counter()
    taco.allreduce(t)
    times.append(time.perf_counter() - start)
slowest = torch.tensor([min(times)], dtype=torch.float64)
taco.allreduce(slowest, op="max")
if taco.rank() == 0:
    with open(os.path.join(sys.argv[1], "result.json"), "w") as f:
        json.dump({{"seconds": slowest.item(), "nodes": taco.num_nodes(),
                   "sum_ok": bool((check == 10).all())}}, f)
taco.shutdown()
"""


def _allreduce_seconds(cluster: EmulatedNodes, script: Path) -> float:
    result = json.loads((_run_ranks(cluster, 2, script) / "result.json").read_text())
    assert result["nodes"] == 2 and result["sum_ok"], result
    return float(result["seconds"])


@pytest.mark.services
@needs_hydra
@pytest.mark.timeout(120, method="signal")
def test_gloo_allreduce_is_bound_by_the_link(emulated: Callable[..., EmulatedNodes], tmp_path: Path) -> None:
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE_SCRIPT)
    limited_cluster = emulated(2, rate="1gbit")
    limited = _allreduce_seconds(limited_cluster, script)
    limited_cluster.stop()
    unlimited = _allreduce_seconds(emulated(2, rate=None), script)
    # gloo's ring over 4 ranks sends 2(n-1)/n = 1.5x the payload over each node's link, each way.
    bound = 1.5 * MIB16_FLOATS * 4 * 8 / 1e9
    print(f"16 MiB allreduce, 2 nodes x 2 ranks: {limited * 1e3:.0f} ms at 1 Gbit/s "
          f"(bound {bound * 1e3:.0f} ms), {unlimited * 1e3:.0f} ms unlimited")
    assert limited >= 0.7 * bound, f"{limited:.3f} s is faster than a 1 Gbit/s link allows ({bound:.3f} s)"
    assert limited > 1.25 * unlimited, f"limit made no difference: {limited:.3f} s vs {unlimited:.3f} s"


TCP_SINK = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
start, total = None, 0
while chunk := conn.recv(1 << 20):
    start = start or time.perf_counter()
    total += len(chunk)
print(total * 8 / (time.perf_counter() - start), flush=True)
"""
TCP_SOURCE = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
block, end = bytes(1 << 20), time.perf_counter() + 1.5
while time.perf_counter() < end:
    conn.sendall(block)
conn.close()
"""


@pytest.mark.services
@needs_netns
@pytest.mark.timeout(120, method="signal")
def test_tcp_throughput_between_nodes_matches_the_rate(emulated: Callable[..., EmulatedNodes]) -> None:
    cluster = emulated(2, rate="200mbit")
    netns_exec = ["ip", "netns", "exec"]
    sink = subprocess.Popen([*netns_exec, cluster.namespace_of("n1"), sys.executable, "-c", TCP_SINK,
                             cluster.address_of("n1")], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None
        port = sink.stdout.readline().strip()
        subprocess.run([*netns_exec, cluster.namespace_of("n0"), sys.executable, "-c", TCP_SOURCE,
                        cluster.address_of("n1"), port], check=True, timeout=30)
        bits_per_s = float(sink.stdout.readline())
    finally:
        sink.kill()
        sink.wait()
    print(f"TCP n0 -> n1 at 200 Mbit/s: {bits_per_s / 1e6:.0f} Mbit/s")
    assert re.fullmatch(r"\d+", port)
    assert 0.5 * 200e6 <= bits_per_s <= 1.1 * 200e6
