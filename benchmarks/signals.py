"""A benchmark told to end by SIGTERM (``timeout``, a CI runner, ``kill``) or SIGHUP stops its clusters first.

Python dies of either signal at once, without running ``finally``, and leaves the controller, ``mpiexec`` and the
engines running. Under :func:`stop_on_sigterm` each becomes a KeyboardInterrupt, which every ``try``/``finally``
that stops a cluster handles as it does Ctrl-C (a benchmark that goes on to its next size after a
ClusterStartError stops at an interrupt); then it exits with 128 + the signal's number (143 for SIGTERM) and says
so in one line on stderr. Ctrl-C stays Python's own.
"""

from __future__ import annotations

import signal
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["stop_on_sigterm"]

ENDING = (signal.SIGTERM, signal.SIGHUP)


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Run the body with SIGTERM and SIGHUP raising KeyboardInterrupt (not where they are ignored: ``nohup``); a
    second one during the clean-up ends the process at once. Past the body: ``SystemExit(128 + signum)``."""
    received: list[signal.Signals] = []

    def interrupt(signum: int, frame: FrameType | None) -> None:
        received.append(signal.Signals(signum))
        for each in ENDING:
            signal.signal(each, signal.SIG_DFL)
        raise KeyboardInterrupt(f"{received[0].name} received")

    previous = {each: signal.signal(each, interrupt) for each in ENDING if signal.getsignal(each) == signal.SIG_DFL}
    failed = False
    try:
        yield
    except BaseException as exc:
        if not received:
            raise
        failed = not isinstance(exc, KeyboardInterrupt)  # the clean-up itself went wrong
        if failed:
            traceback.print_exception(exc)
    finally:
        for each, handler in previous.items():
            if signal.getsignal(each) is interrupt:
                signal.signal(each, handler)
    if received:  # also when something swallowed the KeyboardInterrupt and the body went on to its end
        stopped = "stopping its clusters failed (above)" if failed else "clusters stopped"
        print(f"benchmark ended by {received[0].name}; {stopped}", file=sys.stderr, flush=True)
        raise SystemExit(128 + received[0])
