"""The rank-side API under plain ``mpiexec`` (no IPython, no ipyparallel), and its pure parts."""

from __future__ import annotations

import re
import sys

import pytest

from taco_notebook.comm.group.topology import Topology, intra_size_from_env

from ..support.mpirun import run_in_session, run_mpi


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
    result = run_in_session(
        [mpiexec, "-n", "2", sys.executable, "-m", "taco_notebook.engine.rankwrap", sys.executable,
         str(script)],
        timeout=60)
    assert result.returncode != 0
    marker = [line for line in result.stderr.splitlines() if line.startswith("TACO-RANK-EXIT")]
    assert marker and "rank=1 " in marker[0] and f"signal={int(__import__('signal').SIGSEGV)}" in marker[0], \
        result.stderr


def test_process_state_teardown_runs_every_callback_last_first() -> None:
    """comm/'s state tears down what was registered, in reverse order, even past a failing callback."""
    from taco_notebook.comm.state import ProcessState

    state = ProcessState()
    ran: list[str] = []

    def first() -> None:
        ran.append("first")

    def failing() -> None:
        ran.append("failing")
        raise OSError("segment already gone")

    state.on_teardown(first)
    state.on_teardown(failing)
    state.on_teardown(first)  # registered once only
    state.backend = "gloo"
    with pytest.raises(OSError, match="segment already gone"):
        state.teardown()
    assert ran == ["failing", "first"]
    assert state.backend is None and state.store is None and state.rendezvous is None


def test_comm_modules_import_no_loop() -> None:
    """No module of comm/ imports, even inside a function, a module that imports it back (directly or not)."""
    from ..test_package_layers import _imports, _loops, _modules

    modules = {name: path for name, path in _modules().items() if name.startswith("taco_notebook.comm")}
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    bootstrap = graph["taco_notebook.comm.group.bootstrap"]
    assert bootstrap and "taco_notebook.comm.collectives.algorithms" not in bootstrap, bootstrap
    assert _loops(graph) == [], f"import loops through {_loops(graph)}"


def test_torch_abort_does_not_release_a_gloo_peer(mpiexec):
    """Why bootstrap.abort() clears frames: torch's ProcessGroup.abort() leaves a gloo group's sockets open.

    A peer blocked on the group is released only when the aborting process lets go of the group (here: exits
    after HOLD_S seconds). If a torch release makes abort() close the sockets, this fails: switch abort() to it.
    """
    hold = 8.0
    result = run_mpi(mpiexec, 2, "gloo_abort.py", {"HOLD_S": str(hold), "TACO_ABORT_ON_EXCEPTION": "0"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ABORTED" in result.stdout, result.stdout + result.stderr
    found = re.search(r"RELEASED-AFTER ([\d.]+)", result.stdout)
    assert found, result.stdout + result.stderr
    assert float(found.group(1)) >= hold - 1.5, result.stdout  # blocked ~1 s before the abort, then HOLD_S
