"""Run one MPI rank's engine as a child and say how it ended.

``mpiexec`` starts ``python -m taco_notebook.engine.rankwrap ENGINE-COMMAND…`` on every rank. The wrapper starts
the engine with the MPI environment and file descriptors inherited, forwards every signal it gets, and when the
engine dies abnormally prints one marker line (rank, host, pid, signal or exit code) to stderr, which mpiexec
gathers from every node into the engine set's log. The client reads that line to say *which* rank died and
how: mpiexec itself only reports that one did. The wrapper then ends the same way, so MPI reacts as usual.

Under MPICH's gforker (a one-host cluster, see :mod:`taco_notebook.cluster.launch.mpi`) the wrapper writes the
rank's output straight into gforker's own stdout/stderr file (gforker's relay drops a rank's output at its first
non-ASCII byte), and does two things hydra does and gforker does not: it tells each rank its local rank and the
local size (``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``, which comm/ reads to keep MPI on shared memory and to place
GPUs; every rank is local), and when its engine dies abnormally it kills the job's other ranks (SIGKILL, as hydra
does on a rank's death; gforker alone would leave them running, and a SIGTERM would let their cells end "on their
own" instead of as dead engines).

Elastic mode (``%%taco_run --elastic``): the engine tells its wrapper through a pipe (``TACO_RANKWRAP_MODE_FD``,
one line per change: ``elastic`` or ``strict``, written by :func:`taco_notebook.engine.calls.elastic_mode`).
When an engine dies while its last word was ``elastic``, the wrapper prints the marker line as usual but does
not end the MPI job: it stops no other rank and stays alive (holding the rank's PMI connection, so neither
hydra nor gforker sees a rank go) until the job is stopped or its parent goes. The client then rebuilds the
process group over the survivors (:mod:`taco_notebook.cluster.elastic.recovery`).

Stdlib only: it starts on every rank before anything else.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import stat
import subprocess
import sys
import threading

MARKER = "TACO-RANK-EXIT"
MODE_FD_ENV = "TACO_RANKWRAP_MODE_FD"  # the write end of the pipe the engine names its mode on
LAUNCHED_BY_ENV = "TACO_LAUNCHED_BY"  # "gforker" when the cluster's engines run under mpiexec.gforker
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1


def mpi_rank_from_env() -> str:
    for key in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID"):
        if key in os.environ:
            return os.environ[key]
    return "?"


def _die_with_parent() -> None:
    # If mpiexec SIGKILLs the wrapper while cleaning up, the engine must not outlive it.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _under_gforker() -> bool:
    return os.environ.get(LAUNCHED_BY_ENV) == "gforker" and "PMI_RANK" in os.environ


def _gforker_locals() -> None:
    # gforker runs every rank on this host: the local rank is the rank, the local size the world size.
    os.environ.setdefault("MPI_LOCALRANKID", os.environ["PMI_RANK"])
    os.environ.setdefault("MPI_LOCALNRANKS", os.environ.get("PMI_SIZE", "1"))


def _write_where_gforker_writes() -> None:
    """Point this rank's stdout and stderr at gforker's own, when that is a file (the engine set's log).

    gforker relays each rank's output through a pipe and stops reading it at the first byte over 0x7f (seen
    with mpich 5.0.2): the rest of that rank's log is lost, and its next write fails with EPIPE, this
    wrapper's marker line included. Appending to the log directly (ipyparallel opens it for append too)
    keeps every byte and keeps each write whole.
    """
    parent = os.getppid()
    for fd in (1, 2):
        target = f"/proc/{parent}/fd/{fd}"
        try:
            if not stat.S_ISREG(os.stat(target).st_mode):
                continue
            log = os.open(target, os.O_WRONLY | os.O_APPEND)
        except OSError:  # not ours to read, or gone: keep gforker's pipe
            continue
        os.dup2(log, fd)
        os.close(log)


def _stop_gforker_job() -> None:
    """SIGKILL the other ranks of this job, as hydra does when a rank dies; gforker then ends by itself.

    They are proven to be this job's: children of this wrapper's own parent, which must be an
    ``mpiexec.gforker`` (its executable's name), of this user. Each wrapper's engine follows it (PDEATHSIG).
    """
    parent, me = os.getppid(), os.getpid()
    try:
        if os.path.basename(os.readlink(f"/proc/{parent}/exe")) != "mpiexec.gforker":
            return
    except OSError:
        return
    for pid in _children_of(parent):
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # already gone
                pass


def _children_of(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            if int(fields[1]) == parent and os.stat(f"/proc/{entry}").st_uid == os.getuid():
                found.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return found


class _Mode:
    """The engine's last word on the pipe: ``elastic`` keeps the job alive when it dies."""

    def __init__(self) -> None:
        self.elastic = False
        read, self.write_fd = os.pipe()
        os.set_inheritable(self.write_fd, True)
        self._reader = threading.Thread(target=self._read, args=(read,), daemon=True)

    def start(self) -> None:
        os.close(self.write_fd)  # the engine holds the only write end now: its death is EOF here
        self._reader.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "r", errors="replace") as pipe:
            for line in pipe:
                self.elastic = line.strip() == "elastic"

    def settled(self) -> bool:
        """Whether the engine was elastic when it ended (read what it wrote up to its death first)."""
        self._reader.join(timeout=1.0)
        return self.elastic


def _stay_for_the_job() -> int:
    """An elastic rank's engine died: stay until the job is stopped (a forwarded signal) or mpiexec goes."""
    parent = os.getppid()
    stop = threading.Event()
    for signum in FORWARDED:
        signal.signal(signum, lambda _s, _f: stop.set())
    while not stop.wait(0.5) and os.getppid() == parent:
        pass
    return 0


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m taco_notebook.engine.rankwrap COMMAND [ARGS…]", file=sys.stderr)
        return 2
    gforker = _under_gforker()
    if gforker:
        _gforker_locals()
        _write_where_gforker_writes()
    mode = _Mode()
    env = {**os.environ, MODE_FD_ENV: str(mode.write_fd)}
    child = subprocess.Popen(argv, close_fds=False, preexec_fn=_die_with_parent, env=env)
    mode.start()
    for signum in FORWARDED:
        signal.signal(signum, lambda s, _frame: child.send_signal(s))
    code = child.wait()
    if code == 0:
        return 0
    host = os.environ.get("TACO_NODE_NAME") or socket.gethostname()
    how = f"signal={-code}" if code < 0 else f"exitcode={code}"
    elastic = mode.settled()
    line = f"{MARKER} rank={mpi_rank_from_env()} host={host} pid={child.pid} {how}" + (" elastic" if elastic else "")
    sys.stderr.flush()  # one write(2) of the whole line: an append that no other writer of the log can split
    os.write(sys.stderr.fileno(), (line + "\n").encode())
    if elastic:
        return _stay_for_the_job()
    if gforker:  # after the marker, so the dead rank's line is the first in the log
        _stop_gforker_job()
    if code < 0:
        try:
            signal.signal(-code, signal.SIG_DFL)
        except OSError:  # SIGKILL and SIGSTOP cannot be handled: their default stands anyway
            pass
        os.kill(os.getpid(), -code)
    return code if code > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
