"""What taco's overrides assume of ipyparallel, ipykernel and pyzmq, one row each, checkable without a cluster.

Every override in this package relies on names that upstream does not promise to keep. Each row below names
one of them, the override that relies on it and the upstream behaviour that override replaces, so that an
upstream release that drops or renames it fails ``tests/ipp/test_assumptions.py`` with that row's words
instead of breaking cells with an ``AttributeError``.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["Assumption", "ASSUMPTIONS", "broken"]

Kind = Literal["method", "attribute", "function"]


@dataclass(frozen=True)
class Assumption:
    """``owner`` (``module:Class`` or a module) has ``name``: a method, an attribute (of the class or set on
    ``self`` by one of its methods) or a module-level function."""

    owner: str
    name: str
    kind: Kind
    used_by: str
    replaces: str

    def __str__(self) -> str:
        return f"{self.owner}.{self.name} ({self.kind}), used by {self.used_by}: {self.replaces}"


def _row(owner: str, kind: Kind, used_by: str, replaces: str, *names: str) -> list[Assumption]:
    return [Assumption(owner, name, kind, used_by, replaces) for name in names]


CLIENT = "ipyparallel.client.client:Client"
FUTURE = "ipyparallel.client.futures:MessageFuture"
HUB = "ipyparallel.controller.hub:Hub"
KERNEL = "ipykernel.kernelbase:Kernel"
OUT_STREAM = "ipykernel.iostream:OutStream"
ZMQ_STREAM = "zmq.eventloop.zmqstream:ZMQStream"

ASSUMPTIONS: list[Assumption] = [
    *_row(CLIENT, "method", "client.LeanClient._send", "sending a request: batched, caches purged without a "
          "multi_future", "_send"),
    *_row(CLIENT, "method", "client.LeanClient._extract_metadata", "parsing a reply's dates through dateutil",
          "_extract_metadata"),
    *_row(CLIENT, "method", "client.LeanClient.create_message_futures", "an Event and a tracker per future",
          "create_message_futures"),
    *_row(CLIENT, "attribute", "client.LeanClient", "the request caches it fills and purges", "_futures",
          "_output_futures", "_outstanding_dict", "_engines", "_io_loop", "_closed", "outstanding", "history",
          "metadata", "results", "session"),
    *_row(CLIENT, "method", "client.LeanClient.direct_view", "views whose apply_sync swallows Ctrl-C",
          "direct_view", "_build_targets"),
    *_row(CLIENT, "attribute", "client.LeanClient.direct_view", "the stream a view sends on", "_mux_stream"),
    *_row("ipyparallel.client.view:DirectView", "method", "client.InterruptibleView.apply_sync", "a blocking apply "
          "that returns its AsyncResult at Ctrl-C", "apply_sync", "apply_async"),
    *_row("ipyparallel.cluster.cluster:Cluster", "method", "client.connect", "connect_client_sync with taco's "
          "client class", "_synchronize"),
    *_row("ipyparallel.util", "function", "client.parse_date", "dateutil's parse of every date", "_parse_date",
          "utcnow"),
    *_row(FUTURE, "attribute", "client.LeanFuture", "MessageFuture's Event-based wait", "msg_id", "header",
          "track", "tracker", "iopub_callbacks"),
    *_row(FUTURE, "method", "client.LeanFuture.wait", "MessageFuture's Event-based wait", "wait"),
    *_row("ipyparallel.controller.app:IPController", "method", "hub.TacoController.init_hub", "the hub's "
          "monitor handlers", "init_hub"),
    *_row(HUB, "attribute", "hub.lean_monitor", "deserialising every monitored message in full", "monitor_handlers",
          "by_ident", "pending", "queues", "all_completed", "completed", "session", "monitor"),
    *_row(HUB, "method", "hub.drain_monitor", "one monitor message per turn of the event loop",
          "dispatch_monitor_traffic"),
    *_row(KERNEL, "method", "quiet_kernel.QuietKernel._publish_status", "a busy and an idle status per request",
          "_publish_status", "get_parent"),
    *_row(KERNEL, "attribute", "quiet_kernel and comm_pump", "the kernel's IOPub socket and shell parent",
          "iopub_socket", "log", "_parent_ident"),
    *_row(KERNEL, "attribute", "signals.answer_signals", "the nanny process's signal_request",
          "control_handlers", "session"),
    *_row(KERNEL, "method", "comm_pump.CommPump", "widget messages waiting for the cell's end", "dispatch_shell",
          "set_parent"),
    *_row(OUT_STREAM, "attribute", "stdstreams.LeanOutStream.flush", "an IOPub round trip per empty flush",
          "_flush_pending", "_subprocess_flush_pending", "_buffers", "echo", "pub_thread"),
    *_row(ZMQ_STREAM, "attribute", "comm_pump.CommPump._pump", "the shell stream's own callback",
          "_recv_callback", "_recv_copy"),
    *_row(ZMQ_STREAM, "method", "comm_pump and client._Direct", "reading and sending on the stream's loop only",
          "on_recv", "flush", "sending", "receiving"),
]


def _owner(spec: str) -> object:
    module, _, qualname = spec.partition(":")
    found: object = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        found = getattr(found, part)
    return found


def _sets_on_self(cls: type, name: str) -> bool:
    """Whether a method of ``cls`` or of a base assigns ``self.name`` (an instance attribute)."""
    assign = re.compile(rf"self\.{re.escape(name)}\s*(:[^=\n]*)?=[^=]")
    for klass in cls.__mro__:
        try:
            if assign.search(inspect.getsource(klass)):
                return True
        except (OSError, TypeError):
            continue
    return False


def broken(assumption: Assumption) -> str | None:
    """What no longer holds of ``assumption`` in the installed upstream, or None when it holds."""
    try:
        owner = _owner(assumption.owner)
    except (ImportError, AttributeError) as exc:
        return f"{assumption}: {assumption.owner} cannot be found ({exc})"
    value = getattr(owner, assumption.name, None)
    if assumption.kind in ("method", "function"):
        holds = callable(value)
    else:
        holds = hasattr(owner, assumption.name) or (isinstance(owner, type) and _sets_on_self(owner, assumption.name))
    return None if holds else f"{assumption}: no longer there"
