"""Under plain ``mpiexec``, an uncaught exception on any rank ends the whole job, with that rank's traceback.

Without this, ``mpiexec -n 2 python train.py`` hangs when one rank raises: its peers wait in a collective for
a message that never comes, and the failed rank itself may never exit (interpreter shutdown waits on MPI and
torch teardown), so mpiexec never learns anything went wrong. As ``python -m mpi4py`` does, the hook prints the
traceback, flushes, and calls ``MPI.COMM_WORLD.Abort(1)``: mpiexec then ends every rank.

Installed by ``import taco_notebook.comm`` (so a rank that fails before ``init()``, say while loading data, also
ends the job) and again by ``init()`` after torch's own ``init_process_group`` wrapped ``sys.excepthook`` (so
ours stays outermost and torch's ``[rankN]:`` prefixed traceback is printed before the abort). Only when the
process was started by an MPI launcher and is not an IPython kernel / ipyparallel engine: under ``%%taco_run``
an exception fails the cell and the engines stay up. ``TACO_ABORT_ON_EXCEPTION=0`` (or false/no/off) turns it off.

``threading.excepthook`` is left alone: taco's communication thread hands every exception to the future its
caller waits on, so it reaches the main thread; other threads' errors keep Python's behaviour.
If the failed rank never initialised MPI it cannot abort the job: it exits with code 1.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from ..specs import parse_flag

__all__ = ["install", "should_install", "under_mpi_launcher", "in_engine", "is_installed"]

_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
_ENGINE_MODULES = ("ipykernel", "ipyparallel")
_MARK = "_taco_aborts_mpi_job"
_MPI_SEGMENTS = ("mpich_shm_", "ucx_shm_")  # MPICH's and UCX's intra-node segments
_handling = False

Hook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


def under_mpi_launcher() -> bool:
    """True when an MPI launcher (hydra, gforker, Open MPI, PMIx) started this process."""
    return any(name in os.environ for name in _LAUNCHER_VARS)


def in_engine() -> bool:
    """True in an ipyparallel engine or IPython kernel (a ``%%taco_run`` rank), where a cell's error must not
    end the job. Looks at loaded modules and the cluster's marker only: comm/ never imports IPython."""
    return "TACO_CLUSTER_NAME" in os.environ or any(name in sys.modules for name in _ENGINE_MODULES)


def should_install() -> bool:
    wanted = parse_flag("TACO_ABORT_ON_EXCEPTION", os.environ.get("TACO_ABORT_ON_EXCEPTION"))
    return under_mpi_launcher() and not in_engine() and wanted is not False


def is_installed() -> bool:
    """True when ``sys.excepthook`` is (outermost) the aborting hook."""
    return bool(getattr(sys.excepthook, _MARK, False))


def _rank() -> str:
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if name in os.environ:
            return os.environ[name]
    return "?"


ABORT_GRACE_S = 0.2  # between the abort's message and MPI_Abort


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more to say on it
            pass


def _unlink_mpi_segments() -> None:
    """Unlink the MPI shared-memory segments this process maps: Abort kills every rank, so MPI never does, and
    the names would stay in /dev/shm. Every local rank maps the same segments; the mappings outlive the names."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/dev/shm/" in line}
    except OSError:
        return
    for path in paths:
        if os.path.basename(path).startswith(_MPI_SEGMENTS):
            try:
                os.unlink(path)
            except OSError:
                pass


def _abort_job(etype: type[BaseException]) -> None:
    mpi = sys.modules.get("mpi4py.MPI")  # never import it here: MPI_Init could wait for peers
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    comm_state = sys.modules.get("taco_notebook.comm.state")
    if comm_state is not None and comm_state.state.rendezvous is not None:
        comm_state.state.rendezvous.close()  # Abort skips atexit: remove the private rendezvous directory now
    _unlink_mpi_segments()
    print(f"[taco] rank {_rank()}: uncaught {etype.__name__}: aborting the MPI job (every rank). "
          "Set TACO_ABORT_ON_EXCEPTION=0 to let the other ranks go on.", file=sys.stderr)
    _flush()
    # the line is in the pipe to mpiexec's proxy, which relays it; Abort has the job's processes killed and can
    # lose it: give the relay a moment
    time.sleep(ABORT_GRACE_S)
    mpi.COMM_WORLD.Abort(1)


def _aborting(previous: Hook) -> Hook:
    def hook(etype: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        global _handling
        if _handling:  # called again through a hook we wrapped (torch's): just print
            previous(etype, value, tb)
            return
        _handling = True
        try:
            previous(etype, value, tb)
        finally:
            _flush()
            _abort_job(etype)
            _handling = False

    setattr(hook, _MARK, True)
    return hook


def install() -> bool:
    """Make ``sys.excepthook`` abort the MPI job after printing, when :func:`should_install`. Idempotent.

    Returns True when the hook is (now) in place.
    """
    if not should_install():
        return False
    if not is_installed():
        sys.excepthook = _aborting(sys.excepthook)
    return True
