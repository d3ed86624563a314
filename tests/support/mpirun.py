"""Run ``mpiexec`` (or any command) from a test so that a timeout leaves nothing running.

``subprocess.run(..., timeout=)`` kills only its direct child. Under MPICH's hydra that child is ``mpiexec``,
while every ``hydra_pmi_proxy`` and every rank runs in a session of its own (the proxy calls ``setsid``), so
neither ``Popen.kill`` nor ``os.killpg`` on mpiexec's group reaches them: they end only if the proxy notices
mpiexec is gone. Behind a wrapper (``sh -c``, a launcher script) the ranks are not even reached that way.

:func:`run_in_session` starts the command in a session of its own and, on timeout (or on an exception in this
process, e.g. Ctrl-C or pytest-timeout's signal), kills every process it started, then fails with the output so
far. What is killed is proven ours: the members of the session whose leader is our unreaped child, every
descendant of those (through parent links, walked while the processes are frozen with SIGSTOP, so that none is
reparented or reused in between), and any process that holds the write end of the pipes we created. psutil
checks each process's creation time before it signals it, so a recycled pid is never hit.

    result = run_mpi(mpiexec, 4, "training.py", {"LIGHT_INTRA_SIZE": "2"}, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import psutil
import pytest

from taco_notebook.cluster.processes.tree import alive, mapped_shared_memory

__all__ = ["SCRIPTS", "kill_session", "mpi_env", "run_in_session", "run_mpi", "started_by", "still_running"]

SCRIPTS = Path(__file__).parents[1] / "mpi"
FREEZE_ROUNDS = 5  # a rank forking while we walk the tree is seen in the next round; 5 is plenty


def mpi_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment, one OpenMP thread per rank (2 cores, 4 ranks), then ``extra``."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **(extra or {})}


def run_mpi(mpiexec: str, n: int, script: str | Path, env: Mapping[str, str] | None = None, timeout: float = 120,
            args: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """``mpiexec -n N python SCRIPT ARGS`` (SCRIPT relative to tests/mpi/ unless absolute), see
    :func:`run_in_session`."""
    return run_in_session([mpiexec, "-n", str(n), sys.executable, str(SCRIPTS / script), *args], env=mpi_env(env),
                          timeout=timeout)


def run_in_session(argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
                   merge_stderr: bool = False, stdout: int | IO[Any] = subprocess.PIPE,
                   cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a session of its own and return its exit code and output (text; ``merge_stderr`` puts
    stderr into stdout; a file as ``stdout`` gets both). A non-zero exit is returned, not raised: the test
    asserts on it. Past ``timeout`` seconds, every process it started is killed (:func:`kill_session`) and the
    test fails with the output so far."""
    err_to: int | IO[Any] = subprocess.STDOUT if merge_stderr or stdout is not subprocess.PIPE else subprocess.PIPE
    proc = subprocess.Popen(list(argv), stdout=stdout, stderr=err_to, text=True, env=None if env is None else dict(env),
                            cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        killed = kill_session(proc)
        out, err = _drain(proc)
        pytest.fail(f"{shlex.join(argv)} overran {timeout:g} s: killed it and the {len(killed)} processes it "
                    f"started\nstdout:\n{out}\nstderr:\n{err}")
    except BaseException:  # Ctrl-C, pytest-timeout's signal: the test ends here, its processes with it
        kill_session(proc)
        _drain(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out or "", err or "")


def _drain(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """The output left in the pipes once every writer is dead (bounded: a writer in D state must not hang us)."""
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()
        return "", "(output lost: a process still held the pipe 30 s after SIGKILL)"
    return out or "", err or ""


def kill_session(proc: subprocess.Popen[Any], wait_s: float = 15.0) -> list[str]:
    """SIGKILL ``proc`` (started with ``start_new_session=True``) and every process it started; reap ``proc``.

    Returns ``"pid command"`` of each process killed besides ``proc``. Fails the test if one outlives ``wait_s``.
    Nothing is done to others when ``proc`` has already been reaped: its session id is then no proof. The
    /dev/shm segments they mapped and no live process maps any more are removed: MPI's segments outlive killed
    ranks, and so would a taco cluster's once its reaper (a process it started, killed here too) is gone.
    """
    if proc.returncode is not None:
        return []
    frozen = _freeze(proc)
    segments = mapped_shared_memory(frozen)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # our session leader's own group, in one call
    except ProcessLookupError:
        pass
    for member in frozen:
        try:
            member.kill()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    proc.kill()
    proc.wait()  # by Popen: psutil reaping our child would leave Popen a made-up exit code
    others = [p for p in frozen if p.pid != proc.pid]
    _, survivors = psutil.wait_procs(others, timeout=wait_s)
    left = [f"{p.pid} {frozen[p]}" for p in survivors if alive(p)]
    if left:
        pytest.fail(f"these processes of {proc.args!r} survived SIGKILL for {wait_s:g} s: {left}")
    for segment in segments - mapped_shared_memory(psutil.process_iter()):
        Path(segment).unlink(missing_ok=True)
    return [f"{p.pid} {frozen[p]}" for p in others]


def _freeze(proc: subprocess.Popen[Any]) -> dict[psutil.Process, str]:
    """SIGSTOP every process ``proc`` started; return them with their command lines."""
    frozen: dict[psutil.Process, str] = {}
    for _ in range(FREEZE_ROUNDS):  # freeze, then look again: a fork during the walk shows up next round
        found = [p for p in started_by(proc) if p not in frozen]
        if not found:
            break
        for member in found:
            try:
                frozen[member] = " ".join(member.cmdline())
                member.suspend()  # SIGSTOP, after psutil checked pid and creation time
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
    return frozen


def started_by(proc: subprocess.Popen[Any]) -> list[psutil.Process]:
    """The live processes ``proc`` started (``proc`` itself included): members of its session, their
    descendants, and any process holding the write end of ``proc``'s output pipes. Empty once it is reaped."""
    if proc.returncode is not None:
        return []
    pipes = {f"pipe:[{os.fstat(f.fileno()).st_ino}]" for f in (proc.stdout, proc.stderr)
             if f is not None and not f.closed}
    roots: set[psutil.Process] = set()
    for candidate in psutil.process_iter():
        if candidate.pid == os.getpid():
            continue  # we hold the read ends
        try:
            if os.getsid(candidate.pid) == proc.pid or (pipes and _holds(candidate.pid, pipes)):
                roots.add(candidate)
        except (ProcessLookupError, PermissionError):
            continue
    found = set(roots)
    for root in roots:
        try:
            found.update(root.children(recursive=True))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return sorted((p for p in found if alive(p)), key=lambda p: p.pid)


def _holds(pid: int, pipes: set[str]) -> bool:
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(f"{fd_dir}/{name}") in pipes:
                return True
        except OSError:
            continue
    return False


def still_running(pid: int, since: float) -> str | None:
    """The command of ``pid`` if the process we saw still runs (not a zombie; not a later one with its pid)."""
    try:
        proc = psutil.Process(pid)
        if proc.create_time() > since or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return " ".join(proc.cmdline())
    except psutil.NoSuchProcess:
        return None
