"""The rank-side API under plain ``mpiexec`` (no IPython, no ipyparallel), and its pure parts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from taco_notebook.comm.topology import Topology, intra_size_from_env

SCRIPTS = Path(__file__).parent / "mpi"


def run_mpi(mpiexec: str, n: int, script: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([mpiexec, "-n", str(n), sys.executable, str(SCRIPTS / script)],
                          capture_output=True, text=True, timeout=timeout, env=full_env)


@pytest.mark.parametrize("n, intra, expect", [
    (4, None, "node=0/1"),
    (4, "2", "node=1/2"),
    (3, None, "node=0/1"),
])
def test_collectives_under_mpiexec(mpiexec, n, intra, expect):
    env = {"LIGHT_INTRA_SIZE": intra} if intra else {}
    result = run_mpi(mpiexec, n, "collectives.py", env)
    assert result.returncode == 0, result.stdout + result.stderr
    # ranks share one stdout, so lines can interleave: find the reports wherever they are
    reports = sorted(re.findall(r"OK (\d+) (local=\d+/\d+ node=\d+/\d+)", result.stdout))
    assert [int(rank) for rank, _ in reports] == list(range(n)), result.stdout
    assert any(expect in placement for _, placement in reports), reports


def test_algorithms_compression_and_optimizer_on_two_emulated_nodes(mpiexec):
    """flat and 2d x none/fp16/bf16/topk, error feedback, metrics per link, DistributedOptimizer."""
    result = run_mpi(mpiexec, 4, "training.py", {"LIGHT_INTRA_SIZE": "2"}, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(re.findall(r"OK (\d+)", result.stdout)) == ["0", "1", "2", "3"], result.stdout


def test_topology_groups_by_hostname():
    topo = Topology.from_hostnames(3, ["a", "b", "a", "b"])
    assert (topo.node, topo.local_rank, topo.local_size, topo.num_nodes) == (1, 1, 2, 2)
    assert topo.node_ranks == ((0, 2), (1, 3))
    assert topo.hostname == "b"


def test_topology_intra_size_overrides_hostnames():
    topo = Topology.from_hostnames(2, ["h"] * 4, intra_size=2)
    assert topo.node_ranks == ((0, 1), (2, 3))
    assert (topo.node, topo.local_rank) == (1, 0)
    with pytest.raises(ValueError, match="must divide the number of ranks 4"):
        Topology.from_hostnames(0, ["h"] * 4, intra_size=3)


@pytest.mark.parametrize("raw", ["abc", "0", "-2"])
def test_light_intra_size_rejects_bad_values(monkeypatch, raw):
    monkeypatch.setenv("LIGHT_INTRA_SIZE", raw)
    with pytest.raises(ValueError, match="LIGHT_INTRA_SIZE must be a positive integer"):
        intra_size_from_env()


def test_rank_wrapper_reports_the_rank_that_died(mpiexec, tmp_path):
    script = tmp_path / "die.py"
    script.write_text("import os, signal, time\n"
                      "if os.environ['PMI_RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
                      "time.sleep(30)\n")
    result = subprocess.run(
        [mpiexec, "-n", "2", sys.executable, "-m", "taco_notebook.cluster.rankwrap", sys.executable, str(script)],
        capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    marker = [line for line in result.stderr.splitlines() if line.startswith("TACO-RANK-EXIT")]
    assert marker and "rank=1 " in marker[0] and f"signal={int(__import__('signal').SIGSEGV)}" in marker[0], \
        result.stderr
