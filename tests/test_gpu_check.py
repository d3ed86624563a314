"""benchmarks/gpu_check.py: skips with the reason without a GPU, and its rank-side checks run (on CPU tensors)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def test_gpu_check_skips_with_the_reason_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: gpu_check.py runs for real here")
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("skipped: no CUDA device (torch "), result.stdout


@pytest.mark.mpi
@pytest.mark.timeout(400)
def test_gpu_check_self_test_on_cpu_runs_every_rank_side_check():
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--sections", "collectives", "training"],
                            capture_output=True, text=True, timeout=380)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks passed" in result.stdout and "FAILED" not in result.stdout, result.stdout
    for check in ("allreduce 2d cpu", "broadcast+max on cpu", "optimizer topk:0.01 on cpu", "ddp-hook fp16 on cpu"):
        assert check in result.stdout, (check, result.stdout)


def test_a_failure_is_named_by_its_last_line_even_when_its_message_is_empty(monkeypatch):
    """The notebooks section indexed an empty exception message (``splitlines()[-1]``) and died with an
    IndexError on the GPU machine instead of reporting the notebook that failed."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check

    assert gpu_check.last_line("Traceback (most recent call last):\n  ...\nValueError: bad\n\n") == "ValueError: bad"
    assert gpu_check.last_line("") == "no message"
    assert gpu_check.last_line(KeyError()) == "no message"  # str() of an exception without a message is ""
    assert gpu_check.last_line(" \n\t\n", "no output") == "no output"
    assert gpu_check.last_line(RuntimeError("x" * 500)) == "x" * 160
    assert gpu_check.last_line(TimeoutError(), type(TimeoutError()).__name__) == "TimeoutError"


@pytest.mark.mpi
@pytest.mark.timeout(400)
def test_overhead_and_synthetic_sections_run_their_workers_on_cpu():
    """The CUDA sections, run as a self-test on a tiny model: every variant, the compressor
    kernels and the sync counts (n/a without CUDA) reach the tables; --help lists the sections."""
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--sections", "overhead", "synthetic",
                             "placement", "--steps", "3"], capture_output=True, text=True, timeout=380)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for row in ("| taco powersgd:4:warmup=0 |", "| DDP + taco fp16 hook |", "| topk:0.01 |", "| plain torch |",
                "| taco fp16 |", "| horovod fp16 |", "skipped: needs CUDA"):
        assert row in out, (row, out)
    assert "n/a (cpu)" in out and "all checks passed" in out, out
    usage = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and "synthetic" in usage.stdout, usage.stdout + usage.stderr
