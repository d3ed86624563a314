"""The benchmark harness still runs (on localhost, no link limit): its tables are what the README quotes.

A benchmark past its timeout is killed with every process it started (its own mpiexec session included).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from taco_notebook.cluster.processes.tree import alive

from .support.mpirun import kill_session, mpi_env, run_in_session, still_running

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _benchmark(script: str, out: Path, *args: str, timeout: float = 110) -> tuple[list[str], dict]:
    """Run ``benchmarks/SCRIPT ARGS --json OUT`` (its own session, killed past ``timeout``); it must exit 0.
    Its stdout's lines and the JSON it wrote."""
    result = run_in_session([sys.executable, str(BENCHMARKS / script), *args, "--json", str(out)], timeout=timeout,
                            cwd=BENCHMARKS)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines(), json.loads(out.read_text())


def test_one_entry_point_lists_every_benchmark_and_runs_each_as_its_script():
    """``python -m benchmarks list`` names every script of benchmarks/ (not its helper modules); an unknown name
    exits 2 naming the known ones; a known one runs with its own arguments, imports and exit status."""
    def entry(*args: str) -> subprocess.CompletedProcess[str]:
        return run_in_session([sys.executable, "-m", "benchmarks", *args], timeout=60, cwd=BENCHMARKS.parent)

    listed = entry("list")
    assert listed.returncode == 0, listed.stderr
    names = {line.split()[0] for line in listed.stdout.splitlines() if line.startswith("  ")}
    helpers = {"emulated_run", "result_files", "signals"}
    assert names == {p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_")} - helpers, listed.stdout
    assert entry().stdout == listed.stdout == entry("--help").stdout
    unknown = entry("allreduce")
    assert unknown.returncode == 2 and "no benchmark named 'allreduce'" in unknown.stderr, unknown.stderr
    assert all(name in unknown.stderr for name in names), unknown.stderr
    refused = entry("node_allreduce", "--ranks", "1")  # its own argparse, after its `import emulated_run`
    assert refused.returncode == 2 and "at least 2 ranks" in refused.stderr, refused.stderr


def test_captured_ranks_output_is_returned_and_a_failure_carries_it(mpiexec, monkeypatch, capfd):
    """With ``capture`` (node_allreduce reads rank 0's RESULT line) the ranks' stdout is returned, and a failing
    rank's stderr, shown nowhere else, is in the error."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import emulated_run

    rank = "import os; os.write(1, f'RANK {os.environ[\"PMI_RANK\"]}\\n'.encode())"
    out = emulated_run.run_mpiexec([mpiexec, "-n", "2", sys.executable, "-c", rank], mpi_env(), 60, capture=True)
    assert sorted(out.splitlines()) == ["RANK 0", "RANK 1"]
    failing = ("import os, sys; r = os.environ['PMI_RANK']\n"
               "if r == '1': sys.exit(f'rank {r} has no GPU')")
    with pytest.raises(emulated_run.RanksFailed, match=r"(?s)mpiexec exited with \d+:.*rank 1 has no GPU"):
        emulated_run.run_mpiexec([mpiexec, "-n", "2", sys.executable, "-c", failing], mpi_env(), 60, capture=True)
    assert "RANK" not in capfd.readouterr().out


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_allreduce_benchmark_measures_every_variant(tmp_path):
    result = run_in_session(
        [sys.executable, str(BENCHMARKS / "allreduce_bench.py"), "--no-emulate", "--sizes-mib", "1", "--iters", "1",
         "--out", str(tmp_path / "allreduce-smoke.json")],
        timeout=220, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split("|")[2].strip() for line in result.stdout.splitlines() if line.startswith("| 1 MiB")}
    assert {"gloo", "mpi4py", "taco flat", "taco 2d", "taco 2d+fp16", "taco 2d+topk:0.01"} <= rows, result.stdout
    saved = json.loads((tmp_path / "allreduce-smoke.json").read_text())  # how it was made, to rerun it
    assert "allreduce_bench.py --no-emulate" in saved["command"], saved["command"]
    assert {"revision", "uncommitted_changes", "machine", "date"} <= set(saved), sorted(saved)


def test_an_mpiexec_past_its_timeout_is_killed_with_its_ranks(mpiexec, monkeypatch, capfd):
    """The benchmarks' own driver (emulated_run): at --timeout it stops mpiexec, hydra's proxy and both ranks,
    which run in sessions of their own, and says so."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import emulated_run

    # one write(2) per rank: hydra forwards the ranks' output in whatever pieces each write made
    rank = "import os, time; os.write(1, f'RANK {os.getpid()} {os.getppid()}\\n'.encode()); time.sleep(600)"
    began = time.time()
    with pytest.raises(emulated_run.RanksFailed, match="ran past --timeout 8 s and was killed"):
        emulated_run.run_mpiexec([mpiexec, "-n", "2", sys.executable, "-c", rank], mpi_env(), 8)
    out = capfd.readouterr().out
    started = [int(pid) for row in re.findall(r"^RANK (\d+) (\d+)$", out, re.M) for pid in row]
    assert len(started) == 4, out  # two ranks and their proxy (twice)
    left = {pid: cmd for pid in started if (cmd := still_running(pid, began))}
    assert not left, f"left running after the timeout: {left}"


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_dashboard_cost_benchmark_reports_both_measurements():
    result = run_in_session(
        [sys.executable, str(BENCHMARKS / "dashboard_cost.py"), "--ranks", "2", "--repeats", "1", "--steps", "20",
         "--calls", "100"],
        timeout=220, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| 20 ms | 0.05 |" in result.stdout and "one publish:" in result.stdout  # one publish per 0.4 s
    assert "| dashboard |" in result.stdout and "| --no-dashboard |" in result.stdout


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_control_plane_benchmark_measures_a_real_cluster(tmp_path):
    """Two real ranks, two repeats: every table has its columns and every figure is a positive measurement."""
    lines, data = _benchmark("control_plane.py", tmp_path / "control_plane.json", "--ranks", "2", "--repeats", "2")
    for header in ("| ranks | start s | of it launch s | start CPU s per engine / controller | empty cell ms |",
                   "| ranks | total | client | controller out | engine | controller back |",
                   "| ranks | direct execute | broadcast execute | direct apply | broadcast apply, coalescing |",
                   "| what | a | b per rank | at N |"):
        assert any(line.startswith(header) for line in lines), (header, lines)
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


def test_train_bench_says_when_each_variant_reaches_ddps_loss(monkeypatch):
    """The catch-up table's arithmetic: first step at DDP's last loss, its time at the variant's speed, and the
    step from which the variant stays within 5% of DDP at the same step."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import train_bench

    ddp = {"variant": "ddp", "samples_per_s": 64.0, "curve": [(10, 2.0), (20, 1.8), (30, 1.6)]}
    fast = {"variant": "fast", "samples_per_s": 128.0, "curve": [(10, 2.2), (20, 1.85), (30, 1.62), (40, 1.55)]}
    never = {"variant": "never", "samples_per_s": 256.0, "curve": [(10, 2.0), (20, 2.0), (30, 2.0)]}
    alone = {"variant": "compute-only", "samples_per_s": 500.0, "curve": [(10, 1.0)]}
    rows = {c["variant"]: c for c in train_bench.catch_up([ddp, fast, never, alone], world=4, batch=16)}
    assert set(rows) == {"ddp", "fast", "never"}  # compute-only trains each rank alone: no comparison
    assert (rows["ddp"]["reach_step"], rows["ddp"]["reach_s"]) == (30, 30.0)  # 1 s a step at 64 samples/s
    assert (rows["fast"]["reach_step"], rows["fast"]["reach_s"], rows["fast"]["speedup"]) == (40, 20.0, 1.5)
    assert rows["fast"]["within5_from"] == 20  # 1.85 <= 1.05 * 1.8 and 1.62 <= 1.05 * 1.6; 2.2 > 2.1
    assert rows["never"]["reach_step"] is None and rows["never"]["within5_from"] is None  # falls behind at 20
    text = train_bench.catch_up_table(list(rows.values()))
    assert "| fast | 40 | 20.0 | 1.50× | 20 |" in text and "| never | not in 30 |" in text
    # DDP's loss at an earlier step as the target; a rounding hair above it (fp16) counts as reached (1%)
    rounded = {"variant": "rounded", "samples_per_s": 64.0, "curve": [(10, 2.0), (20, 1.8001), (30, 1.6)]}
    early = {c["variant"]: c for c in train_bench.catch_up([ddp, fast, rounded], world=4, batch=16, at_step=20)}
    assert [early[v]["reach_step"] for v in ("ddp", "fast", "rounded")] == [20, 30, 20]
    with pytest.raises(ValueError, match="--catch-up-step 25 is not an evaluated step"):
        train_bench.catch_up([ddp, fast], world=4, batch=16, at_step=25)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_cell_protocol_benchmark_measures_both_protocols_on_torch_free_engines(tmp_path):
    """Two plain engines, four cells per protocol: every figure is a positive measurement and the old protocol
    (3 round trips per cell) takes longer than the new one (1)."""
    lines, data = _benchmark("cell_protocol.py", tmp_path / "cell_protocol.json", "--engines", "plain", "--ranks", "2",
                             "--cells", "4", "--sleep", "0.5")
    assert any(line.startswith("| plain | taco | 2 | ") for line in lines), lines
    (row,) = data["rows"]
    for variant in ("old", "stock", "new", "coalescing"):
        assert row[f"{variant}_wall_ms"] > 0 and row[f"{variant}_notebook_cpu_ms"] > 0, row
    assert row["old_wall_ms"] > row["new_wall_ms"], row
    assert set(row["watch_cpu_share"]) == {"poll all", "news only"}, row


def _read_lines(stream: Any, lines: list[str], seen: threading.Event, marker: str) -> None:
    """Every line of ``stream`` into ``lines``; ``seen`` set at the first one holding ``marker``."""
    for line in stream:
        lines.append(line.rstrip("\n"))
        if marker in line:
            seen.set()


@pytest.mark.cluster
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("signum", "entry", "status", "said"), [
    (signal.SIGTERM, ["cell_protocol.py"], 128 + signal.SIGTERM, "benchmark ended by SIGTERM; clusters stopped"),
    (signal.SIGHUP, ["-m", "benchmarks", "cell_protocol"], 128 + signal.SIGHUP,
     "benchmark ended by SIGHUP; clusters stopped"),
    (signal.SIGINT, ["cell_protocol.py"], -signal.SIGINT, "KeyboardInterrupt"),  # Python's own Ctrl-C
], ids=["sigterm", "sighup-module", "sigint"])
def test_a_benchmark_ended_by_a_signal_stops_its_cluster_first(signum, entry, status, said, tmp_path):
    """SIGTERM or SIGHUP to the benchmark alone, mid-measurement: it stops its controller and engines, exits
    with 128 + the signal's number and says so; Ctrl-C does the same through Python's KeyboardInterrupt."""
    argv = [sys.executable, *(str(BENCHMARKS / e) if e.endswith(".py") else e for e in entry),
            "--engines", "plain", "--ranks", "2", "--cells", "200"]
    # the benchmark starts with the signal's default action: a handler is reset at exec, where an ignored signal
    # (pytest under nohup, or started in the background) would stay ignored
    previous = signal.signal(signum, signal.default_int_handler)
    try:
        with open(tmp_path / "stdout", "w") as stdout:
            proc = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.PIPE, text=True, cwd=BENCHMARKS.parent,
                                    start_new_session=True)
    finally:
        signal.signal(signum, previous)
    lines: list[str] = []
    up = threading.Event()
    reader = threading.Thread(target=_read_lines, args=(proc.stderr, lines, up, "engines up in"), daemon=True)
    reader.start()
    try:
        assert up.wait(90), f"no engines up in 90 s (exit {proc.poll()}):\n" + "\n".join(lines)
        started: dict[psutil.Process, str] = {}
        for process in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                started[process] = " ".join(process.cmdline())
        time.sleep(1)  # into the cells
        os.kill(proc.pid, signum)
        proc.wait(timeout=30)
    except BaseException:  # past 30 s, Ctrl-C, pytest-timeout: nothing of it outlives the test
        kill_session(proc)
        raise
    reader.join(10)
    err = "\n".join(lines)
    deadline = time.monotonic() + 15
    while (left := [p for p in started if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.kill()
    assert not left, f"left running: {[started[p] for p in left]}\n{err}"
    assert not any("ipyparallel.engine.nanny" in command for command in started.values()), started
    assert proc.returncode == status, (tmp_path / "stdout").read_text() + err
    assert said in lines, err


@pytest.mark.mpi
def test_node_allreduce_benchmark_compares_gloo_and_the_node_algorithm(tmp_path):
    """Two ranks on one host, one size: both variants timed (each checked exact on every rank by the ranks
    themselves), and a bad argument is refused before anything starts."""
    lines, data = _benchmark("node_allreduce.py", tmp_path / "node.json", "--ranks", "2", "--sizes-mib", "0.25",
                             "--iters", "2", "--warmup", "1")
    assert any(line.startswith("| 2 | 0.25 | ") for line in lines), lines
    (row,) = data["results"]
    assert row["ranks"] == 2 and row["flat_ms"] > 0 and row["auto_ms"] > 0, row
    refused = run_in_session([sys.executable, str(BENCHMARKS / "node_allreduce.py"), "--ranks", "1"], timeout=30)
    assert refused.returncode == 2 and "at least 2 ranks" in refused.stderr, refused.stderr
