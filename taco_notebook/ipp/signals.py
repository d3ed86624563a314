"""An engine that answers ipyparallel's signal requests itself, so that it starts without a nanny process.

ipyparallel starts a nanny process beside every engine (``IPEngine.enable_nanny``): it sits on the engine's
control channel, sends the engine the signals a client asks for (``Client.send_signal``: a cell's Ctrl-C, an
elastic membership's SIGUSR1, a hung member's SIGKILL) and tells the controller when the engine's process ends.
An engine of a cluster the notebook starts (the local, hosts and slurm profiles) runs under the rank wrapper
(:mod:`taco_notebook.engine.rankwrap`), which already watches it and says how it ended, and the launcher ends
the job; so it starts with ``--IPEngine.enable_nanny=False`` (:data:`NO_NANNY`): one Python process fewer per
rank, and a start no longer waits for it between an engine's registration and its first heartbeat (an MPIJob's
engines, which run without the wrapper, keep ipyparallel's nanny). The kernel's control thread answers
``signal_request`` as the nanny did, signalling its own process. Only a process whose main thread holds the GIL
in C code for good is out of its reach, where the nanny's SIGKILL would still land; a local one is killed by its
pid instead (``TacoCluster.kill_ranks``).
"""

from __future__ import annotations

import os
import signal
from typing import Any

__all__ = ["NO_NANNY", "answer_signals"]

NO_NANNY = "--IPEngine.enable_nanny=False"  # the engine's argument: no nanny process beside it


def answer_signals() -> None:
    """This engine's kernel answers ``signal_request`` on its control channel (idempotent; a process that is not
    a kernel is left as it is)."""
    from IPython import get_ipython

    kernel = getattr(get_ipython(), "kernel", None)
    handlers = getattr(kernel, "control_handlers", None)
    if isinstance(handlers, dict):
        handlers["signal_request"] = lambda stream, ident, parent: _signal(kernel, stream, ident, parent)


def _signal(kernel: Any, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
    """The nanny's ``signal_request``: reply, then send the signal (a number, or a name such as ``"SIGINT"``)
    to this process. The reply goes first: after a SIGKILL there is no one left to send it."""
    sig = parent.get("content", {}).get("sig")
    try:
        signum = signal.Signals[sig] if isinstance(sig, str) else signal.Signals(sig)
    except (KeyError, ValueError) as exc:
        error = {"status": "error", "ename": type(exc).__name__, "evalue": f"no such signal: {sig!r}", "traceback": []}
        kernel.session.send(stream, "signal_reply", error, parent, ident)
        return
    kernel.session.send(stream, "signal_reply", {"status": "ok"}, parent, ident)
    os.kill(os.getpid(), signum)
