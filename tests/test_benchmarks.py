"""The benchmark harness still runs (on localhost, no link limit): its tables are what the README quotes.

A benchmark past its timeout is killed with every process it started (its own mpiexec session included).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .mpirun import run_in_session

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.timeout(240)
def test_allreduce_benchmark_measures_every_variant(tmp_path):
    result = run_in_session(
        [sys.executable, str(BENCHMARKS / "allreduce_bench.py"), "--no-emulate", "--sizes-mib", "1", "--iters", "1",
         "--out", str(tmp_path / "allreduce-smoke.json")],
        timeout=220, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split("|")[2].strip() for line in result.stdout.splitlines() if line.startswith("| 1 MiB")}
    assert {"gloo", "mpi4py", "taco flat", "taco 2d", "taco 2d+fp16", "taco 2d+topk:0.01"} <= rows, result.stdout
    assert list(tmp_path.glob("allreduce-*.json")), "no JSON result written"


@pytest.mark.timeout(240)
def test_dashboard_cost_benchmark_reports_both_measurements():
    result = run_in_session(
        [sys.executable, str(BENCHMARKS / "dashboard_cost.py"), "--ranks", "2", "--repeats", "1", "--steps", "20",
         "--calls", "100"],
        timeout=220, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| 20 ms | 0.05 |" in result.stdout and "one publish:" in result.stdout  # one publish per 0.4 s
    assert "| dashboard |" in result.stdout and "| --no-dashboard |" in result.stdout


@pytest.mark.timeout(120)
def test_control_plane_benchmark_measures_a_real_cluster(tmp_path):
    """Two real ranks, two repeats: every table has its columns and every figure is a positive measurement."""
    out = tmp_path / "control_plane.json"
    result = run_in_session(
        [sys.executable, str(BENCHMARKS / "control_plane.py"), "--ranks", "2", "--repeats", "2", "--json", str(out)],
        timeout=110, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for header in ("| ranks | start s | of it launch s | start CPU s per engine / controller | empty cell ms |",
                   "| ranks | total | client | controller out | engine | controller back |",
                   "| ranks | direct execute | broadcast execute | direct apply | broadcast apply, coalescing |",
                   "| what | a | b per rank | at N |"):
        assert any(line.startswith(header) for line in lines), (header, result.stdout)
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["ranks"] == 2 and len(row["engine_rss_mib"]) == 2
    figures = [row["start_s"], row["launch_s"], row["empty_ms"], row["allreduce_ms"], row["engine_rss_sum_mib"],
               row["engine_pss_sum_mib"], row["controller_rss_mib"], row["registry_write_ms"],
               row["registry_entry_bytes"], *row["engine_rss_mib"], *row["dispatch_ms"].values(),
               *(row["split_ms"][k] for k in ("total", "controller_out", "engine", "controller_back")),
               row["cpu_client_ms"], row["cpu_controller_ms"], row["cpu_engines_ms"], row["publish_client_cpu_us"],
               row["payload_bytes"], row["start_cpu_per_engine_s"], row["start_cpu_controller_s"]]
    assert all(f > 0 for f in figures), row
    assert row["launch_s"] < row["start_s"] and row["split_ms"]["engine"] < row["split_ms"]["total"], row
    # the first table shows the same figures the JSON holds
    table_row = next(line for line in lines if line.startswith("| 2 | "))
    assert f"{row['empty_ms']:.1f}" in table_row and f"{row['start_s']:.1f}" in table_row, table_row
