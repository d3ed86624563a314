"""taco's controller process: ipyparallel's ``IPController`` with a hub that reads only what it acts on.

ipyparallel's hub subscribes to a copy of every message its queues pass (requests, replies, IOPub) and
deserialises each in full: signature, four JSON frames, the dates in them, then a database record. With
``NoDB`` (:func:`.engineset.controller_args`) the records are thrown away, yet the hub still parses every
request, reply, status and output line of every rank. Here the hub keeps what it uses the messages for, read
from the one frame that carries it:

* a request to an engine (``in``) and its reply (``out``): the pending and completed bookkeeping that
  ``Client.queue_status`` reports and the hub walks when an engine goes away, from the request's header and
  the reply's parent header, with the signature still checked;
* IOPub: only an engine's ``shutdown_reply``, after which the hub unregisters the engine; the rest (status,
  output, dashboard payloads) would only have been written to the database that ``NoDB`` discards.

Anything these readers do not recognise (a message without identities or with a bad signature, an unknown
engine) goes to ipyparallel's own handler, which logs it, except an engine's ``iopub_welcome`` (ipykernel's
greeting of each new IOPub subscriber, sent without identities), which is dropped unlogged. The controller process
that runs it is :mod:`taco_notebook.controller`.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from ipyparallel.controller.app import IPController
from jupyter_client.session import DELIM

__all__ = ["TacoController", "lean_monitor", "drain_monitor", "is_iopub_welcome"]

Handler = Callable[[list[bytes], list[bytes]], None]
BATCH = 1000  # monitor messages read in one turn of the event loop at most


class TacoController(IPController):
    """ipyparallel's controller, its hub reading the monitor stream through :func:`lean_monitor`."""

    def init_hub(self) -> None:
        super().init_hub()
        lean_monitor(self.hub)
        drain_monitor(self.hub)


def lean_monitor(hub: Any) -> None:
    """Replace ``hub``'s handlers of requests, replies and IOPub on its monitor stream with readers of the one
    frame each needs (the request's header, the reply's parent header, the IOPub header's type)."""
    handlers: dict[bytes, Handler] = hub.monitor_handlers
    full_request, full_reply, full_iopub = handlers[b"in"], handlers[b"out"], handlers[b"iopub"]

    def request(idents: list[bytes], msg: list[bytes]) -> None:
        eid = hub.by_ident.get(idents[0]) if len(idents) >= 2 else None
        header = _signed_frame(hub.session, msg, 1) if eid is not None else None
        if header is None or "msg_id" not in header:
            return full_request(idents, msg)
        hub.pending.add(header["msg_id"])
        hub.queues[eid].append(header["msg_id"])

    def reply(idents: list[bytes], msg: list[bytes]) -> None:
        eid = hub.by_ident.get(idents[1]) if len(idents) >= 2 else None
        parent = _signed_frame(hub.session, msg, 2) if eid is not None else None
        if parent is None:
            return full_reply(idents, msg)
        msg_id = parent.get("msg_id")
        if msg_id in hub.pending:
            hub.pending.remove(msg_id)
            hub.all_completed.add(msg_id)
            if msg_id in hub.queues[eid]:
                hub.queues[eid].remove(msg_id)
            hub.completed[eid].append(msg_id)

    def iopub(idents: list[bytes], msg: list[bytes]) -> None:
        if len(msg) > 1 and b"shutdown_reply" in msg[1]:  # the header names the type; a false match costs a parse
            full_iopub(idents, msg)

    handlers.update({b"in": request, b"out": reply, b"iopub": iopub})


def drain_monitor(hub: Any, batch: int = BATCH) -> None:
    """Read the monitor stream's messages in batches: each time the stream hands the hub a message, the hub
    goes on reading what is already queued (up to ``batch``, so that registrations and queries still get
    their turn) before it returns to the event loop. ``ZMQStream`` reads one message per turn of the loop and
    asks the socket for its events after each, which would cost more than the lean handlers themselves."""
    import zmq

    stream, full_dispatch = hub.monitor, hub.dispatch_monitor_traffic

    def dispatch(msg: list[bytes]) -> None:
        if not is_iopub_welcome(hub.session, msg):
            full_dispatch(msg)

    def read(msg: list[bytes]) -> None:
        dispatch(msg)
        for _ in range(batch):
            try:
                msg = stream.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            dispatch(msg)

    stream.stop_on_recv()
    stream.on_recv(read)


def is_iopub_welcome(session: Any, msg: list[bytes]) -> bool:
    """True for a monitored ``iopub_welcome`` ([b"iopub", DELIM, signature, header, ...], no identities): an
    engine's IOPub thread greets each new subscriber with one, and ipyparallel's hub would log it as an error
    ("Monitor message without topic"). Only messages without identities are unpacked, so others cost a compare."""
    if len(msg) < 4 or msg[0] != b"iopub" or bytes(msg[1]) != DELIM:
        return False
    try:
        header = session.unpack(msg[3])
    except Exception:
        return False
    return isinstance(header, dict) and header.get("msg_type") == "iopub_welcome"


def _signed_frame(session: Any, msg: list[bytes], index: int) -> dict[str, Any] | None:
    """Frame ``index`` of ``msg`` ([signature, header, parent, metadata, content, buffers...]) unpacked, if the
    message carries the session's signature; None if not, or if the frame is not a mapping."""
    if len(msg) < 5:
        return None
    if session.auth is not None and not hmac.compare_digest(session.sign(msg[1:5]), bytes(msg[0])):
        return None
    try:
        frame = session.unpack(msg[index])
    except Exception:
        return None
    return frame if isinstance(frame, dict) else None
