"""``%taco_run [options] SCRIPT ARGS``: an existing script on every rank of a real MPI-launched cluster (the
session's shared 4-rank cluster), as ``python SCRIPT ARGS`` would run it, with a cell's failure handling."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from taco_notebook.cluster.session import clusters
from taco_notebook.errors import RankFailedError

from ..conftest import session_processes
from ..support.waiting import gate_code, wait_until
from .test_magics import ALLREDUCE_CELL, engine_pids, interrupt_once_started, rank_lines, started

pytestmark = pytest.mark.cluster

# prints what python would have given it, as JSON, after an allreduce (the process group is the cluster's)
TRAIN = """\
import json, os, sys
import torch
import taco_notebook.comm as taco
from helper import VALUE  # a module beside the script: its directory is on sys.path

t = torch.ones(2) * taco.rank()
taco.allreduce(t)
print(json.dumps({"argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0], "value": VALUE,
                  "sum": t.tolist(), "main": sys.modules["__main__"].__dict__ is globals()}))
if "--exit" in sys.argv:
    sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
"""


@pytest.fixture
def script_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory with train.py and its helper module, made the kernel's working directory."""
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "helper.py").write_text("VALUE = 42\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def reports(out: str) -> dict[int, dict]:
    return {rank: json.loads(lines[-1]) for rank, lines in rank_lines(out).items()}


def test_a_script_runs_on_every_rank_as_python_runs_it(ip, shared_cluster, script_dir, capsys):
    """sys.argv (the magic's own options after the script included), __name__, __file__, sys.path, then the
    engine is as it was: the next cell sees its own argv, path and __main__."""
    assert ip.run_line_magic("taco_run", "--quiet train.py --lr 0.1 -np 3 --quiet") is None
    found = reports(capsys.readouterr().out)
    assert sorted(found) == [0, 1, 2, 3]
    script = str(script_dir / "train.py")
    for rank, report in found.items():
        assert report["argv"] == [script, "--lr", "0.1", "-np", "3", "--quiet"], rank
        assert (report["name"], report["file"], report["path0"]) == ("__main__", script, str(script_dir))
        assert report["value"] == 42 and report["sum"] == [6.0, 6.0] and report["main"]
    left = ip.run_cell_magic("taco_run", "--gather", f"import sys\n(sys.argv, {str(script_dir)!r} in sys.path, "
                                                     "sys.modules['__main__'].__dict__.get('__file__'))")
    assert all(argv != found[0]["argv"] and not on_path and file != script for argv, on_path, file in left), left


def test_exit_status_zero_is_success_and_any_other_fails_naming_it(ip, shared_cluster, script_dir, capsys):
    ip.run_line_magic("taco_run", "--quiet train.py --exit 0")
    with pytest.raises(RankFailedError, match=r"rank 0 .*ScriptExit: train.py called sys.exit\(status 3\)"):
        ip.run_line_magic("taco_run", "--quiet train.py --exit 3")
    assert ip.run_cell_magic("taco_run", "", ALLREDUCE_CELL) == [6.0, 6.0, 6.0]


def test_help_after_the_script_is_the_scripts(ip, shared_cluster, tmp_path, capsys):
    (tmp_path / "cli.py").write_text("import argparse\nparser = argparse.ArgumentParser(prog='cli')\n"
                                     "parser.add_argument('--epochs', type=int)\nparser.parse_args()\n")
    ip.run_line_magic("taco_run", f"--quiet --targets 0 {tmp_path / 'cli.py'} --help")
    out = capsys.readouterr().out
    assert "[rank 0] usage: cli [-h] [--epochs EPOCHS]" in out and "%taco_run" not in out


def test_a_script_raising_on_one_rank_fails_naming_it_from_the_scripts_frames(ip, shared_cluster, tmp_path):
    (tmp_path / "bad.py").write_text("import taco_notebook.comm as taco\n\n"
                                     "if taco.rank() == 2:\n    raise ValueError('bad shard')\nprint('fine')\n")
    pids = engine_pids()
    with pytest.raises(RankFailedError) as info:
        ip.run_line_magic("taco_run", f"--quiet {tmp_path / 'bad.py'}")
    assert str(info.value).startswith("rank 2 (host ")
    assert "ValueError: bad shard" in str(info.value) and "ranks 0, 1, 3 finished" in str(info.value)
    rendered = "\n".join(info.value._render_traceback_())
    assert f"{tmp_path / 'bad.py'}:4" in rendered and "raise ValueError('bad shard')" in rendered
    assert "run_on_rank" not in rendered  # the traceback starts in the script, not in what ran it
    assert ip.run_cell_magic("taco_run", "--gather", "taco.rank()") == [0, 1, 2, 3]
    assert engine_pids() == pids


def test_ctrl_c_interrupts_a_script_on_every_rank(ip, shared_cluster, tmp_path, sigint_as_in_a_kernel):
    """The script waits for a gate nobody opens (120 s, then it raises): only Ctrl-C, pressed once every rank
    is under way, ends it, with KeyboardInterrupt raised in the script on every rank."""
    (tmp_path / "slow.py").write_text(
        "import taco_notebook.comm as taco\n" + gate_code(tmp_path / "never", "Ctrl-C never reached the script")
        + started(tmp_path) + "try:\n    wait_for_gate()\nexcept KeyboardInterrupt:\n"
        f"    open(f'{tmp_path}/interrupted-{{taco.rank()}}', 'w').close()\n    raise\n")
    pids = engine_pids()
    interrupt_once_started(lambda: ip.run_line_magic("taco_run", f"--quiet {tmp_path / 'slow.py'}"), tmp_path, 4)
    wait_until(lambda: len(list(tmp_path.glob("interrupted-*"))) == 4, 30, "KeyboardInterrupt on every rank")
    assert engine_pids() == pids
    assert ip.run_cell_magic("taco_run", "", ALLREDUCE_CELL) == [6.0, 6.0, 6.0]


def test_a_script_feeds_the_dashboard(ip, shared_cluster, tmp_path, capsys):
    (tmp_path / "steps.py").write_text(
        "import torch\nimport taco_notebook.comm as taco\n"
        "for step in taco.progress(range(5)):\n    t = torch.ones(1000)\n    taco.allreduce(t)\n")
    ip.run_line_magic("taco_run", f"--quiet --dashboard text {tmp_path / 'steps.py'}")
    out = capsys.readouterr().out
    assert "taco dashboard: cluster 'default' · finished · 4 ranks" in out, out
    assert "progress: 5/5 (100%)" in out and "links: node 0->0 (intra)" in out, out


@pytest.mark.parametrize("line, message", [
    ("-np 2", "%taco_run needs a script: %taco_run -np 4 train.py"),
    ("-np 2 nowhere/train.py --epochs 1", "no script at nowhere/train.py (looked for "),
    ("-np 2 .", "is a directory"),
    ("-np 2 --compression gzip train.py", "unknown compression 'gzip'"),
])
def test_a_bad_script_line_is_a_usage_error_and_starts_nothing(ip, tmp_path, monkeypatch, line, message):
    (tmp_path / "train.py").write_text("print('never runs')\n")
    monkeypatch.chdir(tmp_path)
    before, names = set(session_processes()), set(clusters)
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("taco_run", "--cluster never " + line)
    assert message in str(info.value)
    assert set(clusters) == names and set(session_processes()) <= before


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file: an unreadable script cannot be made")
def test_an_unreadable_script_is_a_usage_error(ip, tmp_path):
    locked = tmp_path / "locked.py"
    locked.write_text("print('never runs')\n")
    locked.chmod(0)
    with pytest.raises(UsageError, match="permission denied; make it readable"):
        ip.run_line_magic("taco_run", f"-np 2 --cluster never {locked}")


def test_a_cell_takes_no_script(ip):
    with pytest.raises(UsageError, match=r"takes no script \(got 'train.py'\).*%taco_run train.py --lr 1"):
        ip.run_cell_magic("taco_run", "-np 2 --cluster never train.py --lr 1", "print('never runs')")
