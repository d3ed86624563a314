"""Run one MPI rank's engine as a child and say how it ended.

``mpiexec`` starts ``python -m taco_notebook.cluster.rankwrap ENGINE-COMMAND…`` on every rank. The wrapper starts the
engine with the MPI environment and file descriptors inherited, forwards every signal it gets, and when the
engine dies abnormally prints one marker line (rank, host, pid, signal or exit code) to stderr, which mpiexec
gathers from every node into the engine set's log. The client reads that line to say *which* rank died and
how: mpiexec itself only reports that one did. The wrapper then ends the same way, so MPI reacts as usual.

Stdlib only: it starts on every rank before anything else.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys

MARKER = "TACO-RANK-EXIT"
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


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m taco_notebook.cluster.rankwrap COMMAND [ARGS…]", file=sys.stderr)
        return 2
    child = subprocess.Popen(argv, close_fds=False, preexec_fn=_die_with_parent)
    for signum in FORWARDED:
        signal.signal(signum, lambda s, _frame: child.send_signal(s))
    code = child.wait()
    if code == 0:
        return 0
    host = os.environ.get("TACO_NODE_NAME") or socket.gethostname()
    how = f"signal={-code}" if code < 0 else f"exitcode={code}"
    print(f"{MARKER} rank={mpi_rank_from_env()} host={host} pid={child.pid} {how}", file=sys.stderr, flush=True)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
