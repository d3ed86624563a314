"""An engine's kernel that spends nothing per request on what no one reads (issue 27).

* **The busy status.** ipykernel publishes an IOPub ``status`` message before it handles every shell request
  (``busy``) and another after it (``idle``). On a cluster's engine only ipyparallel's clients listen, and they
  act on ``idle`` alone: it tells a client that a request's output is complete
  (``AsyncResult.wait_for_output``, which ``%%taco_run`` waits for before it reads a cell's output). ``busy`` is
  parsed and dropped. Yet each costs per rank per cell: the engine sends it, the controller forwards it to every
  client and copies it to its hub, and the notebook deserialises it (signature, four JSON frames, dates) and
  wakes the cell's wait loop for it. Of the four messages per rank an empty cell makes, it is one; without it
  the notebook's and the controller's CPU per rank per empty cell fell 16% and the cell's wall time 10% at 64
  plain ranks on 2 cores (1.012 -> 0.847 ms a rank, 147.1 -> 131.9 ms, the two in turn). The kernel publishes
  everything else as before: ``idle`` after every request, ``starting``, and both statuses of control
  requests (abort, shutdown, interrupts).
* **Log lines per request.** ipyparallel's engine logs ``Handling apply_request: <id>`` at INFO for every
  request, and its log level is INFO: a line per rank per cell into the engine set's log through mpiexec's
  output forwarding, without end (64,000 lines for 1,000 cells on 64 ranks). And it leaves the engine's logger
  at DEBUG behind that INFO handler, so the kernel's five ``log.debug`` calls per request each build a
  ``LogRecord`` (caller, time, thread) that is then dropped: about 3% of an engine's CPU for an empty cell
  (py-spy, 16 ranks). Once the engine is set up, its logger keeps warnings and errors only, unless its
  handlers were set to DEBUG (``--log-level=DEBUG``, asked for to debug an engine), which keeps everything.

The kernel is changed by giving the object a subclass of its own class (ipyparallel's ``IPythonParallelKernel``,
or whatever runs the engine) that overrides ``_publish_status``; a kernel without that method keeps its class.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["quiet_kernel"]

_quiet: dict[type, type] = {}  # kernel class -> its quiet subclass, made once


def _quiet_class(base: type) -> type:
    """``base`` with the shell's ``busy`` status left out (one subclass per kernel class)."""
    if base in _quiet:
        return _quiet[base]

    class QuietKernel(base):  # type: ignore[misc, valid-type]
        quiet_busy = True

        def _publish_status(self, status: str, channel: str, parent: Any = None) -> None:
            if status == "busy" and channel == "shell":
                return
            super()._publish_status(status, channel, parent)

    QuietKernel.__name__ = QuietKernel.__qualname__ = f"Quiet{base.__name__}"
    _quiet[base] = QuietKernel
    return QuietKernel


def quiet_kernel() -> None:
    """This engine's kernel without the shell's ``busy`` status and without a log line per request
    (idempotent; a process that is not a kernel is left as it is)."""
    from IPython import get_ipython

    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None:
        return
    if callable(getattr(kernel, "_publish_status", None)) and not getattr(kernel, "quiet_busy", False):
        kernel.__class__ = _quiet_class(type(kernel))
    _quiet_log(getattr(kernel, "log", None))


def _quiet_log(log: Any) -> None:
    """``log`` (the engine's own logger: it has handlers and propagates nowhere) at WARNING, or at its handlers'
    lowest level when one is at DEBUG."""
    if not isinstance(log, logging.Logger) or log.propagate or not log.handlers:
        return
    lowest = min(handler.level for handler in log.handlers)
    log.setLevel(lowest if logging.NOTSET < lowest < logging.INFO else max(lowest, logging.WARNING))
