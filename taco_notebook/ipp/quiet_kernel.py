"""An engine's kernel that spends nothing per request on what no one reads.

* **The busy status.** ipykernel publishes an IOPub ``status`` message before it handles every shell request
  (``busy``) and another after it (``idle``). On a cluster's engine only ipyparallel's clients listen, and they
  act on ``idle`` alone: it tells a client that a request's output is complete
  (``AsyncResult.wait_for_output``, which ``%%taco_run`` waits for before it reads a cell's output). ``busy`` is
  parsed and dropped, yet it costs per rank per cell: the engine sends it, the controller forwards it to every
  client and copies it to its hub, and the notebook deserialises it and wakes the cell's wait loop for it. The
  kernel publishes everything else: ``idle`` after every request, ``starting``, and both statuses of control
  requests (abort, shutdown, interrupts).
* **Log lines per request.** ipyparallel's engine logs ``Handling apply_request: <id>`` at INFO for every
  request, and its log level is INFO: a line per rank per cell into the engine set's log, without end. It also
  leaves the engine's logger at DEBUG behind that INFO handler, so the kernel's ``log.debug`` calls per request
  each build a ``LogRecord`` that is then dropped. Once the engine is set up, its logger keeps warnings and
  errors only, unless its handlers were set to DEBUG (``--log-level=DEBUG``, asked for to debug an engine),
  which keeps everything.
* **The idle status of a silent cell.** A ``%%taco_run`` cell that sends nothing on IOPub (no output, no
  dashboard payload, no error: an empty cell, or one that only computes) needs no idle status to say its output
  is complete: its runner says so in its reply (:func:`end_silently`), the kernel then sends no idle status for
  the request, and the notebook's ``RankTracker`` ends the request's output at the reply: two messages per rank,
  the request and the reply. A cell that sent anything, or whose runner was not asked (``CellSetup.silent``:
  only ``%%taco_run`` asks, as only it has the tracker), ends with its idle status.

The kernel is changed by giving the object a subclass of its own class (ipyparallel's ``IPythonParallelKernel``,
or whatever runs the engine) that overrides ``_publish_status``, and its IOPub thread's ``send_multipart`` is
wrapped to count what it sends; a kernel without ``_publish_status`` keeps its class.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = ["quiet_kernel", "iopub_mark", "end_silently"]

_quiet: dict[type, type] = {}  # kernel class -> its quiet subclass, made once


def _quiet_class(base: type) -> type:
    """``base`` with the shell's ``busy`` status left out (one subclass per kernel class)."""
    if base in _quiet:
        return _quiet[base]

    class QuietKernel(base):  # type: ignore[misc, valid-type]
        iopub_sent: int | None = None  # IOPub messages handed to the IOPub thread (_count_iopub); None: not counted
        silent: tuple[str, int] | None = None  # (request, iopub_sent) a runner ended with nothing published

        def _publish_status(self, status: str, channel: str, parent: Any = None) -> None:
            if channel == "shell" and status == "busy":
                return
            if channel == "control" and _msg_type(parent or self.get_parent(channel)) == "signal_request":
                return  # answered in place of the nanny (signals.py), which published nothing for it
            if channel == "shell" and status == "idle" and self.silent is not None:
                (request, sent), self.silent = self.silent, None
                if sent == self.iopub_sent and _msg_id(parent or self.get_parent(channel)) == request:
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
    if callable(getattr(kernel, "_publish_status", None)) and type(kernel) not in _quiet.values():
        kernel.__class__ = _quiet_class(type(kernel))
        _count_iopub(kernel)
    _quiet_log(getattr(kernel, "log", None))


def _count_iopub(kernel: Any) -> None:
    """Count what is handed to the kernel's IOPub thread (ipyparallel's engine sends every IOPub message, the
    streams' included, through its ``send_multipart``). From several threads the count may lose an increment,
    never a change: it is read only to see whether anything was sent since. Where there is no such thread the
    count stays None, and no runner's request goes silent (:func:`iopub_mark`)."""
    thread: Any = getattr(kernel, "iopub_socket", None)
    send = getattr(thread, "send_multipart", None)
    if send is None:
        return
    kernel.iopub_sent = 0

    def counted(*args: Any, **kwargs: Any) -> Any:
        kernel.iopub_sent += 1
        return send(*args, **kwargs)

    thread.send_multipart = counted


def _msg_id(message: Any) -> str | None:
    return (message or {}).get("header", {}).get("msg_id")


def _msg_type(message: Any) -> str | None:
    return (message or {}).get("header", {}).get("msg_type")


def iopub_mark() -> int | None:
    """How many IOPub messages this engine has sent so far (None where they are not counted): a runner's first
    step, for :func:`end_silently`."""
    from IPython import get_ipython

    return getattr(getattr(get_ipython(), "kernel", None), "iopub_sent", None)


def end_silently(mark: int | None) -> bool:
    """A runner's last step: whether its request has sent nothing on IOPub since ``mark`` (:func:`iopub_mark`)
    and its streams hold nothing. If so its kernel will send no idle status for it either, and the runner says
    so in its reply: the notebook then takes the reply as the end of the request's output (``RankTracker``).

    The streams are flushed first, so what a cell printed is sent (and counted) before the count is read. What
    another thread publishes after this (and before the kernel's idle status) makes the kernel send the idle
    status after all, but arrives after the notebook stopped reading this request: as output a thread prints
    just after a request's idle status always has."""
    from IPython import get_ipython

    kernel = getattr(get_ipython(), "kernel", None)
    if mark is None or kernel is None:
        return False
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    request = _msg_id(kernel.get_parent("shell"))
    if kernel.iopub_sent != mark or request is None:
        return False
    kernel.silent = (request, mark)
    return True


def _quiet_log(log: Any) -> None:
    """``log`` (the engine's own logger: it has handlers and propagates nowhere) at WARNING, or at its handlers'
    lowest level when one is at DEBUG."""
    if not isinstance(log, logging.Logger) or log.propagate or not log.handlers:
        return
    lowest = min(handler.level for handler in log.handlers)
    log.setLevel(lowest if logging.NOTSET < lowest < logging.INFO else max(lowest, logging.WARNING))
