"""Ranks that disagree on a collective (shape, dtype, root, op, kind, a call invalid on one rank) get one clear
error on every rank within a second, and the next collective works: under real ``mpiexec`` ranks, and in a
notebook cell on a real cluster (tests/mpi/agreement.py holds the rank side). Every dtype torch has goes through."""

from __future__ import annotations

import re
import time

import pytest

from taco_notebook.cluster.session import clusters
from taco_notebook.comm.collectives.agreement import JOINED, Signature, _message
from taco_notebook.errors import RankFailedError

from ..support.mpirun import run_mpi


@pytest.mark.parametrize("n", [2, 3])
def test_each_mismatch_raises_on_every_rank_and_the_next_collective_works(mpiexec: str, n: int) -> None:
    result = run_mpi(mpiexec, n, "agreement.py", args=["comm"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(re.findall(r"OK (\d+) 27 checks", result.stdout)) == [str(k) for k in range(n)], result.stdout


def test_a_2d_job_agrees_through_its_nodes_segments_and_one_cross_node_step(mpiexec: str) -> None:
    """2 nodes of 2 ranks (LIGHT_INTRA_SIZE=2): the same errors on every rank, exchanged per node in shared
    memory and then between nodes, not by an allgather over all 4 ranks."""
    result = run_mpi(mpiexec, 4, "agreement.py", env={"LIGHT_INTRA_SIZE": "2"}, args=["comm"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(re.findall(r"OK (\d+) 27 checks", result.stdout)) == [str(k) for k in range(4)], result.stdout


def test_the_message_names_each_side_biggest_first() -> None:
    common = Signature("allreduce", "g", (4,), "float32", "cpu", op="sum")
    odd = Signature("allreduce", "g", (5,), "float32", "cpu", op="sum")
    message = _message([common, odd, common, JOINED], [0, 1, 2, 3])
    lines = message.splitlines()
    assert lines[1] == "  ranks 0, 2: allreduce 'g', shape [4], float32, cpu, op sum", message
    assert lines[2] == "  rank 1: allreduce 'g', shape [5], float32, cpu, op sum", message
    assert lines[3] == "  rank 3: join() (finished)", message


@pytest.mark.cluster
def test_a_mismatching_cell_fails_on_every_rank_and_the_next_cell_runs(ip, shared_cluster) -> None:
    pids = [r.pid for r in clusters["default"].ranks]
    cell = "t = torch.ones(5 if taco.rank() == 2 else 4)\ntaco.allreduce(t, name='loss')"
    began = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        ip.run_cell_magic("taco_run", "", cell)
    message = str(info.value)
    assert "CollectiveMismatchError" in message and "also failed" in message, message
    assert re.search(r"ranks? [0-3](, [0-3])* also failed", message), message
    rendered = "\n".join(info.value._render_traceback_())  # the first failing rank's traceback, in full
    assert (
        "rank 2: allreduce 'loss', shape [5]" in rendered and "ranks 0, 1, 3: allreduce 'loss', shape [4]" in rendered
    ), rendered
    assert time.monotonic() - began < 30, message
    assert (
        ip.run_cell_magic("taco_run", "--gather", "t = torch.ones(3)\ntaco.allreduce(t)\nt.tolist()") == [[4.0] * 3] * 4
    )
    assert [r.pid for r in clusters["default"].ranks] == pids  # the same engines: nothing died
