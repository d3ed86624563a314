"""``%%taco_run`` and ``%taco_cluster`` in a real IPython shell against real MPI-launched engines."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from taco_notebook.cluster.session import clusters
from taco_notebook.comm.compression.spec import CompressionSpec
from taco_notebook.errors import CellTimeoutError, ClusterStartError, RankDiedError, RankFailedError

from ..conftest import session_processes
from ..support.waiting import gate_code, wait_until

pytestmark = pytest.mark.cluster

ALLREDUCE_CELL = """\
t = torch.full((3,), float(taco.rank()))
taco.allreduce(t)
print(taco.rank(), taco.size(), t)
t.tolist()
"""


def engine_pids(name: str = "default") -> list[int]:
    return [r.pid for r in clusters[name].ranks]


def rank_lines(text: str) -> dict[int, list[str]]:
    lines: dict[int, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("[rank "):
            label, _, rest = line.partition("] ")
            lines.setdefault(int(label[len("[rank "):]), []).append(rest)
    return lines


# rank 1's wait (in the cell, indented under its ``if``) until the 3 ranks of the doomed cluster have started
WAIT_FOR_3 = ("    while len([f for f in os.listdir('{MARKERS}') if f.startswith('started-')]) < 3:\n"
              "        __import__('time').sleep(0.02)")


# ---------------------------------------------------------------- results and output

def test_allreduce_result_and_labelled_output(ip, shared_cluster, capsys):
    value = ip.run_cell_magic("taco_run", "-np 4", ALLREDUCE_CELL)
    out = capsys.readouterr().out
    assert value == [6.0, 6.0, 6.0]  # rank 0's value of the last expression
    lines = rank_lines(out)
    assert sorted(lines) == [0, 1, 2, 3]
    for rank in range(4):
        assert lines[rank] == [f"{rank} 4 tensor([6., 6., 6.])"]


def test_gather_returns_every_rank_value_and_state_persists(ip, shared_cluster):
    ip.run_cell_magic("taco_run", "", "secret = taco.rank() * 10")
    assert ip.run_cell_magic("taco_run", "--gather", "secret + 1") == [1, 11, 21, 31]
    assert ip.run_cell_magic("taco_run", "", "secret;") is None  # a trailing ';' shows nothing


def test_unpicklable_value_comes_back_as_its_repr(ip, shared_cluster):
    value = ip.run_cell_magic("taco_run", "", "import threading\nthreading.Lock()")
    assert "lock" in repr(value)


def test_output_streams_while_the_cell_runs(ip, shared_cluster, tmp_path):
    """The ranks print 'first', then wait for a gate that only the notebook side opens, once it has shown 'first'
    from all 4: the cell can only end because its output arrived while it ran (no sleep to outlast)."""
    gate = tmp_path / "shown"
    seen: list[str] = []

    class Recorder:
        def write(self, text: str) -> None:
            seen.append(text)
            if sum("first" in t for t in seen) == 4:
                gate.touch()

        def flush(self) -> None:
            pass

    import sys

    cell = gate_code(gate, "the notebook never showed 'first' while the cell ran") + \
        "print('first', flush=True)\nwait_for_gate()\nprint('last')"
    saved = sys.stdout
    sys.stdout = Recorder()  # type: ignore[assignment]
    try:
        ip.run_cell_magic("taco_run", "", cell)
    finally:
        sys.stdout = saved
    first = [i for i, text in enumerate(seen) if "first" in text]
    last = [i for i, text in enumerate(seen) if "last" in text]
    assert len(first) == 4 and len(last) == 4 and max(first) < min(last), seen


def test_targets_runs_on_a_subset(ip, shared_cluster, capsys):
    ip.run_cell_magic("taco_run", "--targets 1,3", "print('here', taco.rank())")
    assert sorted(rank_lines(capsys.readouterr().out)) == [1, 3]
    assert ip.run_cell_magic("taco_run", "--targets 2-3 --gather", "taco.rank()") == [2, 3]


def test_no_stream_groups_output_by_rank(ip, shared_cluster, capsys):
    ip.run_cell_magic("taco_run", "--no-stream",
                      "import time\nfor i in range(2):\n    print(taco.rank(), i)\n    time.sleep(0.3)")
    labelled = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[rank")]
    assert labelled == [f"[rank {r}] {r} {i}" for r in range(4) for i in range(2)]


def test_output_rank0_shows_rank_0_stderr_and_what_a_failing_rank_printed(ip, shared_cluster, capsys):
    """--output rank0: the other ranks' stdout is held back on the ranks (not sent), their stderr goes through,
    and a rank that fails shows what it had printed, before its traceback."""
    ip.run_cell_magic("taco_run", "--output rank0", "import sys\nprint('out', taco.rank())\n"
                      "if taco.rank() == 2:\n    print('err 2', file=sys.stderr)")
    captured = capsys.readouterr()
    assert rank_lines(captured.out) == {0: ["out 0"]}, captured.out
    assert "err 2" in captured.err or "err 2" in captured.out, (captured.out, captured.err)
    with pytest.raises(RankFailedError, match=r"rank 3 .*RuntimeError: boom"):
        ip.run_cell_magic("taco_run", "--output rank0",
                          "print('before', taco.rank())\nif taco.rank() == 3:\n    raise RuntimeError('boom')")
    lines = rank_lines(capsys.readouterr().out)
    assert lines[0] == ["before 0"] and 1 not in lines and 2 not in lines, lines
    assert any("held back by --output rank0" in line for line in lines[3]) and "before 3" in lines[3], lines
    ip.run_cell_magic("taco_run", "--output errors", "print('quiet', taco.rank())")
    assert rank_lines(capsys.readouterr().out) == {}
    with pytest.raises(Exception, match="--output"):
        ip.run_cell_magic("taco_run", "--output some", "pass")
    ip.run_cell_magic("taco_run", "", "print('loud', taco.rank())")  # the default at 4 ranks: all
    assert sorted(rank_lines(capsys.readouterr().out)) == [0, 1, 2, 3]


def test_quiet_hides_cluster_messages_but_not_output(ip, capsys):
    ip.run_cell_magic("taco_run", "-np 2 --cluster quiet --quiet", "print('hello')")
    captured = capsys.readouterr()
    assert "[taco]" not in captured.err and "[taco]" not in captured.out
    assert sorted(rank_lines(captured.out)) == [0, 1]


# ---------------------------------------------------------------- failures

def test_exception_on_one_rank_shows_its_traceback(ip, shared_cluster):
    pids = engine_pids()
    cell = "x = 1\nif taco.rank() == 2:\n    raise ValueError('bad shard')\nprint('fine')"
    with pytest.raises(RankFailedError) as info:
        ip.run_cell_magic("taco_run", "", cell)
    error = info.value
    assert str(error).startswith("rank 2 (host ")
    assert "ValueError: bad shard" in str(error) and "ranks 0, 1, 3 finished" in str(error)
    rendered = "\n".join(error._render_traceback_())
    assert "raise ValueError('bad shard')" in rendered and "[rank 2]" in rendered
    assert ip.run_cell_magic("taco_run", "--gather", "taco.rank()") == [0, 1, 2, 3]
    assert engine_pids() == pids  # same engines: nothing was restarted


def test_failed_rank_releases_peers_blocked_in_a_collective(ip, shared_cluster):
    pids = engine_pids()
    cell = "if taco.rank() == 1:\n    1 / 0\nx = torch.ones(4)\ntaco.allreduce(x)"
    # the peers' error is named with its message, not only its class; it is the group being shut down under them
    # (the collective timeout, TACO_COLLECTIVE_TIMEOUT's 1800 s, is far beyond the test's own timeout)
    with pytest.raises(RankFailedError, match=r"rank 1 .*ZeroDivisionError.*ranks 0, 2, 3 also failed \(\w+: .+\)") \
            as info:
        ip.run_cell_magic("taco_run", "", cell)
    assert "stalled" not in str(info.value) and "timed out" not in str(info.value).lower(), info.value
    # the process group is rebuilt on the same engines before the next cell
    assert ip.run_cell_magic("taco_run", "", ALLREDUCE_CELL) == [6.0, 6.0, 6.0]
    assert engine_pids() == pids


def interrupt_once_started(run: Callable[[], object], markers: Path, ranks: int) -> None:
    """Call ``run`` (a magic whose code writes ``markers/started-RANK`` when under way), press Ctrl-C (a real
    SIGINT, what the kernel's interrupt does) once all ``ranks`` have written theirs, and expect KeyboardInterrupt:
    the interrupt comes when the ranks are proven to be running, not a fixed time in."""
    failed: list[BaseException] = []

    def press_ctrl_c() -> None:
        try:
            wait_until(lambda: len(list(markers.glob("started-*"))) == ranks, 60, f"{ranks} ranks starting the cell")
        except AssertionError as exc:
            failed.append(exc)
        os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c, daemon=True)
    presser.start()
    with pytest.raises(KeyboardInterrupt):
        run()
    presser.join()
    assert not failed, failed[0]


def started(markers: Path) -> str:
    """A line of a cell or script that writes ``markers/started-RANK``: this rank is under way."""
    return f"open(f'{markers}/started-{{taco.rank()}}', 'w').close()\n"


@pytest.mark.parametrize("body", [
    "try:\n    wait_for_gate()\nexcept KeyboardInterrupt:\n"
    "    open(f'{MARKERS}/interrupted-{taco.rank()}', 'w').close()\n    raise\n",
    # rank 0 never joins: the others wait in a collective when the interrupt comes
    "if taco.rank() == 0:\n    wait_for_gate()\nx = torch.ones(2)\ntaco.allreduce(x)\n",
], ids=["every-rank-in-python", "peers-waiting-in-a-collective"])
def test_ctrl_c_interrupts_every_rank_and_keeps_the_cluster(ip, shared_cluster, body, sigint_as_in_a_kernel,
                                                            tmp_path):
    """The ranks wait for a gate nobody opens (for 120 s, then they raise): the cell ends in KeyboardInterrupt
    only because Ctrl-C stopped them, and the same engines run the next cell (a rank still in the old cell or
    its collective would hold it up)."""
    pids = engine_pids()
    cell = gate_code(tmp_path / "never", "Ctrl-C never reached this rank") + started(tmp_path) + \
        body.replace("{MARKERS}", str(tmp_path))
    interrupt_once_started(lambda: ip.run_cell_magic("taco_run", "", cell), tmp_path, 4)
    if "interrupted-" in body:
        wait_until(lambda: len(list(tmp_path.glob("interrupted-*"))) == 4, 30, "KeyboardInterrupt on every rank")
    assert engine_pids() == pids
    assert ip.run_cell_magic("taco_run", "", ALLREDUCE_CELL) == [6.0, 6.0, 6.0]


def test_ctrl_c_shows_the_users_traceback_not_tacos(ip, shared_cluster, sigint_as_in_a_kernel, tmp_path, capsys):
    """What IPython prints for an interrupted cell (``showtraceback``, as the notebook shows it) is the notice and
    the user's own frames: where the ranks were in the cell, and the KeyboardInterrupt; none of taco's frames."""
    cell = gate_code(tmp_path / "never", "Ctrl-C never reached this rank") + started(tmp_path) + "wait_for_gate()\n"
    results = []
    interrupt_once_started(lambda: results.append(ip.run_cell(f"%%taco_run\n{cell}")) or
                           results[-1].raise_error(), tmp_path, 4)
    shown = capsys.readouterr()
    assert "[taco] Interrupted: sending SIGINT to ranks 0-3" in shown.err or "Interrupted: sending SIGINT" in shown.err
    assert isinstance(results[0].error_in_exec, KeyboardInterrupt)
    assert "KeyboardInterrupt" in shown.out and "wait_for_gate()" in shown.out, shown.out
    assert "taco_notebook" not in shown.out and "run_cell_magic" not in shown.out, shown.out
    assert "__taco_result__" not in shown.out, shown.out  # the cell's last line as the user wrote it
    assert ip.run_cell_magic("taco_run", "", ALLREDUCE_CELL) == [6.0, 6.0, 6.0]


def test_ctrl_c_on_ranks_that_ignore_sigint_kills_and_restarts(ip, capsys, sigint_as_in_a_kernel, tmp_path):
    ip.run_cell_magic("taco_run", "-np 2 --cluster stubborn", "pass")
    old = engine_pids("stubborn")
    # blocked in a sleep with SIGINT masked, the ranks cannot see Ctrl-C (a Python loop would: the flag that
    # another thread's handler sets is checked between bytecodes); only killing them ends the cell before 120 s
    cell = ("import signal, time\nsignal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])\n" + started(tmp_path)
            + "time.sleep(120)\n")
    interrupt_once_started(lambda: ip.run_cell_magic("taco_run", "--cluster stubborn", cell), tmp_path, 2)
    assert "ignored SIGINT" in capsys.readouterr().err
    # killed with SIGKILL and not waited for (Ctrl-C returns at once; stop() reaps them): gone soon after
    wait_until(lambda: not any(pid in session_processes() for pid in old), 30, "the stubborn ranks to be killed")
    assert ip.run_cell_magic("taco_run", "--cluster stubborn --gather", "taco.rank()") == [0, 1]
    assert set(engine_pids("stubborn")).isdisjoint(old)


@pytest.mark.parametrize("how, signame", [
    ("os.kill(os.getpid(), signal.SIGKILL)", "SIGKILL"),
    ("import ctypes; ctypes.string_at(0)", "SIGSEGV"),
])
def test_dead_rank_is_reported_and_the_next_cell_gets_a_fresh_cluster(ip, how, signame, tmp_path):
    ip.run_cell_magic("taco_run", "-np 3 --cluster doomed", "pass")
    old = engine_pids("doomed")
    # rank 1 dies once all three are under way; the others wait for a gate nobody opens: the error can only
    # come from the death, not from the cell ending
    cell = (gate_code(tmp_path / "never", "nobody reported rank 1's death") + started(tmp_path) +
            f"import os, signal\nif taco.rank() == 1:\n{WAIT_FOR_3}\n    {how}\nwait_for_gate()")
    with pytest.raises(RankDiedError) as info:
        ip.run_cell_magic("taco_run", "--cluster doomed", cell.replace("{MARKERS}", str(tmp_path)))
    error = info.value
    assert (error.rank, error.signal_name) == (1, signame)
    assert error.host and f"rank 1 (host {error.host}, pid {old[1]})" in str(error)
    assert "ranks 0, 2 stopped by MPI with it." in str(error)
    assert not any(pid in session_processes() for pid in old)
    assert ip.run_cell_magic("taco_run", "--cluster doomed --gather", "taco.rank()") == [0, 1, 2]


def test_a_dead_ranks_error_names_every_ranks_fate(ip, tmp_path):
    """4 ranks, rank 2 killed with SIGKILL once rank 1 has finished the cell; ranks 0 and 3 wait for a gate nobody
    opens, so MPI stops them with the job."""
    ip.run_cell_magic("taco_run", "-np 4 --cluster fates", "pass")
    pids = engine_pids("fates")
    cell = (gate_code(tmp_path / "never", "nobody reported rank 2's death") + started(tmp_path) +
            f"import os, signal, time\nif taco.rank() == 2:\n{WAIT_FOR_3}\n"
            f"    while not os.path.exists('{tmp_path}/finished-1'):\n        time.sleep(0.02)\n"
            "    time.sleep(1.0)  # rank 1's reply on its way to the notebook\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            f"if taco.rank() in (0, 3):\n    wait_for_gate()\n"
            f"if taco.rank() == 1:\n    open('{tmp_path}/finished-1', 'w').close()\n")
    with pytest.raises(RankDiedError) as info:
        ip.run_cell_magic("taco_run", "--cluster fates", cell.replace("{MARKERS}", str(tmp_path)))
    message = str(info.value)
    assert message.startswith(f"rank 2 (host {info.value.host}, pid {pids[2]}) killed by SIGKILL"), message
    assert "; ranks 0, 3 stopped by MPI with it; rank 1 finished. Cluster 'fates' was shut down" in message


def test_timeout_names_the_ranks_still_running(ip, shared_cluster, tmp_path):
    pids = engine_pids()
    # rank 3 waits for a gate nobody opens: the cell ends only by its timeout, which interrupts rank 3
    cell = (gate_code(tmp_path / "never", "--timeout never stopped rank 3") + "if taco.rank() == 3:\n"
            f"    try:\n        wait_for_gate()\n    except KeyboardInterrupt:\n"
            f"        open('{tmp_path}/interrupted-3', 'w').close()\n        raise\n")
    with pytest.raises(CellTimeoutError, match=r"timed out after 2 s .*with rank 3 still running") as info:
        ip.run_cell_magic("taco_run", "--timeout 2", cell)
    assert info.value.running == [3] and "killed" not in str(info.value)
    wait_until((tmp_path / "interrupted-3").exists, 30, "the timeout's KeyboardInterrupt on rank 3")
    assert engine_pids() == pids
    assert ip.run_cell_magic("taco_run", "--gather", "taco.rank()") == [0, 1, 2, 3]


# ---------------------------------------------------------------- bad input starts nothing

@pytest.mark.parametrize("line, message", [
    ("-np 0", "-np must be a positive integer, got '0'"),
    ("-np abc", "-np must be a positive integer, got 'abc'"),
    ("-np 2 --frobnicate", "unrecognized arguments: --frobnicate"),
    ("-np 4 --targets 7", "--targets '7' names rank 7, outside 0..3 for -np 4"),
    ("-np 4 --targets x", "--targets must be ranks like"),
    ("-np 2 --timeout -1", "--timeout must be a positive number of seconds, got '-1'"),
    ("-np 2 --cluster fresh --mpiexec /nonexistent/mpiexec", "mpiexec '/nonexistent/mpiexec' does not run"),
    ("-np 2 --compression gzip", "unknown compression 'gzip'; use none, fp16, bf16 or topk:RATIO"),
    ("-np 2 --compression topk:2", "ratio"),
    ("-np 2 --algorithm 3d", "unknown algorithm '3d'; use auto, flat, 2d"),
    ("-np 2 --fusion-mb lots", "--fusion-mb must be a number of megabytes >= 0, got 'lots'"),
    ("-np 4 --intra-size 3", "--intra-size 3 must divide -np 4"),
])
def test_bad_input_is_a_usage_error_and_starts_nothing(ip, line, message):
    before = set(session_processes())
    names = set(clusters)
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("taco_run", line, "print('never runs')")
    assert message in str(info.value)
    assert set(clusters) == names
    assert set(session_processes()) <= before


def test_engines_that_fail_to_start_stop_everything_and_say_why(ip, tmp_path):
    broken = tmp_path / "mpiexec"
    broken.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'HYDRA build details:'; exit 0; fi\n"
                      "echo 'cannot place ranks: no slots on host n7' >&2\nexit 3\n")
    broken.chmod(0o755)
    before = set(session_processes())
    expected = r"(?s)failed to start: the engines' mpiexec exited.*no slots on host n7"
    with pytest.raises(ClusterStartError, match=expected):
        ip.run_cell_magic("taco_run", f"-np 2 --cluster broken --mpiexec {broken}", "pass")
    assert "broken" not in clusters
    assert set(session_processes()) <= before  # the controller it started is gone too


def test_no_mpiexec_on_path_says_how_to_install(ip, monkeypatch, tmp_path):
    import taco_notebook.cluster.launch.mpi as mpi

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(mpi.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(UsageError, match=r"no mpiexec found .* `pip install mpich mpi4py`"):
        ip.run_cell_magic("taco_run", "-np 2 --cluster nompi", "pass")
    assert "nompi" not in clusters


def test_cell_options_choose_the_allreduce_for_that_cell_only(ip):
    cell = ("s = taco.settings()\nt = torch.full((300_000,), 1.0)\ntaco.metrics.reset()\ntaco.allreduce(t)\n"
            "(taco.num_nodes(), s.algorithm, s.compression, s.fusion_mb, round(taco.metrics.snapshot()"
            "['compression_ratio']), t[0].item() > 0)")
    value = ip.run_cell_magic(
        "taco_run", "-np 4 --cluster layout --intra-size 2 --algorithm 2d --compression topk:0.01:threshold=0 "
        "--fusion-mb 8", cell)
    assert value[:4] == (2, "2d", CompressionSpec.parse("topk:0.01:threshold=0"), 8.0)  # the value, both ways
    assert value[4] >= 40 and value[5]  # 1% of the values plus their indices crossed the nodes
    assert ip.run_cell_magic("taco_run", "--cluster layout", "taco.settings().compression.name") == "none"


# ---------------------------------------------------------------- cluster lifecycle

def test_warm_cluster_is_reused_and_a_new_size_restarts_it(ip, capsys):
    ip.run_cell_magic("taco_run", "-np 2 --cluster sized", "pass")
    first = engine_pids("sized")
    ip.run_cell_magic("taco_run", "-np 2 --cluster sized", "pass")
    assert engine_pids("sized") == first
    capsys.readouterr()
    assert ip.run_cell_magic("taco_run", "-np 3 --cluster sized --gather", "taco.size()") == [3, 3, 3]
    assert "has 2 ranks; restarting it with -np 3: the engines' variables are lost" in capsys.readouterr().err
    assert not any(pid in session_processes() for pid in first)


def test_taco_cluster_start_status_list_restart_stop(ip, capsys):
    ip.run_line_magic("taco_cluster", "start -n 2 --cluster managed")
    pids = engine_pids("managed")
    capsys.readouterr()
    ip.run_line_magic("taco_cluster", "status --cluster managed")
    status = capsys.readouterr().out
    assert "cluster 'managed': running, 2/2 engines up" in status
    assert "MPI: mpich" in status
    for pid in pids:
        assert str(pid) in status
    ip.run_line_magic("taco_cluster", "list")
    assert "managed: running, 2/2 engines" in capsys.readouterr().out
    ip.run_line_magic("taco_cluster", "restart --cluster managed")
    assert set(engine_pids("managed")).isdisjoint(pids)
    tree = {p.pid for p in clusters["managed"].processes}
    ip.run_line_magic("taco_cluster", "stop --cluster managed")
    assert "managed" not in clusters
    assert not tree & set(session_processes())
    with pytest.raises(UsageError, match="no cluster named 'managed' is running"):
        ip.run_line_magic("taco_cluster", "stop --cluster managed")
