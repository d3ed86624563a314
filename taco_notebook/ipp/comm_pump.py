"""Answer a page's widget requests while a cell blocks the kernel's main thread (a page reloaded mid-run).

ipykernel 7 reads the shell socket on a thread of its own and hands each message to the main thread through an
inproc socket that the main thread's event loop reads. A cell that blocks that thread (the wait loop of
:mod:`taco_notebook.cluster.cells.run`, for the whole of a ``%%taco_run`` cell) leaves every message there until
it ends. A page reloaded mid-run asks for its widgets' state with such messages (``comm_open`` and ``comm_msg``
``request_states`` on ipywidgets' control comm, or ``comm_info_request`` and one ``request_state`` per widget),
so until the cell's end it would show JupyterLab's "Loading widget..." where the live dashboard had been.

:class:`CommPump`, called from a blocking wait loop, empties that socket without blocking, through the kernel's own
``ZMQStream.flush``, and sorts what it reads:

* comm messages (``comm_info_request``, ``comm_open``, ``comm_msg``, ``comm_close``) are dispatched at once by the
  kernel's own ``dispatch_shell`` in its concurrent mode (no busy/idle status): what ipykernel 7 does itself with
  comm messages that arrive while an ``async`` cell awaits. The cell's parent header is put back afterwards, so
  the cell's output stays under the cell;
* every other message (``execute_request``, ``kernel_info_request``, ...) goes, in arrival order, to the receive
  callback the kernel registered, exactly as its event loop would have handed it over: it becomes the task that
  waits for the kernel's shell lock behind the running cell and ahead of whatever arrives later, so queued cells
  run after this one, in their order.

ipykernel 6 reads the shell socket itself, on the main thread's event loop, and queues each message for its
``dispatch_queue`` (``schedule_dispatch``): the same sort applies to that socket's ``ZMQStream``. Its
``dispatch_shell`` first waits for the control thread (so it cannot run to its end here), and it has no concurrent
mode: a comm message is handed to its handler in ``shell_handlers`` directly, under its own parent and without
busy/idle, as ipykernel 7's concurrent dispatch does.

Anywhere else it does nothing: plain IPython, no IPython, the in-process kernel, a call from another thread than
the kernel's main shell thread (a subshell), or a nested call (a widget callback that waits for a cell).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import sys
import threading
import time
import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any

__all__ = ["COMM_MESSAGES", "PUMP_S", "CommPump"]

log = logging.getLogger("taco_notebook")

COMM_MESSAGES = frozenset({"comm_info_request", "comm_open", "comm_msg", "comm_close"})
PUMP_S = 0.2  # at most this often: a page's requests wait this long, the wait loop spends ~nothing when idle
MAX_MESSAGES = 200  # per pump: a burst (echoed bokeh patches) cannot hold the wait loop; the rest waits for the next

_pumping = threading.Lock()  # one pump at a time: a widget callback may itself wait for a cell


class CommPump:
    """Call it often from a loop that blocks the kernel's main thread; it dispatches the page's comm messages at
    most every ``interval`` seconds and leaves the others queued in order (see the module docstring).

    Example::

        pump = CommPump()
        while not done():
            pump()
            time.sleep(0.05)
    """

    def __init__(self, interval: float = PUMP_S) -> None:
        self.interval = interval
        self.last = 0.0
        self.dispatched = 0  # comm messages handled here (tests, debugging)
        self._kernel, self._stream, self._direct = _shell_inbox()

    @property
    def active(self) -> bool:
        """Whether this kernel's messages can be pumped from here at all."""
        return self._stream is not None

    def __call__(self, force: bool = False) -> int:
        """Dispatch the comm messages waiting now (unless called again within ``interval`` s and not ``force``);
        returns how many were dispatched."""
        if self._stream is None:
            return 0
        now = time.monotonic()
        if not force and now - self.last < self.interval:
            return 0
        self.last = now
        if not _pumping.acquire(blocking=False):
            return 0
        try:
            return self._pump()
        except Exception:  # never the cell's failure: stop pumping, the messages wait for the cell's end
            log.exception("taco: answering the page's widget requests mid-cell failed; they wait for the cell's end")
            self._stream = None
            return 0
        finally:
            _pumping.release()

    def _pump(self) -> int:
        stream = self._stream
        deliver: Callable[[Any], Any] | None = getattr(stream, "_recv_callback", None)
        copy = getattr(stream, "_recv_copy", False)
        if deliver is None:  # the kernel stopped reading (shutting down)
            return 0
        before = self.dispatched

        def sort(frames: list[Any]) -> Any:
            if _msg_type(self._kernel, frames) in COMM_MESSAGES:
                self._dispatch_now(frames)
                return None
            return deliver(frames)  # the kernel's own callback: ZMQStream makes its coroutine a task, in order

        stream.on_recv(sort, copy=copy)
        try:
            stream.flush(_zmq_flag("POLLIN"), limit=MAX_MESSAGES)
        finally:
            stream.on_recv(deliver, copy=copy)
        return self.dispatched - before

    def _dispatch_now(self, frames: list[Any]) -> None:
        """Run the kernel's ``dispatch_shell`` on a comm message now, in a copy of this context, then put the
        cell's parent back (``set_parent`` also sets the output streams' process-wide parent)."""
        kernel = self._kernel
        parent = kernel.get_parent("shell")
        ident = kernel._parent_ident["shell"]  # ipykernel's accessor for the shell parent's routing identity
        for out in (sys.stdout, sys.stderr):  # what the cell printed goes out under the cell, not the comm
            if out is not None:
                out.flush()
        context = contextvars.copy_context()
        try:
            if self._direct:
                _handle(kernel, frames, context)
            else:
                _run_or_schedule(kernel.dispatch_shell(frames, None, concurrent=True), context)
        finally:
            kernel.set_parent(ident, parent, channel="shell")
        self.dispatched += 1


def _shell_inbox() -> tuple[Any, Any, bool]:
    """The kernel, the ``ZMQStream`` its main shell thread reads messages from, and whether comm messages go to
    their handlers directly (ipykernel 6) rather than through ``dispatch_shell`` (7), if pumping can work here."""
    nothing = None, None, False
    try:
        from IPython import get_ipython
    except ImportError:
        return nothing
    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    channel: Any = getattr(kernel, "shell_channel_thread", None)  # ipykernel >= 7
    direct = channel is None
    try:
        asyncio.get_running_loop()  # the kernel's loop runs the cell: deferred messages become its tasks
        if direct:  # ipykernel 6: the main thread's loop reads the shell socket and queues for dispatch_queue
            if threading.current_thread() is not threading.main_thread() or not hasattr(kernel, "msg_queue"):
                return nothing
            stream = getattr(kernel, "shell_stream", None)
        elif threading.current_thread() is not getattr(channel, "parent_thread", None):
            return nothing
        else:
            stream = getattr(channel.manager.get_shell_channel_to_subshell_pair(None), "to_stream", None)
    except (RuntimeError, AttributeError, AssertionError):
        return nothing
    needed = ("flush", "on_recv", "_recv_callback")
    if stream is None or not all(hasattr(stream, name) for name in needed) or not hasattr(kernel, "dispatch_shell"):
        return nothing
    if direct and not isinstance(getattr(kernel, "shell_handlers", None), dict):
        return nothing
    return kernel, stream, direct


def _handle(kernel: Any, frames: list[Any], context: contextvars.Context) -> None:
    """ipykernel 6: a comm message to its handler in ``shell_handlers``, under its own parent (what its
    ``dispatch_shell`` does between the busy and idle it publishes)."""
    idents, rest = kernel.session.feed_identities(frames, copy=False)
    msg = kernel.session.deserialize(rest, content=True, copy=False)
    handler = kernel.shell_handlers.get(msg["header"]["msg_type"])
    if handler is None:
        return
    kernel.set_parent(idents, msg, channel="shell")
    result = context.run(handler, kernel.shell_stream, idents, msg)
    if inspect.isawaitable(result):
        _run_or_schedule(_awaited(result), context)
    kernel.shell_stream.flush(_zmq_flag("POLLOUT"))  # a reply (comm_info_reply) is queued on the stream: send it now


async def _awaited(result: Any) -> Any:
    return await result


def _msg_type(kernel: Any, frames: list[Any]) -> str | None:
    """The message's type, read from its header only (a peek: the session records no signature for it)."""
    try:
        _, rest = kernel.session.feed_identities(frames, copy=False)
        header = kernel.session.deserialize(rest, content=False, copy=False)["header"]
        return str(header["msg_type"])
    except Exception:  # not a message (ipykernel's "stop aborting" marker), or a bad one: the kernel's own path
        return None


def _zmq_flag(name: str) -> int:
    """``zmq.POLLIN`` or ``zmq.POLLOUT`` (zmq is imported only where a kernel runs)."""
    import zmq

    return int(getattr(zmq, name))


def _run_or_schedule(coro: Coroutine[Any, Any, Any], context: contextvars.Context) -> None:
    """Run ``coro`` to its end now when it never waits (the kernel's comm handlers do not); if it does wait, its
    rest runs as a task of the kernel's loop (after the cell), as ipykernel would have run all of it."""
    try:
        waiting_on = context.run(coro.send, None)
    except StopIteration:
        return
    asyncio.get_running_loop().create_task(_finish(coro, waiting_on), context=context)
    log.debug("taco: a comm message's handler waits; it finishes after the cell")


async def _finish(coro: Coroutine[Any, Any, Any], waiting_on: Any) -> Any:
    return await _resume(coro, waiting_on)


@types.coroutine
def _resume(coro: Coroutine[Any, Any, Any], waiting_on: Any) -> Generator[Any, Any, Any]:
    """Hand the task what ``coro``'s first step waits on, then let ``coro`` go on under the task."""
    yield waiting_on
    return (yield from coro)  # type: ignore[misc]
