"""The hang autopsy with real MPI-launched engines: a rank hung in plain Python (blocked in C, or busy) while the
others wait in an allreduce, a rank hung in another collective, a rank that cannot answer; read on demand
(``%taco_cluster stacks``, :func:`collect`) and when the stall watchdog fires (under the cell)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from taco_notebook.cluster.cells.autopsy import Autopsy, RankAddress, collect, launcher_of, rank_span
from taco_notebook.cluster.launch.sshcheck import runs_locally
from taco_notebook.cluster.session import clusters
from taco_notebook.comm.diagnostics.listener import socket_dir
from taco_notebook.emulate.hosts import EmulatedHosts
from taco_notebook.errors import RankFailedError
from taco_notebook.remote.autopsy_reader import MODULE

from ...conftest import REPO
from ..launch.test_profiles import _left_on_nodes, emulated, needs_hosts  # noqa: F401 - the fixture

pytestmark = pytest.mark.cluster

# rank 3 stays in `where` until the flag file exists; the others enter allreduce 'step' and wait for it
HANG_CELL = """\
import os, time
t = torch.ones(2)
taco.allreduce(t)
def load_batch(flag):
    while not os.path.exists(flag):
        time.sleep(0.05)
def spin(flag):
    x = 0
    while not os.path.exists(flag):
        x += 1
if taco.rank() == 3:
    {where}({flag!r})
taco.allreduce(t, name='step')
"""


@pytest.fixture
def released(tmp_path: Path) -> Iterator[Path]:
    flag = tmp_path / "release"
    yield flag
    flag.touch()  # whatever happened, the hung rank goes on


def until(found: Callable[[], Autopsy], ok: Callable[[Autopsy], bool], seconds: float = 60) -> Autopsy:
    """Read the stacks until ``ok`` (the ranks need a moment to reach their places), or the last reading."""
    deadline = time.monotonic() + seconds
    while True:
        report = found()
        if ok(report) or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


def in_places(found: Autopsy, where: str) -> bool:
    """Rank 3 in ``where`` and the others in allreduce 'step' (not still in the cell's first allreduce)."""
    places = {r.rank: r.summary() for r in found.ranks}
    return (found.suspects == [3] and f"in {where}" in places.get(3, "")
            and all("'step'" in place for rank, place in places.items() if rank != 3))


def hung_cell(cluster, where: str, flag: Path) -> Autopsy:
    if cluster.needs_reinit:
        cluster.reinit()
    result = cluster.client[cluster.engine_ids()].execute(HANG_CELL.format(where=where, flag=str(flag)), block=False)
    try:
        report = until(lambda: collect(cluster.ranks), lambda found: in_places(found, where))
    finally:
        flag.touch()
        result.get(60)  # the cell ends normally once released: the autopsy changed nothing
    return report


@pytest.mark.parametrize("where", ["load_batch", "spin"])
def test_a_rank_hung_in_python_is_named_with_its_place(shared_cluster, released: Path, where: str) -> None:
    """load_batch: the main thread sleeps in C (GIL released); spin: it is busy in Python (GIL held, handed over
    every switch interval). Either way the listener answers, and the report names rank 3 and its line."""
    report = hung_cell(shared_cluster, where, released)
    text = report.text()
    line = "(5|6)" if where == "load_batch" else "(9|10)"  # the loop's test, or its body
    assert re.search(r"^ranks 0-2: allreduce #\d+ 'step' \(waited \d+\.\d s\) at cell:13 in <module>$", text,
                     re.M), text
    assert re.search(rf"^rank 3: cell:{line} in {where}, no collective$", text, re.M), text
    assert re.search(r"^suspect: rank 3 \(in no collective while ranks 0-2 wait in allreduce #\d+ 'step'\)$",
                     text, re.M), text
    # the suspect's own frames come first, right under the summary; the kernel's and zmq's threads one line each
    lines = text.splitlines()
    assert lines[4:6] == ["--- rank 3, thread MainThread:", f"    cell:12 in <module>: {where}({str(released)!r})"], \
        text
    assert re.search(r"^    ranks 0-3, thread Control: \S+:\d+ in \w+$", text, re.M), text
    assert re.search(r"^    ranks 0-3, thread IOPub: \S+:\d+ in \w+$", text, re.M), text
    assert len(lines) <= 30, text
    full = report.text(full=True)
    assert "--- ranks 0-3, thread Control:\n" in full and len(full.splitlines()) > len(lines), full
    # the communication thread blocked in C, in the ranks' agreement on the allreduce (comm/collectives/agreement.py),
    # which
    # comes first and waits for rank 3: on one node, asleep on the node segment's gate (the header exchange,
    # comm/transport/shm.py); across nodes, torch.distributed's all_gather (or the data's all_reduce)
    assert re.search(r"--- ranks 0-2, thread taco-comm:\n(    .*\n)*    (taco_notebook/comm/transport/shm\.py:\d+ "
                     r"in exchange: self\._wait\(_SAID|torch/distributed/distributed_c10d\.py:\d+ in "
                     r"(all_reduce|all_gather\w*)\b)", text), text


def test_the_stall_watchdog_shows_where_every_rank_was(ip, shared_cluster, capsys) -> None:
    """Rank 3 broadcasts while the others allreduce: every watchdog fires at 3 s; the autopsy under the cell shows
    each rank in its collective as it was then (marked *), and names rank 3. The ranks' agreement check would
    refuse that pair at once (comm/collectives/agreement.py): it is off for the cell, as in a program that turned it
    off."""
    cell = ("t = torch.ones(2)\ntaco.allreduce(t)\nif taco.rank() == 3:\n    taco.broadcast(t)\nelse:\n"
            "    taco.allreduce(t, name='step')")
    check = "from taco_notebook.comm.collectives import agreement\nagreement.set_enabled({})"
    ip.run_cell_magic("taco_run", "", check.format(False))
    try:
        with pytest.raises(RankFailedError):
            ip.run_cell_magic("taco_run", "--stall-timeout 3", cell)
        # every rank's watchdog tore its group down, whether or not the notebook saw a rank still running
        assert shared_cluster.needs_reinit
        err = capsys.readouterr().err
        assert "[taco] hang autopsy: stacks of 4 ranks" in err, err
        assert re.search(r"^ranks 0-2\*?: allreduce #(\d+) 'step' \(waited [3-9]\.\d s\) at cell:6 in <module>$", err,
                         re.M), err
        assert re.search(r"^rank 3\*?: broadcast #\d+ \(waited \d+\.\d s\) at cell:4 in <module>$", err, re.M), err
        assert re.search(r"^suspect: rank 3 \(rank 3 in another collective while ranks 0-2 wait in allreduce #\d+ "
                         r"'step'\)$", err, re.M), err
        after = check.format(True) + "\nt = torch.ones(2)\ntaco.allreduce(t)\nt.tolist()"
        assert ip.run_cell_magic("taco_run", "", after) == [4.0, 4.0]
    finally:
        ip.run_cell_magic("taco_run", "", check.format(True))


def test_a_rank_that_cannot_answer_is_described_by_the_os(ip, shared_cluster, capsys) -> None:
    """The test stops rank 2 itself (SIGSTOP: a process that no longer runs); the autopsy says what /proc says,
    names it, and the other ranks' stacks still come."""
    ip.run_line_magic("taco_cluster", "stacks")
    assert re.search(r"^ranks 0-3: idle \(no user code running\), no collective$", capsys.readouterr().out, re.M)
    pid = next(r.pid for r in shared_cluster.ranks if r.rank == 2)
    os.kill(pid, signal.SIGSTOP)
    try:
        report = collect(shared_cluster.ranks, timeout=5.0)  # a loaded machine: the others must answer
    finally:
        os.kill(pid, signal.SIGCONT)
    text = report.text(stacks=False)
    assert re.search(rf"^rank 2: no answer: its listener did not answer \(no answer in 5 s; .*\); process {pid} "
                     rf"is T \(stopped\) \(/proc/{pid}/status\), wchan ", text, re.M), text
    assert re.search(r"^ranks 0, 1, 3: idle \(no user code running\), no collective$", text, re.M), text
    assert report.suspects == [2] and "rank 2 did not answer" in text
    ip.run_line_magic("taco_cluster", "stacks")  # it answers again
    folded = capsys.readouterr().out
    assert "ranks 0-3: idle" in folded and "--- other threads, one line each: where it waits" in folded
    ip.run_line_magic("taco_cluster", "stacks --all")  # every thread with every frame: nothing folded
    full = capsys.readouterr().out
    assert "other threads, one line each" not in full and full.count("\n") > folded.count("\n"), full
    assert re.search(r"^--- ranks 0-3, thread MainThread:$", full, re.M), full


def test_the_host_reader_reads_real_ranks_as_ssh_would_run_it(shared_cluster) -> None:
    """What the collector runs on another host, run here for this host's ranks: one JSON line, every rank's
    snapshot (its own rank and pid)."""
    pids = [r.pid for r in shared_cluster.ranks]
    done = subprocess.run([sys.executable, "-m", MODULE, "--dir", str(socket_dir()), "--timeout", "5",
                           *map(str, pids)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["host"] == socket.gethostname()
    assert {(r.rank, r.pid) for r in shared_cluster.ranks} == {
        (answer["reply"]["now"]["rank"], answer["reply"]["now"]["pid"]) for answer in printed["pids"].values()}


def test_stacks_of_a_cluster_that_does_not_run_is_a_usage_error(ip) -> None:
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="no cluster named 'nosuch' runs in this kernel or in the registry"):
        ip.run_line_magic("taco_cluster", "stacks --cluster nosuch")


def test_a_process_gone_is_said_so() -> None:
    """A rank whose process no longer exists (as after a crash): no listener, and the OS has no such process."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    report = collect([RankAddress(0, gone.pid, socket.gethostname())], timeout=0.5)
    assert re.search(rf"no listener at .*/{gone.pid}\.sock; no process {gone.pid} on {socket.gethostname()}$",
                     report.ranks[0].missing or ""), report.ranks[0].missing


@pytest.mark.parametrize(("ranks", "text"), [([7], "rank 7"), ([0, 1], "ranks 0, 1"), (list(range(16)), "ranks 0-15"),
                                             ([*range(7), *range(8, 16)], "ranks 0-6, 8-15")])
def test_rank_spans(ranks: list[int], text: str) -> None:
    assert rank_span(ranks) == text


@needs_hosts
@pytest.mark.timeout(300, method="signal")
def test_a_rank_hung_on_another_host_is_read_over_ssh(ip, emulated: EmulatedHosts, released: Path,  # noqa: F811
                                                       capsys) -> None:
    """2 emulated nodes x 2 ranks, every rank on a host other than this one: rank 3 (on n1) hangs in load_batch
    while the others wait in allreduce 'step'; collect() and ``%taco_cluster stacks`` read n0 and n1 over ssh
    (one each) and name rank 3 with its line, within 2 s. The nodes and the cluster stop whatever happens."""
    assert not runs_locally("n0") and not runs_locally("n1")
    result = None
    try:
        ip.run_line_magic("taco_cluster", "start --profile hosts --hosts n0:2,n1:2 -n 4 --cluster hosts")
        cluster = clusters["hosts"]
        assert [r.host for r in cluster.ranks] == ["n0", "n0", "n1", "n1"]
        result = cluster.client[cluster.engine_ids()].execute(HANG_CELL.format(where="load_batch", flag=str(released)),
                                                               block=False)
        ssh = launcher_of(cluster)
        report = until(lambda: collect(cluster.ranks, launcher_exec=ssh), lambda found: in_places(found, "load_batch"))
        timings = [collect(cluster.ranks, launcher_exec=ssh).seconds for _ in range(3)]
        ip.run_line_magic("taco_cluster", "stacks --cluster hosts")
        shown = capsys.readouterr().out
    finally:
        released.touch()
        if result is not None:
            result.get(60)  # the cell ends normally once released: reading over ssh changed nothing
        if "hosts" in clusters:
            ip.run_line_magic("taco_cluster", "stop --cluster hosts")
    text = report.text()
    assert [r.host for r in report.ranks] == ["n0", "n0", "n1", "n1"] and all(r.snapshot for r in report.ranks), text
    assert re.search(r"^rank 3: cell:(5|6) in load_batch, no collective$", text, re.M), text
    assert re.search(r"^suspect: rank 3 \(in no collective while ranks 0-2 wait in allreduce #\d+ 'step'\)$",
                     text, re.M), text
    assert re.search(r"^rank 3: cell:(5|6) in load_batch, no collective$", shown, re.M), shown
    assert "unreachable" not in shown and "no answer" not in shown, shown
    assert max(timings) < 2.0, timings
    assert _left_on_nodes(emulated) == {}
    with capsys.disabled():
        print(f"\nautopsy of 4 ranks on 2 emulated hosts over ssh: {', '.join(f'{t:.2f}' for t in timings)} s")
