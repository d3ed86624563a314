"""The hang autopsy's per-host reader and its merge, on this host: the reader run as the collector runs it on
another host (``python -m …autopsy_host``, printing JSON) against a real listener and real processes, real
``ssh`` failing and hanging, and the collector's merge of what a host's ssh gave back. The emulated-node test
(ranks on other hosts read over ssh) is in test_autopsy.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from taco_notebook.cluster.cells.autopsy import (
    REMOTE_SETUP_S,
    RankAddress,
    collect,
    host_answers,
    read_remote,
)
from taco_notebook.comm.diagnostics import listener
from taco_notebook.remote.autopsy_reader import MODULE, read_pids

from ..conftest import REPO


@pytest.fixture
def listening(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This process as a rank: its listener in a private directory of the test's own."""
    directory = tmp_path / "stacks"
    monkeypatch.setenv(listener.DIR_ENV, str(directory))
    listener.listen()
    yield directory
    listener.stop_listening()


@pytest.fixture
def stopped() -> Iterator[int]:
    """A process stopped with SIGSTOP (no listener): what the OS says of a rank that cannot answer."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(child.pid, signal.SIGSTOP)
    yield child.pid
    os.kill(child.pid, signal.SIGKILL)
    child.wait(30)


def run_reader(directory: Path, *pids: int, timeout: float = 1.0) -> dict:
    """The reader as ssh runs it on a host: a fresh interpreter, one JSON line on stdout."""
    done = subprocess.run([sys.executable, "-m", MODULE, "--dir", str(directory), "--timeout", str(timeout),
                           *map(str, pids)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    return json.loads(line)


def test_the_reader_reports_a_listening_process_and_one_that_cannot_answer(listening: Path, stopped: int) -> None:
    released = threading.Event()
    worker = threading.Thread(target=released.wait, args=(60,), name="blocked-worker", daemon=True)
    worker.start()
    try:
        began = time.monotonic()
        printed = run_reader(listening, os.getpid(), stopped)
        took = time.monotonic() - began
    finally:
        released.set()
        worker.join(10)
    assert printed["host"] == socket.gethostname()
    now = printed["pids"][str(os.getpid())]["reply"]["now"]
    assert now["pid"] == os.getpid() and "blocked-worker" in [t["name"] for t in now["threads"]]
    assert printed["pids"][str(stopped)] == {
        "missing": f"no listener at {listening}/{stopped}.sock; process {stopped} is T (stopped) "
                   f"(/proc/{stopped}/status), wchan " + _wchan(stopped)}
    assert took < 1.0, f"the reader took {took:.2f} s: it must not import torch"  # it starts on every host


def _wchan(pid: int) -> str:
    wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    return wchan if wchan not in ("", "0") else "none (running)"


def test_the_reader_refuses_a_stacks_directory_others_may_write(tmp_path: Path) -> None:
    directory = tmp_path / "open"
    directory.mkdir()
    os.chmod(directory, 0o777)
    [answer] = run_reader(directory, os.getpid())["pids"].values()
    assert answer["missing"].startswith(f"refusing the stacks directory {directory}: group or others may write "
                                        f"it"), answer
    assert "set TACO_AUTOPSY_DIR to a directory of your own" in answer["missing"]


def test_the_merge_takes_a_host_reply_and_names_what_is_missing(listening: Path) -> None:
    reply = read_pids([os.getpid()], listening, 1.0)[os.getpid()]
    printed = json.dumps({"host": "n1", "pids": {str(os.getpid()): reply}})
    answers = host_answers("n1", [os.getpid(), 4242], 0, f"motd from the host\n{printed}\n", "")
    assert answers[os.getpid()]["reply"]["now"]["pid"] == os.getpid()
    assert answers[4242] == {"missing": "host n1: its stacks reader did not report process 4242"}
    failed = host_answers("n2", [7, 8], 255, "", "Warning: something\nssh: connect to host n2 port 22: "
                                                 "Connection refused\n")
    assert failed == {pid: {"missing": "host n2: ssh failed: ssh: connect to host n2 port 22: Connection refused"}
                      for pid in (7, 8)}
    assert host_answers("n2", [7], 1, "", "") == {7: {"missing": "host n2: ssh failed: exit status 1"}}
    assert host_answers("n3", [7], 0, "Traceback: no module\n", "") == {
        7: {"missing": "host n3: its stacks reader printed no report (got 'Traceback: no module')"}}


def test_a_host_ssh_cannot_reach_lists_its_ranks_with_ssh_s_reason(listening: Path) -> None:
    """Real ssh to a name that does not resolve: its ranks say so, the local rank still answers, in one report."""
    ranks = [RankAddress(0, os.getpid(), socket.gethostname()), RankAddress(1, 4242, "nosuch-host.invalid")]
    report = collect(ranks, timeout=1.0, launcher_exec="ssh")
    local, remote = report.ranks
    assert local.snapshot is not None and local.snapshot["pid"] == os.getpid()
    assert remote.missing == ("host nosuch-host.invalid: ssh failed: ssh: Could not resolve hostname "
                              "nosuch-host.invalid: Name or service not known"), remote.missing
    assert report.suspects == [1] and "rank 1: no answer: host nosuch-host.invalid: ssh failed" in report.text()


def test_a_host_that_never_answers_is_given_up_and_its_ssh_stopped() -> None:
    """A real ssh to a server that accepts and then says nothing: killed at the budget (conftest fails the test
    if the ssh is left running)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        port = silent.getsockname()[1]
        began = time.monotonic()
        answers = read_remote(f"ssh://127.0.0.1:{port}", [11, 12], "ssh", Path("/nonexistent"), 0.2)
        took = time.monotonic() - began
    budget = 0.2 + REMOTE_SETUP_S
    assert answers == {pid: {"missing": f"host ssh://127.0.0.1:{port}: no answer over ssh in {budget:g} s "
                                        f"(ssh stopped)"} for pid in (11, 12)}
    assert budget <= took < budget + 1.0, took
