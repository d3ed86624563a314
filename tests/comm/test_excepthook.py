"""Plain ``mpiexec``: an uncaught exception on one rank ends the whole job; under ``%%taco_run`` it does not."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from taco_notebook.errors import RankFailedError

SCRIPTS = Path(__file__).parents[1] / "mpi"


@pytest.mark.parametrize("block_in", ["mpi", "taco"])
def test_uncaught_exception_on_one_rank_ends_the_plain_mpiexec_job(mpiexec, block_in):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BLOCK_IN": block_in}
    job = subprocess.Popen([mpiexec, "-n", "2", sys.executable, str(SCRIPTS / "raise_on_one_rank.py")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           start_new_session=True)
    try:
        output, _ = job.communicate(timeout=240)  # startup on a loaded 2-core machine; the end is timed below
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        pytest.fail(f"the job hung after rank 1 raised:\n{output}")
    ended = time.time()
    raised = re.search(r"RAISING-AT ([0-9.]+)", output)
    assert raised, output
    assert ended - float(raised.group(1)) < 10, f"took {ended - float(raised.group(1)):.1f} s:\n{output}"
    assert job.returncode != 0, output
    assert "RuntimeError: rank 1 fails on purpose" in output, output  # rank 1's traceback
    assert 'raise_on_one_rank.py", line' in output, output
    assert "[taco] rank 1: uncaught RuntimeError: aborting the MPI job" in output, output
    assert "RANK-0-FINISHED" not in output, output


def _hook_state() -> tuple[bool, bool, bool]:
    from taco_notebook.comm import excepthook

    return excepthook.under_mpi_launcher(), excepthook.in_engine(), excepthook.is_installed()


def test_the_hook_is_not_installed_on_taco_run_engines(ip, shared_cluster, capsys):
    states = shared_cluster.view.apply_sync(_hook_state)
    assert states == [(True, True, False)] * shared_cluster.size, states
    with pytest.raises(RankFailedError):  # today's behaviour: the cell fails, the engines stay
        ip.run_cell_magic("taco_run", "", "raise ValueError('cell fails on purpose')")
    capsys.readouterr()
    ip.run_cell_magic("taco_run", "", "print('alive', taco.rank(), taco.size())")
    printed = capsys.readouterr().out
    assert sorted(re.findall(r"alive (\d) 4", printed)) == ["0", "1", "2", "3"], printed
    assert shared_cluster.view.apply_sync(_hook_state) == states
