"""An engine's ``sys.stdout`` and ``sys.stderr`` that skip the IOPub round trip when they hold nothing.

ipykernel's ``OutStream.flush`` hands the IOPub thread a flush and an event, then waits for the event, whether or
not anything was written: a barrier behind everything queued on that thread. An engine flushes both streams
after every request (ipyparallel's ``apply_request``) and again after every message it handles (ipykernel's
``dispatch_shell``): four thread round trips per empty cell, a large share of an engine's CPU for one.

The barrier orders nothing that needs it when the stream holds nothing: the reply goes on the shell socket, the
idle status that tells the client a request's output is complete is queued on the same IOPub thread after anything
queued before it, and ``%%taco_run`` waits for that status (``AsyncResult.wait_for_output``) before it reads a
cell's output (for a cell that sent nothing, its reply says so instead: :mod:`.quiet_kernel`). So
``LeanOutStream`` flushes as ipykernel does whenever the stream has a write in its buffers or a flush pending (or
echoes to a terminal), and returns at once otherwise. A write from another thread fills the buffer before it
marks the flush pending, and the IOPub thread marks it done before it empties the buffer: either is seen.

Only ipykernel's own ``OutStream`` with that state (ipykernel 6.29 to 7) is changed, by giving the two stream
objects the subclass; anything else (a stream a user or another library put in place) is left as it is.
"""

from __future__ import annotations

import functools
import sys

__all__ = ["lean_streams"]

_STATE = ("_flush_pending", "_subprocess_flush_pending", "_buffers", "echo", "pub_thread")


@functools.cache
def _lean_class() -> type:
    """``LeanOutStream``, made on first use: ipykernel is imported only in a process whose streams are its."""
    from ipykernel.iostream import OutStream

    class LeanOutStream(OutStream):  # type: ignore[misc]
        """ipykernel's OutStream whose flush skips the IOPub thread when there is nothing to flush."""

        def flush(self) -> None:
            if (self.echo is None and not self._flush_pending and not self._subprocess_flush_pending
                    and not self._buffers):
                return
            super().flush()

    return LeanOutStream


def lean_streams() -> None:
    """Give this process's ``sys.stdout`` and ``sys.stderr`` the lean flush where they are ipykernel's
    ``OutStream`` (idempotent: a stream that has it is no longer exactly an ``OutStream``)."""
    from ipykernel.iostream import OutStream

    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if type(stream) is OutStream and all(hasattr(stream, attr) for attr in _STATE):
            stream.__class__ = _lean_class()
