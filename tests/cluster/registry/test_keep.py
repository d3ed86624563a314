"""Ranks that outlive their kernel: a kernel process keeps its cluster and is killed; the sidebar shows it kept; a
new kernel adopts it and reads a variable set before the first kernel died; an unadopted one is stopped after
its idle time. Real kernels' processes (IPython shells in subprocesses), real ranks, the real reaper."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import psutil
import pytest
from IPython.core.error import UsageError

from taco_notebook.cluster.registry.files import read_models, registry_dir
from taco_notebook.cluster.registry.keep import AdoptedCluster
from taco_notebook.cluster.session import clusters

pytestmark = pytest.mark.cluster

FIRST_KERNEL = textwrap.dedent("""\
    import sys
    from IPython.testing.globalipapp import start_ipython
    ip = start_ipython()
    ip.run_line_magic("load_ext", "taco_notebook")
    name = sys.argv[1]
    ip.run_line_magic("taco_cluster", f"start -n 2 --cluster {name}")
    ip.run_cell_magic("taco_run", f"--cluster {name}", "secret = 40 + taco.rank()\\nt = torch.arange(3.0)")
    ip.run_line_magic("taco_cluster", f"keep --cluster {name}")
    print("kept", flush=True)
    if sys.argv[2] == "wait":
        sys.stdin.read()  # until the test kills this kernel
    """)


def _kernel(name: str, then: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    kernel = subprocess.Popen([sys.executable, "-c", FIRST_KERNEL, name, then], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **(env or {})})
    assert kernel.stdout is not None
    said = []
    for line in kernel.stdout:  # its notices first ("[taco] cluster ... is kept: ..."), then ours
        said.append(line)
        if line == "kept\n":
            return kernel
    kernel.wait()
    raise AssertionError(f"the first kernel did not keep its cluster:\n{''.join(said)}{kernel.stderr.read()}")


def _model(name: str) -> dict | None:
    return next((m for m in read_models(registry_dir()) if m["name"] == name), None)


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout} s")
        time.sleep(0.25)


@pytest.fixture
def gone() -> Iterator[list[int]]:
    """Pids the test wants dead by its end, killed if they are not (the test failed midway)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


def test_a_kept_cluster_outlives_its_killed_kernel_and_a_new_kernel_adopts_it(ip, gone):
    kernel = _kernel("keptone", "wait")
    gone.append(kernel.pid)
    model = _model("keptone")
    assert model is not None and model["state"] == "running" and model["owner"]["pid"] == kernel.pid
    with pytest.raises(UsageError, match="is kept by kernel .*, which still runs"):
        ip.run_line_magic("taco_cluster", "adopt keptone")
    kernel.send_signal(signal.SIGKILL)  # no exit hook runs: as a kernel killed by its manager
    kernel.communicate()
    shown = _model("keptone")
    assert shown is not None and shown["state"] == "stale", shown
    assert shown["error"].startswith("kept: its kernel (pid ") and "%taco_cluster adopt keptone" in shown["error"]

    ip.run_line_magic("taco_cluster", "adopt keptone")
    try:
        cluster = clusters["keptone"]
        assert isinstance(cluster, AdoptedCluster) and len(cluster.ranks) == 2
        assert ip.run_cell_magic("taco_run", "--cluster keptone --gather", "secret") == [40, 41]
        assert ip.run_cell_magic("taco_run", "--cluster keptone --gather",
                                 "float(taco.allreduce(t.clone()).sum())") == [6.0, 6.0]  # the group works too
        now = _model("keptone")
        assert now is not None and now["state"] == "running" and now["owner"]["pid"] == os.getpid()
        pids = [p.pid for p in cluster.processes]
    finally:
        ip.run_line_magic("taco_cluster", "stop --cluster keptone")
    _wait(lambda: not any(psutil.pid_exists(pid) for pid in pids), 30, "every process of the cluster gone")
    assert _model("keptone") is None


def test_an_unadopted_kept_cluster_is_stopped_after_its_idle_time(gone):
    kernel = _kernel("keptidle", "exit", {"TACO_KEEP_IDLE": "4"})
    kernel.communicate(timeout=60)  # a normal exit: its exit hook leaves the kept cluster running
    model = _model("keptidle")
    assert model is not None and "stopped 0.0666667 min after its kernel ended" in model["error"], model
    _wait(lambda: _model("keptidle") is None, 40, "reaped")


def test_adopt_and_keep_say_what_is_wrong(ip):
    with pytest.raises(UsageError, match="no kept cluster named 'nothing' waits to be adopted"):
        ip.run_line_magic("taco_cluster", "adopt nothing")
    with pytest.raises(UsageError, match="keep needs a running cluster of this kernel; none is named 'nope'"):
        ip.run_line_magic("taco_cluster", "keep --cluster nope")
