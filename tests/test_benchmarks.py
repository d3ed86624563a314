"""The benchmark harness still runs (on localhost, no link limit): its tables are what the README quotes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.timeout(240)
def test_allreduce_benchmark_measures_every_variant(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "allreduce_bench.py"), "--no-emulate", "--sizes-mib", "1", "--iters", "1",
         "--out", str(tmp_path / "allreduce-smoke.json")],
        capture_output=True, text=True, timeout=220, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split("|")[2].strip() for line in result.stdout.splitlines() if line.startswith("| 1 MiB")}
    assert {"gloo", "mpi4py", "taco flat", "taco 2d", "taco 2d+fp16", "taco 2d+topk:0.01"} <= rows, result.stdout
    assert list(tmp_path.glob("allreduce-*.json")), "no JSON result written"


@pytest.mark.timeout(240)
def test_dashboard_cost_benchmark_reports_both_measurements():
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "dashboard_cost.py"), "--ranks", "2", "--repeats", "1", "--steps", "20",
         "--calls", "100"],
        capture_output=True, text=True, timeout=220, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| 20 ms | 0.05 |" in result.stdout and "one publish:" in result.stdout  # one publish per 0.4 s
    assert "| dashboard |" in result.stdout and "| --no-dashboard |" in result.stdout
