"""The node algorithm: a one-node job's allreduce, and its ranks' agreement, through the node's shared memory.

Real ranks: ``mpiexec`` for the algorithm, plain processes in a real gloo group for the segment's failure
paths (a peer that dies, a segment closed under a wait), which MPI would end for us before we could look.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from ..support.mpirun import SCRIPTS, run_in_session, run_mpi


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_one_node_job_reduces_through_shared_memory(mpiexec, n):
    """Exact sums for every dtype and awkward size, bitwise the same on every rank, one chunk or several, after
    the segment grows and after the group is rebuilt; compression, bool, flat and shm=False go over gloo."""
    result = run_mpi(mpiexec, n, "node_allreduce.py", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert sorted(re.findall(r"OK (\d+)", result.stdout)) == [str(r) for r in range(n)], result.stdout


@pytest.mark.parametrize("n", [2, 4])
def test_ranks_sharing_a_gpu_reduce_in_its_memory(mpiexec, n):
    """CUDA tensors of ranks that share the one GPU (``--gpus auto``) go through CUDA IPC slots: exact sums,
    identical ranks, calls back to back, casts; TopK, bool, CPU tensors and ``shm`` off elsewhere."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() != 1:
        pytest.skip("needs exactly one CUDA GPU (the lent GPU machine); CI has none")
    result = run_mpi(mpiexec, n, "gpu_node_allreduce.py", env={"TACO_GPUS": "auto"}, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert sorted(re.findall(r"OK (\d+)", result.stdout)) == [str(r) for r in range(n)], result.stdout
    for said in ("Warning", "Producer process has been terminated"):  # torch's IPC bookkeeping, at exit
        assert said not in result.stdout + result.stderr, result.stderr[-4000:]


def _peers(mode: str, size: int, tmp_path: Path) -> list[str]:
    """Start ``size`` processes of tests/mpi/shm_peers.py in MODE; their outputs (each waited for, 60 s)."""
    import subprocess

    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "shm_peers.py"), mode, str(rank), str(size), str(store)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for rank in range(size)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=60)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


def test_a_local_peer_that_dies_ends_the_others_wait_at_once(tmp_path):
    """Not at the collective timeout (60 s here, 1,800 by default): the waiters watch the peers' pidfds, and
    raise a RuntimeError (what gloo raises for a lost peer, which elastic recovery catches) naming it."""
    outputs = _peers("dead", 3, tmp_path)
    for rank, out in enumerate(outputs[:2]):
        found = re.search(r"RAISED ([\d.]+) RuntimeError: local rank\(s\) \[2\] of this node \(pid \d+\) ended", out)
        assert found, f"rank {rank}: {out}"
        assert float(found.group(1)) < 5, out
    assert "RAISED" not in outputs[2]


def test_closing_the_segment_ends_a_wait_on_another_thread(tmp_path):
    """A group torn down under a pass (the stall watchdog, an abort) closes the segment: the pass's wait ends
    with an error instead of sleeping to the timeout, and nothing reads an unmapped page (a segfault before)."""
    [out] = _peers("closed", 1, tmp_path)
    found = re.search(r"RAISED ([\d.]+) RuntimeError: the node's shared-memory segment was closed", out)
    assert found, out
    assert float(found.group(1)) < 5, out


def test_the_node_algorithm_falls_back_to_gloo_when_dev_shm_is_full(mpiexec, tmp_path):
    """A container's /dev/shm is often 64 MiB, and writing past a tmpfs's size kills the writer (SIGBUS): with
    no room for the segment every rank takes the flat algorithm together, and the sums stay exact. A private
    mount namespace with a 4 MiB tmpfs on /dev/shm stands in for that container (root only)."""
    import os
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private /dev/shm")
    script = tmp_path / "full.py"
    script.write_text(
        "import os, torch, taco_notebook.comm as taco\n"
        "from taco_notebook.comm.transport import pipeline\n"
        "r, n = taco.rank(), taco.size()\n"
        "for numel in (1, 3 << 20):\n"
        "    t = torch.full((numel,), float(r + 1))\n"
        "    pipeline.reset_phases()\n"
        "    taco.allreduce(t)\n"
        "    assert 'scatter' not in pipeline.phase_seconds, 'went through a segment that does not fit'\n"
        "    assert torch.equal(t, torch.full((numel,), float(n * (n + 1) // 2)))\n"
        "os.write(1, f'OK {r}\\n'.encode())\n")  # one write() per rank: the two ranks' lines cannot interleave
    # mpich keeps its own shared memory out of the way (MPIR_CVAR_NOLOCAL): only taco's segment needs /dev/shm
    inner = (f"mount -t tmpfs -o size=4m,mode=1777 tmpfs /dev/shm && MPIR_CVAR_NOLOCAL=1 {mpiexec} -n 2 "
             f"{sys.executable} {script}")
    result = run_in_session(["unshare", "-m", "--propagation", "private", "sh", "-c", inner], timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert len(re.findall(r"OK \d", result.stdout)) == 2, result.stdout


def test_the_ranks_agree_on_why_they_keep_gloo():
    """What every local rank said at a step of the set-up (a text where it failed) gives one answer everywhere."""
    from taco_notebook.comm.transport.cudaipc import DeviceSegment

    assert DeviceSegment._refusal([("GPU-1", False), ("GPU-1", True)], "ask its GPU") is None
    refused = [(["share"], b"event"), "RuntimeError: CUDA error: invalid device context", "OSError: x"]
    assert DeviceSegment._refusal(refused, "share its slot") == (
        "local rank 1 could not share its slot (RuntimeError: CUDA error: invalid device context)")
