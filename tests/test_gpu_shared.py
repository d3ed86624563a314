"""benchmarks/gpu_shared.py: skips with the reason without one GPU, and its rank-side workers run (on CPU tensors)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_shared.py"


def test_it_skips_with_the_reason_without_one_gpu():
    import torch

    if torch.cuda.device_count() == 1:
        pytest.skip("this machine has one GPU: gpu_shared.py runs for real here")
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("skipped: needs exactly one CUDA GPU, this machine has "), result.stdout


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_its_self_test_on_cpu_fills_every_table():
    """1 rank (the one-rank shortcuts switched off) and 2 ranks: every variant timed, the allreduce's sum exact;
    on CPU no figure is read (host syncs n/a, nothing goes through a GPU)."""
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--ranks", "1", "2", "--steps", "3"],
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for title in ("### Training step, 1 rank, the reduction forced", "### Training step, 2 ranks sharing the GPU",
                  "### One allreduce, ranks sharing the GPU"):
        assert title in out, (title, out)
    for variant in ("plain SGD", "DDP", "DDP + torch fp16 hook", "taco", "taco fp16", "taco topk:0.01",
                    "taco powersgd:4:warmup=0"):
        rows = re.findall(rf"^\| {re.escape(variant)} \| ([\d.]+) \| n/a \(cpu\) \|$", out, re.M)
        assert len(rows) == 2 and all(float(ms) > 0 for ms in rows), (variant, out)
    assert re.search(r"^\| 2 \| 1 \| [\d.]+ \| [\d.]+ \| [\d.]+x \| yes \| - \|$", out, re.M), out
    assert "FAILED" not in out, out
