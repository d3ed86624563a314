"""``taco-notebook run NOTEBOOK`` in a real kernel, on real ranks: the kernel's channels are IPC sockets in a
private directory (no TCP port off loopback, no ipykernel plain-text warning), and a normal run, its cluster
stopped at kernel shutdown, prints no warning or traceback."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from ..conftest import REPO

pytestmark = pytest.mark.cluster

PROBE = """\
import os, psutil
from ipykernel import get_connection_file, get_connection_info
info = get_connection_info(unpack=True)
# ipykernel's own loopback pipe for forked children's output (iostream.py) is the one TCP socket left
listening = [c.laddr for c in psutil.Process(os.getpid()).net_connections(kind="inet") if c.status == "LISTEN"
             and c.laddr.ip != "127.0.0.1"]
private = oct(os.stat(os.path.dirname(get_connection_file())).st_mode & 0o777)
print("transport", info["transport"], "tcp-listeners", len(listening), "private", private)
"""
NOISE = re.compile(r"warning|traceback|error", re.IGNORECASE)


def test_run_uses_ipc_and_a_normal_run_is_quiet(tmp_path: Path) -> None:
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(PROBE),
        nbformat.v4.new_code_cell("%load_ext taco_notebook"),
        nbformat.v4.new_code_cell("%%taco_run -np 2 --cluster quiet\n"
                                  "for step in taco.progress(range(20)):\n"
                                  "    t = torch.ones(1000)\n    taco.allreduce(t)\nprint('sum', t[0].item())"),
        # no %taco_cluster stop: the cluster goes down with the kernel, as when a user closes the notebook
    ])
    path = tmp_path / "quiet.ipynb"
    nbformat.write(notebook, path)
    done = subprocess.run([sys.executable, "-m", "taco_notebook", "run", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "transport ipc tcp-listeners 0 private 0o700" in done.stdout, done.stdout
    assert "[rank 0] sum 2.0" in done.stdout and "[rank 1] sum 2.0" in done.stdout, done.stdout
    assert "without encryption" not in done.stderr
    noise = [line for line in (done.stdout + done.stderr).splitlines() if NOISE.search(line)]
    assert not noise, done.stdout + done.stderr
