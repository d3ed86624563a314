"""``%%taco_run --elastic``: ranks killed with SIGKILL mid-training, the survivors go on from the last commit;
engines added during a run join at the next commit.

One 4-rank cluster serves every check of the cluster test (conftest stops any cluster but 'default' after each
test): a kill under ``--elastic 2:4``, the survivors' variables in the next cell, a kill below MIN, then two
engines added while the last two train, which join from the committed state.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from IPython.core.error import UsageError

from taco_notebook.cluster.elastic.recovery import Death, ElasticError, ElasticSpec, Membership, parse_elastic
from taco_notebook.cluster.session import clusters
from taco_notebook.comm.training.elastic import State

from ...conftest import session_processes
from ...support.mpirun import run_mpi

SETUP = """\
import os, signal, time
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
state = taco.elastic.State(model=model, optimizer=opt, step=0)
victim, kill_at = taco.rank() == 2, 25
kept = f"engine {os.getpid()}"
"""

TRAIN = """\
print(f"start {state.step} {time.time():.3f}", flush=True)
while state.step < 60:
    torch.manual_seed(state.step * 100 + taco.rank())
    loss = model(torch.randn(16, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward()
    for p in model.parameters():
        taco.allreduce(p.grad, op="avg")
    opt.step(); state.step += 1
    if state.step % 10 == 0:
        state.commit()
    if victim and state.step == kill_at:
        print(f"kill {state.step} {time.time():.3f}", flush=True)
        time.sleep(0.5)  # the line must reach the notebook before the engine goes
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.02)
[taco.rank(), taco.size(), state.step, [p.detach().tolist() for p in model.parameters()]]
"""

SUMMARY = "[kept, victim, taco.rank(), taco.size(), state.step]"


def _stamps(text: str, word: str) -> list[tuple[int, float]]:
    return [(int(m[0]), float(m[1])) for m in re.findall(rf"\] {word} (\d+) ([\d.]+)", text)]


def test_state_commits_restores_and_names_a_missing_counter() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = State(model=model, optimizer=opt, step=0)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    state.step = 10
    state.commit()
    committed = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    state.step = 15
    state.restore()
    assert state.step == 10 and state.committed == {"step": 10}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), committed, strict=True))
    with pytest.raises(AttributeError, match="no counter 'epoch'.*State\\(..., epoch=0\\)"):
        _ = state.epoch


def test_elastic_run_under_plain_mpiexec_retries_from_the_commit(mpiexec) -> None:
    """``taco.elastic.run``: a collective failing on every rank rolls back to the commit and runs again."""
    result = run_mpi(mpiexec, 2, "elastic_run.py")
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(re.findall(r"rank \d starts \[0, 10\] done 30", result.stdout)) == [
        "rank 0 starts [0, 10] done 30", "rank 1 starts [0, 10] done 30"]


def test_elastic_option_is_checked_and_hosts_that_fail_twice_are_blacklisted(ip) -> None:
    assert parse_elastic("2:4") == ElasticSpec(2, 4)
    for bad in ("4:2", "0:2", "two:4", "2"):
        with pytest.raises(ValueError, match="--elastic must be MIN:MAX"):
            parse_elastic(bad)
    with pytest.raises(UsageError, match="leave out --targets"):
        ip.run_cell_magic("taco_run", "--elastic 2:4 --targets 0 --cluster none", "pass")
    with pytest.raises(UsageError, match="scale N needs a running cluster"):
        ip.run_line_magic("taco_cluster", "scale 3 --cluster none")
    membership = Membership(ElasticSpec(1, 4))
    both = [Death(1, "n1", 11, "SIGKILL"), Death(2, "n1", 13, "SIGKILL")]
    assert membership.record(both, now=100.0) == []  # a node's ranks dying together: one failure of n1
    assert membership.record([Death(0, "n1", 12, "SIGKILL")], now=200.0) == ["n1"]
    assert membership.blacklisted(now=201.0) == ["n1"]
    assert membership.blacklisted(now=200.0 + 301) == []


@pytest.mark.cluster
def test_killed_rank_under_elastic_the_survivors_go_on_from_the_commit(ip, capsys) -> None:
    ip.run_cell_magic("taco_run", "-np 4 --cluster elastic --no-dashboard", SETUP)
    pids = [r.pid for r in clusters["elastic"].ranks]
    capsys.readouterr()

    began = time.monotonic()
    values = ip.run_cell_magic("taco_run", "--elastic 2:4 --cluster elastic --no-dashboard --gather", TRAIN)
    took = time.monotonic() - began
    out = capsys.readouterr().out
    assert "rank 2 (host" in out and "died: SIGKILL; continuing on 3 ranks from commit at step 20" in out
    assert [v[:3] for v in values] == [[0, 3, 60], [1, 3, 60], [2, 3, 60]]
    assert values[0][3] == values[1][3] == values[2][3]  # the survivors' parameters are identical
    starts = _stamps(out, "start")
    assert sorted(step for step, _ in starts) == [0] * 4 + [20] * 3  # the loop resumed at the commit
    [(_, killed_at)] = _stamps(out, "kill")
    resumed_at = min(t for step, t in starts if step == 20)
    with capsys.disabled():  # the figure the report quotes, shown with -s
        print(f"\nelastic: kill -> training resumed in {resumed_at - killed_at - 0.5:.2f} s; cell {took:.1f} s")
    assert resumed_at - killed_at < 10
    assert pids[2] not in session_processes()
    membership = clusters["elastic"].model()["membership"]
    assert membership is not None and (membership["min"], membership["max"]) == (2, 4)
    assert [(lost["rank"], lost["how"]) for lost in membership["lost"]] == [(2, "SIGKILL")]

    # the survivors' other variables are still there, renumbered 0..2
    summary = ip.run_cell_magic("taco_run", "--cluster elastic --no-dashboard --gather", SUMMARY)
    assert summary == [[f"engine {pid}", False, rank, 3, 60] for rank, pid in enumerate(pids[:2] + pids[3:])]

    # below MIN: a clear error, no hang, and the last two keep their variables
    cell = "victim, kill_at = taco.rank() == 0, 65\n" + TRAIN.replace("state.step < 60", "state.step < 90")
    began = time.monotonic()
    with pytest.raises(ElasticError, match="died: SIGKILL; .*2 ranks left, fewer than --elastic's MIN 3"):
        ip.run_cell_magic("taco_run", "--elastic 3:4 --cluster elastic --no-dashboard", cell)
    assert time.monotonic() - began < 20
    assert ip.run_cell_magic("taco_run", "--cluster elastic --no-dashboard --gather", "kept") == \
        [f"engine {pid}" for pid in (pids[1], pids[3])]

    grow_during_a_run(ip, capsys)
    stalled_rank_is_lost(ip, capsys)


GROW = """\
state = taco.elastic.State(model=model, optimizer=opt, step=0, on_four=0)
"""

STEP = """\
    loss = model(torch.randn(16, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward()
    for p in model.parameters():
        taco.allreduce(p.grad, op="avg")
    opt.step(); state.step += 1
"""  # one training step of the loops below (indented for their body)

TRAIN_UNTIL_FOUR = """\
print(f"start {state.step} {time.time():.3f}", flush=True)
while state.on_four < 20:
""" + STEP + """\
    state.on_four += taco.size() == 4
    if state.step % 10 == 0:
        state.commit()
    time.sleep(0.05)
[taco.rank(), taco.size(), [p.detach().tolist() for p in model.parameters()]]
"""


def grow_during_a_run(ip, capsys) -> None:
    """Two engines launched (a second mpiexec) while two ranks train: they join at the next commit."""
    cluster = clusters["elastic"]
    ip.run_cell_magic("taco_run", "--cluster elastic --no-dashboard", GROW)
    capsys.readouterr()
    launcher = threading.Timer(0.5, cluster.launch_engines, (2,))
    launcher.start()
    try:
        values = ip.run_cell_magic("taco_run", "--elastic 2:4 --cluster elastic --no-dashboard --gather "
                                   "--timeout 240", TRAIN_UNTIL_FOUR)
    finally:
        launcher.join()
    out = capsys.readouterr().out
    assert re.search(r"2 ranks joined \(host [^)]+\); continuing on 4 ranks from commit at step \d+0 ", out), out
    assert [v[:2] for v in values] == [[0, 4], [1, 4], [2, 4], [3, 4]]
    assert all(v[2] == values[0][2] for v in values)  # the joiners hold the same parameters
    starts = sorted(step for step, _ in _stamps(out, "start"))
    assert starts[:2] == [0, 0] and len(set(starts[2:])) == 1 and starts[2] % 10 == 0  # all from the commit
    assert cluster.model()["membership"]["joined"] == 2


STALL = """\
state = taco.elastic.State(model=model, optimizer=opt, step=0)
"""

TRAIN_ONE_HANGS = """\
print(f"start {state.step} {time.time():.3f}", flush=True)
while state.step < 40:
""" + STEP + """\
    if state.step % 10 == 0:
        state.commit()
    if taco.rank() == 3 and taco.size() == 4 and state.step == 15:
        time.sleep(600)  # hung outside any collective: the others stall in the next allreduce
[taco.rank(), taco.size(), state.step, [p.detach().tolist() for p in model.parameters()]]
"""


def stalled_rank_is_lost(ip, capsys) -> None:
    """Under --elastic, a rank that the others' stall watchdog names is ended as a lost member, and the cell goes
    on without it from the commit (without --elastic the stall fails the cell: tests/magics/test_magics_stall.py)."""
    ip.run_cell_magic("taco_run", "--cluster elastic --no-dashboard", STALL)
    capsys.readouterr()
    began = time.monotonic()
    values = ip.run_cell_magic("taco_run", "--elastic 2:4 --stall-timeout 3 --cluster elastic --no-dashboard "
                               "--gather --timeout 120", TRAIN_ONE_HANGS)
    out, err = capsys.readouterr()
    assert "rank 3 never reached the collective the others waited in" in out + err, out + err
    assert re.search(r"rank 3 \(host [^)]+\) died: SIGKILL[^;]*; continuing on 3 ranks from commit at step 10",
                     out), out
    assert [v[:3] for v in values] == [[0, 3, 40], [1, 3, 40], [2, 3, 40]]
    assert values[0][3] == values[1][3] == values[2][3]
    assert time.monotonic() - began < 90


def _emulation_skip() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    from taco_notebook.emulate.hosts import EmulateError, check_prerequisites

    try:
        check_prerequisites()
    except EmulateError as missing:
        return str(missing)
    return None


EMULATION_SKIP = _emulation_skip()
NODE_CELL = TRAIN.replace("victim and state.step == kill_at", "taco.node() == 1 and state.step == 25").replace(
    "print(f\"kill", "print(f\"kill node 1 at")


@pytest.mark.cluster
@pytest.mark.skipif(EMULATION_SKIP is not None, reason=EMULATION_SKIP or "")
def test_losing_a_whole_emulated_node_under_elastic(ip, capsys, monkeypatch) -> None:
    """Two emulated nodes of two ranks (hydra over real ssh, a TCPStore across namespaces): node n1's ranks
    are killed together; the two on n0 go on from the commit, on one node, and n1 counts one failure."""
    home = Path(tempfile.mkdtemp(prefix="taco-elastic-", dir=Path.home()))  # sshd refuses keys under /tmp
    monkeypatch.setenv("TACO_EMULATE_DIR", str(home / "state"))

    def emulate(*args: str) -> None:
        done = subprocess.run([sys.executable, "-m", "taco_notebook", "emulate", *args], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr

    where = "--profile hosts --hosts n0:2,n1:2 --cluster elastic-nodes --no-dashboard"
    emulate("up", "2x2", "--link", "1gbit", "--down-with", str(os.getpid()))
    try:
        ip.run_cell_magic("taco_run", f"-np 4 {where}", SETUP)
        capsys.readouterr()
        values = ip.run_cell_magic("taco_run", f"--elastic 2:4 {where} --gather", NODE_CELL)
        out = capsys.readouterr().out
        membership = clusters["elastic-nodes"].model()["membership"]
    finally:
        cluster = clusters.pop("elastic-nodes", None)
        if cluster is not None:
            cluster.stop()
        emulate("down")
        shutil.rmtree(home, ignore_errors=True)
    assert re.search(r"rank \d \(host n1\) died: SIGKILL; rank \d \(host n1\) died: SIGKILL; continuing on 2 "
                     r"ranks from commit at step 20", out), out
    assert [v[:3] for v in values] == [[0, 2, 60], [1, 2, 60]] and values[0][3] == values[1][3]
    assert sorted(h["host"] for h in membership["lost"]) == ["n1", "n1"] and membership["blacklisted"] == []
