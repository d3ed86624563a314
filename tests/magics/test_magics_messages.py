"""What the magics say: size limits, ``--help`` in every form, informational lines on stdout and warnings on
stderr, no stray progress bar, and failure summaries that name the error with correct plurals.

Real IPython shell, real MPI-launched engines (the conftest's leak check proves a refused size started nothing).
"""

from __future__ import annotations

import re

import pytest
from ipyparallel.error import RemoteError
from IPython.core.error import UsageError

from taco_notebook.cluster.cells.reporting import SUMMARY_ERROR_CHARS, error_kinds, error_line, ranks_phrase
from taco_notebook.cluster.launch.limits import MAX_RANKS_ENV, max_ranks
from taco_notebook.cluster.session import clusters
from taco_notebook.errors import RankFailedError

from ..conftest import session_processes
from .test_magics import engine_pids

pytestmark = pytest.mark.cluster

TQDM_BAR = re.compile(r"\d+%\||engine/s|\d+/\d+ \[")


# ---------------------------------------------------------------- limits

@pytest.mark.parametrize("magic, line", [
    ("taco_run", "-np 100000"),
    ("taco_run", "-np 100000 --cluster huge"),
    ("taco_cluster", "start -n 100000 --cluster huge"),
    ("taco_cluster", "restart -n 100000 --cluster huge"),
])
def test_a_size_over_the_limit_is_a_usage_error_and_starts_nothing(ip, magic, line):
    before = set(session_processes())
    names = set(clusters)
    with pytest.raises(UsageError) as info:
        if magic == "taco_run":
            ip.run_cell_magic(magic, line, "print('never runs')")
        else:
            ip.run_line_magic(magic, line)
    message = str(info.value)
    assert f"100000 is over the limit of {max_ranks()} ranks" in message
    assert MAX_RANKS_ENV in message
    assert set(clusters) == names
    assert set(session_processes()) <= before


def test_a_resize_over_the_limit_leaves_the_running_cluster_alone(ip, shared_cluster):
    pids = engine_pids()
    with pytest.raises(UsageError, match=f"over the limit.*{MAX_RANKS_ENV}"):
        ip.run_cell_magic("taco_run", "-np 100000", "pass")
    assert engine_pids() == pids and clusters["default"].running
    assert ip.run_cell_magic("taco_run", "--gather", "taco.rank()") == [0, 1, 2, 3]


def test_the_limit_follows_taco_max_ranks(ip, monkeypatch):
    monkeypatch.setenv(MAX_RANKS_ENV, "2")
    before = set(session_processes())
    with pytest.raises(UsageError, match=r"-np 3 is over the limit of 2 ranks"):
        ip.run_cell_magic("taco_run", "-np 3 --cluster capped", "pass")
    monkeypatch.setenv(MAX_RANKS_ENV, "lots")
    with pytest.raises(UsageError, match=f"{MAX_RANKS_ENV} must be a positive integer, got 'lots'"):
        ip.run_line_magic("taco_cluster", "start -n 2 --cluster capped")
    assert "capped" not in clusters
    assert set(session_processes()) <= before


# ---------------------------------------------------------------- help

@pytest.mark.parametrize("cell, shown", [
    ("%%taco_run --help\nprint('never runs')", "usage: %%taco_run [-np N]"),
    ("%%taco_run -np 2 -h\nprint('never runs')", "usage: %%taco_run [-np N]"),
    ("%taco_run --help", "usage: %taco_run [-np N]"),
    ("%taco_cluster --help", "usage: %taco_cluster [-n N]"),
    ("%taco_cluster start --help", "usage: %taco_cluster [-n N]"),
])
def test_help_prints_the_usage(ip, capsys, cell, shown):
    before = set(session_processes())
    result = ip.run_cell(cell)
    captured = capsys.readouterr()
    assert result.success, result.error_in_exec
    assert shown in captured.out
    assert "--cluster NAME" in captured.out and "never runs" not in captured.out
    assert captured.err == ""
    assert set(session_processes()) <= before


@pytest.mark.parametrize("cell", ["%taco_run?", "%%taco_run?", "%taco_cluster?"])
def test_question_mark_shows_the_docstring_with_usage(ip, capsys, cell):
    result = ip.run_cell(cell)
    out = capsys.readouterr().out
    assert result.success
    assert "Object `" not in out  # IPython's "not found"
    assert "--cluster NAME" in out and ("[-np N]" in out or "[-n N]" in out)


def test_taco_run_as_a_line_magic_says_to_use_two_percent_signs(ip):
    with pytest.raises(UsageError, match=r"put %%taco_run \(two %\)"):
        ip.run_line_magic("taco_run", "-np 2")


# ---------------------------------------------------------------- stdout, stderr, no progress bar

def test_start_messages_go_to_stdout_with_no_progress_bar(ip, capsys):
    ip.run_cell_magic("taco_run", "-np 2 --cluster chatty", "print('hi')")
    captured = capsys.readouterr()
    assert "[taco] starting cluster 'chatty': 2 ranks" in captured.out
    assert re.search(r"\[taco\] cluster 'chatty' ready in [\d.]+ s", captured.out)
    assert "[taco]" not in captured.err
    assert not TQDM_BAR.search(captured.out) and not TQDM_BAR.search(captured.err), captured
    ip.run_line_magic("taco_cluster", "stop --cluster chatty")
    captured = capsys.readouterr()
    assert "[taco] cluster 'chatty' stopped" in captured.out and captured.err == ""


def test_restart_warns_on_stderr_that_variables_are_lost(ip, capsys):
    ip.run_line_magic("taco_cluster", "start -n 2 --cluster renewed")
    capsys.readouterr()
    ip.run_line_magic("taco_cluster", "restart --cluster renewed")
    captured = capsys.readouterr()
    assert "[taco] restarting cluster 'renewed': the engines' variables are lost" in captured.err
    assert "ready in" in captured.out and not TQDM_BAR.search(captured.out + captured.err)


def test_a_rank_failure_warns_on_stderr(ip, shared_cluster, capsys):
    cell = "import time\nif taco.rank() == 0:\n    raise KeyError('k')\ntime.sleep(1)"
    with pytest.raises(RankFailedError):
        ip.run_cell_magic("taco_run", "", cell)
    err = capsys.readouterr().err
    assert "[taco] rank 0 raised KeyError: 'k'; waiting for the other ranks" in err


# ---------------------------------------------------------------- failure summaries

def test_summary_names_each_error_in_a_line_and_counts_right(ip, shared_cluster):
    cell = ("import time\nif taco.rank() == 0:\n    raise ValueError('first line\\nsecond line')\n"
            "time.sleep(0.5)\nif taco.rank() == 1:\n    raise RuntimeError('later')\n")
    with pytest.raises(RankFailedError) as info:
        ip.run_cell_magic("taco_run", "--targets 0-2", cell)
    message = str(info.value)
    assert re.match(r"rank 0 \(host [^)]+\) raised ValueError: first line…; ", message), message
    assert "; rank 1 also failed (RuntimeError: later)" in message
    assert message.endswith("; rank 2 finished")
    assert "second line" not in message


def test_summary_plurals_and_distinct_errors():
    errors = {1: RemoteError("RuntimeError", "Connection closed by peer", ""),
              2: RemoteError("RuntimeError", "Connection closed by peer", ""),
              3: RemoteError("DistBackendError", "x" * 300, "")}
    assert ranks_phrase([2]) == "rank 2" and ranks_phrase([3, 1]) == "ranks 1, 3"
    assert error_kinds({k: errors[k] for k in (1, 2)}) == "RuntimeError: Connection closed by peer"
    both = error_kinds(errors)
    assert both.startswith("ranks 1, 2: RuntimeError: Connection closed by peer; rank 3: DistBackendError: x")
    assert both.endswith("…") and len(error_line(errors[3])) == SUMMARY_ERROR_CHARS
    assert error_line(RemoteError("KeyboardInterrupt", "", "")) == "KeyboardInterrupt"


@pytest.mark.parametrize("code, shown", [
    ("from torch import nn\nimport time\n\nmodel = nn.Linear(2, 1)\nfor s in taco.progress(range(9)): pass",
     "model = nn.Linear(2, 1)"),  # the first line that does something, not its imports
    ("# warm-up run\nimport torch\nx = torch.ones(2)", "warm-up run"),  # a comment that opens the cell names it
    ("import torch\nimport time", "import torch"),  # nothing but imports: the first of them
    ("%time x = 1\ny = 2", "y = 2"),
])
def test_the_sidebar_names_a_cell_by_what_it_does(code: str, shown: str) -> None:
    from taco_notebook.cluster.cells.reporting import cell_snippet

    assert cell_snippet(code) == shown
