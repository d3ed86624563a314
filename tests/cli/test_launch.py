"""``taco-notebook launch -np N [options] SCRIPT ARGS`` as a user runs it: a real process that starts a
real MPI-launched cluster, labels every rank's output, exits with a status that says what happened and leaves
nothing behind (the conftest's leak check runs after each test: every process this one started carries its mark)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from taco_notebook.cli import main
from taco_notebook.cluster.processes.tree import marked_processes
from taco_notebook.cluster.session import clusters

from ..conftest import session_processes
from ..support.mpirun import kill_session, mpi_env, run_in_session
from ..support.waiting import wait_until

pytestmark = pytest.mark.cluster

SCRIPT = """\
import json, sys
import torch
import taco_notebook.comm as taco

t = torch.ones(2) * (taco.rank() + 1)
taco.allreduce(t)
print(json.dumps({"argv": sys.argv[1:], "name": __name__, "sum": t.tolist()}))
if "--fail" in sys.argv and taco.rank() == 1:
    raise ValueError("bad shard on rank 1")
if "--sleep" in sys.argv:
    print("sleeping", flush=True)
    import time
    time.sleep(120)
"""


def launch(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m taco_notebook launch ARGS``; past ``timeout`` it and its cluster are killed
    (tests/support/mpirun.py).
    """
    return run_in_session([sys.executable, "-m", "taco_notebook", "launch", *args], cwd=cwd, timeout=timeout,
                          env=mpi_env())


def registry_names() -> set[str]:
    """The clusters the registry lists (this session's: conftest points TACO_REGISTRY_DIR at its own folder)."""
    names = set()
    for entry in Path(os.environ["TACO_REGISTRY_DIR"]).glob("*.json"):
        try:
            names.add(json.loads(entry.read_text()).get("model", {}).get("name"))
        except (OSError, ValueError):
            continue
    return names


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_launch_runs_the_script_on_every_rank_and_exits_0(script):
    result = launch("-np", "2", "--no-dashboard", "train.py", "--lr", "0.1", "-np", "3", cwd=script.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("[rank ")]
    reports = {line[6]: json.loads(line.split("] ", 1)[1]) for line in lines}
    assert sorted(reports) == ["0", "1"], result.stdout
    assert all(r == {"argv": ["--lr", "0.1", "-np", "3"], "name": "__main__", "sum": [3.0, 3.0]}
               for r in reports.values()), reports
    assert "[taco] starting cluster 'launch-" in result.stdout
    assert not any(name.startswith("launch-") for name in registry_names() if name)


def test_a_rank_that_raises_exits_1_naming_it(script):
    result = launch("-np", "2", "--quiet", "--no-dashboard", str(script), "--fail", cwd=script.parent)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "RankFailedError: rank 1 (host " in result.stderr and "ValueError: bad shard on rank 1" in result.stderr
    assert f'File {script}:9' in result.stderr and "\x1b[" not in result.stderr  # the script's frame, no colour
    assert '[rank 0] {"argv": ["--fail"]' in result.stdout


def launch_sleeping(script: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], list[str]]:
    """``launch -np 2 SCRIPT --sleep`` in a session of its own (a signal to its group reaches it alone, as a
    kernel's interrupt), read until the ranks sleep; the process and the lines read. The caller ends it."""
    proc = subprocess.Popen([sys.executable, "-m", "taco_notebook", "launch", "-np", "2", "--no-dashboard",
                             str(script), "--sleep"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "sleeping" in line:
            return proc, seen
    kill_session(proc)
    pytest.fail("the script never started: " + "".join(seen))


def test_ctrl_c_stops_the_ranks_and_the_cluster(script, sigint_as_in_a_kernel):
    proc, seen = launch_sleeping(script)
    try:
        interrupted = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole foreground group
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 130, "".join(seen) + rest
        assert time.monotonic() - interrupted < 30
        assert "interrupted (SIGINT): stopping the cluster" in rest
    finally:
        if proc.returncode is None:  # not seen to end: kill it and every process it started
            kill_session(proc)


def test_a_killed_launch_leaves_no_process_and_no_ipyparallel_file(script, tmp_path):
    """``kill -9`` of the command mid-run: its reaper kills the cluster's processes and removes ipyparallel's
    files (cluster file, connection files, logs) with the registry entry, within seconds."""
    ipython_dir = tmp_path / "ipython"  # a profile of its own: exactly this cluster's files are watched
    proc, _ = launch_sleeping(script, env=mpi_env({"IPYTHONDIR": str(ipython_dir)}))
    profile = ipython_dir / "taco-ipyparallel"
    try:
        security = sorted(p.name for p in (profile / "security").iterdir())
        assert any(name.startswith("cluster-launch-") for name in security), security
        assert sum(name.startswith("ipcontroller-") for name in security) == 2, security
        cluster_id = next(name for name in security if name.startswith("cluster-"))[len("cluster-"):-len(".json")]
        proc.kill()
        proc.wait(timeout=10)

        def left() -> list[str]:
            files = [str(p.relative_to(profile)) for sub in ("security", "log") for p in (profile / sub).iterdir()]
            return files + [f"pid {p.pid}" for p in marked_processes(cluster_id)]

        wait_until(lambda: not left(), 30, f"every file and process of {cluster_id} gone (left: {left()})", 0.1)
        assert not any(name.startswith("launch-") for name in registry_names() if name)
    finally:
        if proc.returncode is None:
            kill_session(proc)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize("args, message", [
    (["-np", "2"], "launch needs a script to run"),
    (["-np", "2", "missing.py"], "no script at missing.py"),
    (["-np", "0", "train.py"], "-np must be a positive integer, got '0'"),
    (["-np", "2", "--compression", "gzip", "train.py"], "unknown compression 'gzip'"),
])
def test_a_usage_mistake_exits_2_and_starts_nothing(script, monkeypatch, capsys, args, message):
    """In this process (the command's own main(); no cluster is involved), to spare a Python start per case."""
    monkeypatch.chdir(script.parent)
    before, names = set(session_processes()), set(clusters)
    assert main(["launch", *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "starting cluster" not in captured.out
    assert set(clusters) == names and set(session_processes()) <= before


def test_help_documents_the_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["launch", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for words in ("[-np N]", "--intra-size N", "--profile NAME", "--hosts SPEC", "SCRIPT", "Exit status"):
        assert words in out, words
