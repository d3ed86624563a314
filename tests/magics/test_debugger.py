"""The debugger for N ranks through the magics, on real ranks: ``%taco_debug`` in a failed rank's frame,
``%taco_peek`` from a second process into a running cell, ``%taco_diff`` naming the rank and index that differ."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from taco_notebook.cluster.session import clusters
from taco_notebook.errors import RankFailedError

pytestmark = pytest.mark.cluster

FAILING = textwrap.dedent("""\
    def compute(scale):
        secret = 40 + scale
        raise ValueError(f"bad scale {scale}")
    if taco.rank() == 2:
        compute(2)
    """)


def test_debug_reads_the_failed_ranks_local_and_walks_up(ip, shared_cluster, capsys):
    with pytest.raises(RankFailedError, match="rank 2 .*ValueError: bad scale 2"):
        ip.run_cell_magic("taco_run", "", FAILING)
    capsys.readouterr()
    ip.run_line_magic("taco_debug", '-c "p secret; up; p taco.rank(); p scale"')
    shown = capsys.readouterr().out
    assert "ValueError: bad scale 2" in shown
    assert "(Pdb rank 2) p secret\n42\n" in shown, shown
    assert "(Pdb rank 2) p taco.rank()\n2\n" in shown, shown
    assert "*** NameError: name 'scale' is not defined" in shown, shown  # `up` left compute's frame for the cell's
    assert "runner.py" not in shown and "interactiveshell" not in shown  # the engine's frames are cut
    # the other ranks held nothing and are free: the cluster runs the next cell, which drops the failure
    assert ip.run_cell_magic("taco_run", "--gather", "taco.rank()") == [0, 1, 2, 3]
    with pytest.raises(UsageError, match="no rank of cluster 'default' holds a failed cell"):
        ip.run_line_magic("taco_debug", "-c 'p 1'")


def test_debug_of_a_rank_that_did_not_fail_names_the_ones_that_did(ip, shared_cluster, capsys):
    with pytest.raises(RankFailedError):
        ip.run_cell_magic("taco_run", "", FAILING)
    with pytest.raises(UsageError, match=r"rank 1 holds no failed cell; rank 2 does: %taco_debug --rank 2"):
        ip.run_line_magic("taco_debug", "--rank 1 -c 'p 1'")
    capsys.readouterr()
    ip.run_line_magic("taco_debug", "--rank 2 -c 'p secret * 2; q; p 99'")
    shown = capsys.readouterr().out
    assert "\n84\n" in shown and "p 99" not in shown  # `q` ends the session: later commands are not sent


def test_debug_reads_commands_from_stdin_until_quit(ip, shared_cluster, capsys, monkeypatch):
    with pytest.raises(RankFailedError):
        ip.run_cell_magic("taco_run", "", FAILING)
    typed = iter(["p secret + 1", "where", "q"])
    prompts: list[str] = []
    monkeypatch.setattr("builtins.input", lambda prompt: prompts.append(prompt) or next(typed))
    capsys.readouterr()
    ip.run_line_magic("taco_debug", "")
    shown = capsys.readouterr().out
    assert prompts == ["(Pdb rank 2) "] * 3
    assert "\n43\n" in shown and "compute()" in shown


def test_diff_names_the_rank_and_index_that_differ(ip, shared_cluster, capsys):
    ip.run_cell_magic("taco_run", "", "xs = [1, 2, 30 if taco.rank() == 1 else 3, {'lr': 0.1}]\n"
                                      "w = torch.arange(4.0)")
    capsys.readouterr()
    ip.run_line_magic("taco_diff", "xs")
    assert capsys.readouterr().out == "xs differs across 4 ranks, first at [2]:\n  ranks 0, 2, 3: 3\n  rank 1: 30\n"
    ip.run_line_magic("taco_diff", "w")
    assert capsys.readouterr().out == "w: the same on ranks 0-3 (tensor float32[4], sum 6)\n"
    ip.run_cell_magic("taco_run", "--targets 3", "xs[3]['lr'] = 0.2")
    ip.run_line_magic("taco_diff", "xs[3]")
    assert capsys.readouterr().out.endswith("first at ['lr']:\n  ranks 0-2: 0.1\n  rank 3: 0.2\n")
    ip.run_line_magic("taco_diff", "nothing_here")
    assert "raised NameError: name 'nothing_here' is not defined" in capsys.readouterr().out


PEEKER = textwrap.dedent("""\
    import sys, time
    from IPython.testing.globalipapp import start_ipython
    shell = start_ipython()
    shell.run_line_magic("load_ext", "taco_notebook")
    cluster_id, flag = sys.argv[1], sys.argv[2]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        from io import StringIO
        from contextlib import redirect_stdout
        out = StringIO()
        with redirect_stdout(out):
            shell.run_line_magic("taco_peek", f"--cluster {cluster_id} --timeout 2 count > 0")
        if "ranks 0-3: True" in out.getvalue():
            break
        time.sleep(0.2)
    with redirect_stdout(StringIO()) as second:
        shell.run_line_magic("taco_peek", f"--cluster {cluster_id} --ranks 1,3 (taco.rank(), count > 0)")
    open(flag, "w").close()
    print(out.getvalue() + second.getvalue(), end="")
    """)


def test_peek_from_a_second_process_reads_a_running_cells_counter(ip, shared_cluster, tmp_path: Path):
    flag = tmp_path / "release"
    cluster = clusters["default"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    peeker = subprocess.Popen([sys.executable, "-c", PEEKER, cluster.cluster_id, str(flag)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killer = threading.Timer(90, peeker.kill)  # never outlive the test, whatever the cell does
    killer.start()
    try:
        cell = (f"import os, time\ncount = 0\nwhile not os.path.exists({str(flag)!r}):\n"
                "    count += 1\n    time.sleep(0.005)\ntaco.rank() * 10")
        result = ip.run_cell_magic("taco_run", "--gather", cell)
        out, err = peeker.communicate(timeout=60)
    finally:
        killer.cancel()
        if peeker.poll() is None:
            peeker.kill()
            peeker.communicate()
    assert result == [0, 10, 20, 30]  # the cell's own result, unchanged by the peeks
    lines = out.splitlines()
    assert lines[0].startswith("count > 0 on 4 ranks, read in ") and lines[1] == "ranks 0-3: True", (out, err)
    assert lines[2].startswith("(taco.rank(), count > 0) on 2 ranks") and lines[3:] == [
        "rank 1: (1, True)", "rank 3: (3, True)"], (out, err)
    assert len(lines) == 5, (out, err)  # the two reports and nothing else: no warning, no stray line


def test_peek_errors_are_said(ip, shared_cluster, capsys):
    ip.run_line_magic("taco_peek", "--timeout 0.5 undefined_name")
    assert capsys.readouterr().out.splitlines()[1] == (
        "ranks 0-3: raised NameError: name 'undefined_name' is not defined")
    ip.run_line_magic("taco_peek", "--ranks 0 x = 1")
    assert "SyntaxError" in capsys.readouterr().out
    with pytest.raises(UsageError, match=r"--timeout must be seconds in \(0, 5\], got 9"):
        ip.run_line_magic("taco_peek", "--timeout 9 1")
    with pytest.raises(UsageError, match="--ranks '7' names rank 7, outside 0..3"):
        ip.run_line_magic("taco_peek", "--ranks 7 1")
    with pytest.raises(UsageError, match="no cluster named 'nosuch' runs in this kernel or in the registry"):
        ip.run_line_magic("taco_peek", "--cluster nosuch 1")


def test_debug_starts_in_the_users_frame_not_the_librarys(ip, shared_cluster, capsys):
    cell = "import json\ntext = '{' * (taco.rank() + 1)\njson.loads(text)"  # a last expression: the kernel rewrites it
    with pytest.raises(RankFailedError):
        ip.run_cell_magic("taco_run", "", cell)
    capsys.readouterr()
    ip.run_line_magic("taco_debug", "--rank 3 -c 'up; p text; down; p s'")
    shown = capsys.readouterr().out
    assert "-> json.loads(text)\n" in shown and "__taco_result__" not in shown, shown  # as the user wrote it
    assert "(Pdb rank 3) up\n*** Oldest frame\n" in shown, shown  # the engine's frames above the cell are cut
    assert "(Pdb rank 3) p text\n'{{{{'\n" in shown, shown
    assert "json/__init__.py" in shown and "(Pdb rank 3) p s\n'{{{{'\n" in shown, shown  # json's own frame
