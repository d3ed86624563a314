"""tests/support/mpirun.py for real: an ``mpiexec`` job that never ends is killed whole at its timeout, and the test
fails with its output; a job that ends returns its exit code and output."""

from __future__ import annotations

import os
import re
import shlex
import sys
import time

import pytest

from .support.mpirun import mpi_env, run_in_session, still_running

# each rank also starts a process in a session of its own that inherits its stdout: it is no descendant of
# mpiexec once the rank dies, and in no session of ours, so only the walk of the frozen tree (or the pipe it
# holds) finds it; and it maps a /dev/shm segment, as MPI's shared memory does, which a SIGKILL leaves behind
RANK = """
import mmap, os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
segment = f"/dev/shm/taco-test-mpirun-{os.getpid()}"
with open(segment, "w+b") as f:
    f.truncate(4096)
    mapped = mmap.mmap(f.fileno(), 4096)
os.write(1, f"PIDS {os.getpid()} {os.getppid()} {child.pid} {segment}\\n".encode())  # one write: hydra interleaves
time.sleep(600)
"""
TIMEOUT_S = 5.0  # 3 s would do, but hydra plus two Python starts can take that long on 2 loaded cores


@pytest.mark.parametrize("wrapped", [False, True], ids=["mpiexec", "sh-c-mpiexec"])
def test_a_job_past_its_timeout_fails_and_leaves_no_process(mpiexec: str, wrapped: bool) -> None:
    """``sh -c``: subprocess.run's timeout would kill the shell alone and leave mpiexec and its ranks."""
    argv = [mpiexec, "-n", "2", sys.executable, "-c", RANK]
    if wrapped:
        argv = ["sh", "-c", shlex.join(argv) + "; echo never"]  # not exec: the shell stays mpiexec's parent
    began = time.time()
    with pytest.raises(pytest.fail.Exception) as failed:
        run_in_session(argv, env=mpi_env(), timeout=TIMEOUT_S)
    took = time.time() - began
    message = str(failed.value)
    assert f"overran {TIMEOUT_S:g} s: killed it and the" in message, message
    pids = re.findall(r"^PIDS (\d+) (\d+) (\d+) (\S+)$", message, re.M)  # the output so far is in the failure
    assert len(pids) == 2, message
    rank, proxy, detached = ({int(row[i]) for row in pids} for i in range(3))
    assert len(proxy) == 1 and not proxy & rank, pids  # two ranks of one hydra_pmi_proxy
    left = {pid: cmd for pid in rank | proxy | detached if (cmd := still_running(pid, began))}
    assert not left, f"left running after the failure: {left}"
    assert not [row[3] for row in pids if os.path.exists(row[3])], "the ranks' shared memory was left behind"
    assert took < TIMEOUT_S + 20, f"the kill took {took - TIMEOUT_S:.1f} s"


def test_a_job_that_ends_returns_its_exit_code_and_output() -> None:
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    result = run_in_session([sys.executable, "-c", code], timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")
    merged = run_in_session([sys.executable, "-c", code], timeout=60, merge_stderr=True)
    assert sorted(merged.stdout.splitlines()) == ["err", "out"] and merged.stderr == ""
