"""Fixtures that start real MPI-launched clusters and prove nothing outlives a test, and the two test tiers.

Every process a test starts inherits ``TACO_TEST_SESSION`` from this process, so after each test we can find
all of them (orphans included, whatever their parent) and fail the test if any is left that is not part of
the session's shared cluster.

Tiers: a test that starts a cluster, mpiexec, a Jupyter server or kernel, a browser or a root service carries
that marker (from the fixtures it uses, or its own mark) and so ``slow``; ``pytest -m "not slow"`` is the fast
tier. A test without the marker that starts such a process fails, naming it.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

SLOW_MARKERS = ("cluster", "mpi", "server", "browser", "services")
FIXTURE_MARKERS = {  # a test that uses the fixture starts what the marker names
    "shared_cluster": "cluster", "mpiexec": "mpi", "lab": "browser", "page": "browser", "jp_fetch": "server",
    "jp_serverapp": "server", "ipykernel6": "server", "slurm": "services",
}
# what a test of the fast tier must not start: matched against the program of every subprocess.Popen (its
# name, its first argument, and the module of ``python -m``)
HEAVY = re.compile(r"mpiexec|mpirun|ipengine|ipcontroller|ipyparallel|taco_notebook\.controller|jupyter|ipykernel|"
                   r"chrom|playwright|sshd|slurm|srun|sbatch|salloc|munge|netns|unshare")
_started: list[str] = []


def _program(argv: str | list[Any]) -> str:
    words = argv.split() if isinstance(argv, str) else [str(word) for word in argv]
    if not words:
        return ""
    program = [os.path.basename(words[0])]
    if len(words) > 1 and not words[1].startswith("-"):
        program.append(words[1])
    if "-m" in words[1:-1]:
        program.append(words[words.index("-m") + 1])
    return " ".join(program)


def _record_popen(event: str, args: tuple[Any, ...]) -> None:
    if event == "subprocess.Popen":
        _started.append(_program(args[1]))


sys.addaudithook(_record_popen)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test by the fixtures it uses, then ``slow`` when it carries any marker of a slow tier."""
    for item in items:
        if item.path.suffix == ".ipynb":  # an example notebook: a kernel that starts a cluster
            item.add_marker("cluster")
        for fixture, marker in FIXTURE_MARKERS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)
        if any(item.get_closest_marker(marker) for marker in SLOW_MARKERS):
            item.add_marker("slow")


SESSION_MARK = uuid.uuid4().hex
os.environ["TACO_TEST_SESSION"] = SESSION_MARK
# clusters started by tests (and by kernels and Jupyter servers they start) publish here, not in the user's registry
os.environ["TACO_REGISTRY_DIR"] = tempfile.mkdtemp(prefix="taco-registry-")
REPO = Path(__file__).resolve().parent.parent
SHARED = "default"


def session_processes() -> dict[int, str]:
    """Every live process started (directly or not) by this test session, pid -> command line."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if proc.environ().get("TACO_TEST_SESSION") == SESSION_MARK:
                found[proc.pid] = " ".join(proc.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_for_no_leaks(allowed: set[int], grace: float = 10.0) -> dict[int, str]:
    deadline = time.monotonic() + grace
    while True:
        leaked = {pid: cmd for pid, cmd in session_processes().items() if pid not in allowed}
        if not leaked or time.monotonic() > deadline:
            return leaked
        time.sleep(0.2)


def cluster_pids(name: str) -> set[int]:
    from taco_notebook.cluster.session import clusters

    cluster = clusters.get(name)
    if cluster is None:
        return set()
    return {p.pid for p in cluster.processes}


@pytest.fixture(scope="session")
def ip():
    """A real IPython shell with the extension loaded."""
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_line_magic("load_ext", "taco_notebook")
    yield shell


@pytest.fixture(scope="session")
def shared_cluster(ip):
    """The 4-rank cluster 'default', started once for the tests that leave it healthy."""
    from taco_notebook.cluster.session import clusters

    ip.run_line_magic("taco_cluster", "start -n 4 --cluster default")
    yield clusters[SHARED]
    cluster = clusters.pop(SHARED, None)
    if cluster is not None:
        cluster.stop()


def shared_memory_in_use() -> set[str]:
    """/dev/shm files some live process still maps."""
    used = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/maps") as maps:
                    used.update(line.split()[-1] for line in maps if "/dev/shm/" in line)
            except OSError:
                continue
    return used


@pytest.fixture(autouse=True)
def keeps_the_sigint_handler(request) -> Iterator[None]:
    """Fail a test that leaves this process's SIGINT handler changed (and put it back): the Ctrl-C tests need
    Python's own handler, as a notebook kernel has it, and a changed one made them pass or fail by test order."""
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before:
        signal.signal(signal.SIGINT, before)
        pytest.fail(f"{request.node.nodeid} left the SIGINT handler changed: {after!r} instead of {before!r}")


def assert_trait_refused(ip, caplog, line: str, message: str, unchanged: tuple[str, ...]) -> None:
    """``%config <line>`` with a bad value: IPython logs what the trait's check raised (``message`` in it) and
    keeps the old value, so every trait named in ``unchanged`` is still unset (None)."""
    with caplog.at_level(logging.ERROR):
        ip.run_line_magic("config", line)
    assert message in caplog.text
    magics = ip.magics_manager.registry["TacoMagics"]
    assert {name: getattr(magics, name) for name in unchanged} == dict.fromkeys(unchanged)


@pytest.fixture
def sigint_as_in_a_kernel() -> Iterator[None]:
    """Python's own SIGINT handler for the test, as ipykernel installs it while it executes a cell: a pytest
    started in the background by a shell without job control inherits SIGINT ignored, and a Ctrl-C test would
    then never see its interrupt."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def no_leaked_processes(request) -> Iterator[None]:
    """After each test: stop clusters the test left behind, then fail on any surviving process or any
    /dev/shm file it left (MPI's segments outlive ranks that are killed)."""
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    del _started[:]
    yield
    heavy = [command for command in _started if HEAVY.search(command)]
    if heavy and request.node.get_closest_marker("slow") is None:
        pytest.fail(f"{request.node.nodeid} starts {heavy[0][:200]!r} but carries none of the markers "
                    f"{SLOW_MARKERS}: mark it, so that the fast tier (-m 'not slow') stays fast")
    from taco_notebook.cluster.registry.reaper import running_reapers
    from taco_notebook.cluster.session import clusters

    for name in [n for n in clusters if n != SHARED]:
        clusters.pop(name).stop()
    # this process's reapers wait for it to die (or go idle a few seconds after its last cluster): not leaks
    leaked = wait_for_no_leaks(cluster_pids(SHARED) | set(running_reapers()))
    if leaked:
        for pid in leaked:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        pytest.fail(f"{request.node.nodeid} left processes running: {leaked}")
    if os.path.isdir("/dev/shm"):
        left = {f"/dev/shm/{name}" for name in set(os.listdir("/dev/shm")) - shm_before}
        left -= shared_memory_in_use()
        if left:
            pytest.fail(f"{request.node.nodeid} left shared memory behind: {sorted(left)}")


IPYKERNEL6 = "6.29.5"  # the last ipykernel 6 (pyproject allows >= 6.29): it reads the shell socket on the main thread


def kernel_env(site: str) -> dict[str, Any]:
    """``start_new_kernel`` options for a kernel that imports from ``site`` first (the ``ipykernel6`` fixture)."""
    path = [site, os.environ.get("PYTHONPATH", "")]
    return {"env": dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))}


@pytest.fixture(scope="session")
def ipykernel6(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory holding ipykernel 6 (and nest_asyncio, its one need the test environment lacks), to put first
    on a kernel's PYTHONPATH: the same kernel launcher, the older kernel."""
    target = tmp_path_factory.mktemp("ipykernel6")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                           "--target", str(target), f"ipykernel=={IPYKERNEL6}", "nest_asyncio"],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.skip(f"could not install ipykernel {IPYKERNEL6} from the package index: "
                    f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return str(target)


@pytest.fixture
def mpiexec() -> str:
    """The mpich wheel's mpiexec beside this Python, else the one on PATH (the GPU machine stages it elsewhere)."""
    import shutil

    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        pytest.skip(f"no mpiexec beside {sys.executable} nor on PATH: pip install mpich")
    return found


def pytest_unconfigure(config) -> None:
    import shutil

    shutil.rmtree(os.environ["TACO_REGISTRY_DIR"], ignore_errors=True)
