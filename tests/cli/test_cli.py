"""``taco-notebook run|launch|doctor|emulate`` (and ``python -m taco_notebook …``): one command line whose help
lists its four commands, each with its own ``--help``, and whose usage mistakes exit 2 with argparse's message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from taco_notebook.cli import main

from ..conftest import REPO

COMMANDS = ("run", "launch", "doctor", "emulate")


def test_help_lists_the_four_commands_one_line_each(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: taco-notebook ")
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("    ") and line.split()[0] in COMMANDS]
    assert listed == list(COMMANDS), out


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_its_help(capsys: pytest.CaptureFixture[str], command: str) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: taco-notebook {command} ")


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: COMMAND"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["doctor", "--bogus"], "unrecognized arguments: --bogus"),
    (["emulate", "up", "2y2"], "the nodes must be NODESxSLOTS"),
    (["run", "no-such.ipynb"], "no notebook at no-such.ipynb"),
])
def test_a_usage_mistake_exits_2_with_argparse_message(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                       message: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_python_dash_m_is_the_same_command_and_loads_no_magics() -> None:
    code = ("import sys, runpy; sys.argv = ['taco_notebook', 'emulate', '--help']\n"
            "try:\n    runpy.run_module('taco_notebook', run_name='__main__')\nexcept SystemExit as e:\n"
            "    assert e.code == 0\n"
            "assert not [m for m in sys.modules if m.startswith(('IPython', 'taco_notebook.magics'))], sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m taco_notebook emulate "), done.stdout
