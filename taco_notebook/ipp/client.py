"""The notebook's ipyparallel client, with the per-rank cost of a request cut where ipyparallel spends it.

A cell is one ``apply`` per rank (:mod:`taco_notebook.cluster.cells.run`), so whatever ipyparallel's client does
per request it does N times per cell. Per request, ipyparallel's client makes:

* **seven ``threading.Condition`` objects**: a reply and an output future, each with an ``Event`` for
  ``MessageFuture.wait`` and a "sent" future, already resolved unless the request is tracked, and a
  ``multi_future`` over the pair only to purge the client's caches when both are done;
* **a wake-up of the IO thread** (``call_soon_threadsafe``: a write to its self-pipe), and on that thread a
  ``ZMQStream`` queue that reads the socket's events (a ``getsockopt``) and schedules one more callback per
  message before it sends;
* **the reply's ``started`` date through dateutil**, a slow parse.

:class:`LeanClient` keeps every behaviour and attribute the rest of ipyparallel (views, ``AsyncResult``,
``RankTracker``) reads, and does the same work once per request or once per batch:

* futures waited on through their own condition (:class:`LeanFuture`), one shared resolved "sent" future for
  untracked requests, and instead of the ``multi_future`` a done callback that purges once all of a request's
  futures are done;
* the requests of one ``apply`` to N ranks handed to the IO thread as one batch, sent straight on the socket
  when nothing is queued on its stream (in order: once a send would block, it and the rest go through the
  stream's queue). zmq's socket descriptor is edge-triggered and a send on the socket can consume the edge of a
  reply that arrived meanwhile, so the batch ends by reading whatever the stream has pending
  (``ZMQStream.flush``);
* the ``started`` date through ``datetime.fromisoformat``, dateutil only for what it does not read.

Its views (``client[ranks]``) are :class:`InterruptibleView`: ipyparallel's blocking ``apply_sync`` catches a
Ctrl-C (or a SIGTERM turned into one) and returns its ``AsyncResult`` in place of the results, which the caller
then takes for them; here the KeyboardInterrupt goes on up.

:func:`connect` is ``ipp.Cluster.connect_client`` with this class (``benchmarks/cell_protocol.py`` measures
ipyparallel's client beside it).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout  # the builtin's alias from 3.11 only
from datetime import datetime
from typing import Any

import ipyparallel as ipp
import zmq
from ipyparallel import util
from ipyparallel.client.futures import MessageFuture
from zmq.eventloop.zmqstream import ZMQStream

__all__ = ["LeanClient", "LeanFuture", "InterruptibleView", "connect", "parse_date"]

_SENT: Future[Any] = Future()  # the "sent" future of every untracked request: resolved at once, as ipyparallel's
_SENT.set_result(None)


class LeanFuture(MessageFuture):
    """ipyparallel's ``MessageFuture`` without its ``Event``: :meth:`wait` waits on the future's own condition,
    and an untracked request shares one resolved ``tracker``."""

    def __init__(self, msg_id: str, header: dict[str, Any] | None = None, *, track: bool = False) -> None:
        Future.__init__(self)  # not MessageFuture's: it makes the Event and the tracker this class does without
        self.msg_id = msg_id
        self.header = header or {"msg_type": "unknown_request"}
        self.track = track
        self.tracker = Future() if track else _SENT
        self.iopub_callbacks: list[Callable[[dict[str, Any]], None]] = []

    def wait(self, timeout: float | None = None) -> bool:
        """True once the future is done (result, exception or cancelled); False if ``timeout`` passed first."""
        try:
            self.exception(timeout)
        except FutureTimeout:
            return False
        except CancelledError:  # done all the same (a Ctrl-C in the wait still reaches the caller)
            pass
        return True


def parse_date(text: Any) -> Any:
    """An engine's ISO 8601 timestamp as an aware ``datetime``, as ``ipyparallel.util._parse_date`` gives it
    (which runs the slower dateutil): ``fromisoformat`` reads what engines send, the rest goes to ipyparallel."""
    if isinstance(text, str):
        try:
            parsed = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
        except ValueError:
            pass
        else:
            if parsed.tzinfo is not None:
                return parsed
    return util._parse_date(text)


class InterruptibleView(ipp.DirectView):  # type: ignore[misc]
    """ipyparallel's ``DirectView``, whose ``apply_sync`` lets a KeyboardInterrupt through (module docstring)."""

    def apply_sync(self, f: Any, /, *args: Any, **kwargs: Any) -> Any:
        return self.apply_async(f, *args, **kwargs).get()


class LeanClient(ipp.Client):
    """``ipp.Client`` whose requests cost the notebook less each (module docstring); behaves as its base."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._batch: list[Callable[[], None]] = []
        self._batch_lock = threading.Lock()
        self._direct: set[ZMQStream] = set()  # streams sent on directly in this batch: their replies to read
        super().__init__(*args, **kwargs)

    def direct_view(self, targets: Any = "all", **kwargs: Any) -> InterruptibleView:
        """``Client.direct_view`` (what ``client[ranks]`` makes), an :class:`InterruptibleView`."""
        single = isinstance(targets, int)
        if targets != "all":  # "all" stays lazy: the engines of each request
            targets = self._build_targets(targets)[1]
            if single:
                targets = targets[0]
        return InterruptibleView(client=self, socket=self._mux_stream, targets=targets, **kwargs)

    def create_message_futures(self, msg_id: str, header: dict[str, Any], async_result: bool = False,
                               track: bool = False, label: str | None = None) -> list[LeanFuture]:
        msg_future = LeanFuture(msg_id, header=header, track=track)
        futures = [msg_future]
        self._futures[msg_id] = msg_future
        if async_result:
            output = LeanFuture(msg_id, header=header)
            self._output_futures[msg_id] = output
            output.metadata = self.metadata[msg_id]
            output.metadata["submitted"] = util.utcnow()
            output.metadata["label"] = label
            msg_future.output = output
            futures.append(output)
        return futures

    def _send(self, socket: Any, msg_type: str, content: Any = None, parent: Any = None, ident: Any = None,
              buffers: Any = None, track: bool = False, header: Any = None, metadata: Any = None,
              track_outstanding: bool = False, message_future_hook: Any = None) -> Any:
        """ipyparallel's ``Client._send`` (same arguments, bookkeeping and futures), its caches purged without a
        ``multi_future`` and its send batched (module docstring)."""
        if self._closed:
            raise OSError("Connections have been closed.")
        msg = self.session.msg(msg_type, content=content, parent=parent, header=header, metadata=metadata)
        msg_id = msg["header"]["msg_id"]
        expect_reply = msg_type not in {"comm_msg", "comm_close", "comm_open"}
        if expect_reply and track_outstanding:
            self.outstanding.add(msg_id)
            self.history.append(msg_id)
            if ident:  # routed to one engine: remembered in case it dies
                engine = (ident[-1] if isinstance(ident, list) else ident).decode("utf-8")
                if engine in self._engines.values():
                    self._outstanding_dict[engine].add(msg_id)
            self.metadata["submitted"] = util.utcnow()
        futures: list[LeanFuture] = []
        if expect_reply:
            label = metadata["label"] if metadata and "label" in metadata else None
            futures = self.create_message_futures(msg_id, msg["header"],
                                                  async_result=msg_type in {"execute_request", "apply_request"},
                                                  track=track, label=label)
            if message_future_hook is not None:
                message_future_hook(futures[0])
            self._purge_when_done(msg_id, futures)

        def send() -> None:
            direct = not track and isinstance(socket, ZMQStream)
            try:
                sent = self.session.send(_Direct(socket, self._direct) if direct else socket, msg, track=track,
                                         buffers=buffers, ident=ident)
            except Exception as exc:  # (a buffer zmq cannot send, a closed socket): this request fails, not hangs
                self.outstanding.discard(msg_id)
                for future in futures:
                    if not future.done():
                        future.set_exception(exc)
                return
            if track:
                futures[0].tracker.set_result(sent["tracker"])

        with self._batch_lock:
            self._batch.append(send)
            first = len(self._batch) == 1
        if first:  # one wake-up of the IO thread per batch, not per request
            self._io_loop.add_callback(self._send_batch)
        return futures[0] if expect_reply else None

    def _purge_when_done(self, msg_id: str, futures: list[LeanFuture]) -> None:
        """Drop the request's result, futures and metadata from the client's caches once all its futures are
        done, as ipyparallel's ``multi_future`` callback did."""
        def done(_: Future[Any]) -> None:
            if not all(future.done() for future in futures):
                return  # (both may see all done when they finish together: the pops below are idempotent)
            self.results.pop(msg_id, None)
            self._futures.pop(msg_id, None)
            self._output_futures.pop(msg_id, None)
            self.metadata.pop(msg_id, None)

        for future in futures:
            future.add_done_callback(done)

    def _send_batch(self) -> None:
        """On the IO thread: send what was queued, then read what arrived on the streams sent on directly."""
        with self._batch_lock:
            batch, self._batch = self._batch, []
        for send in batch:
            send()
        while self._direct:
            stream = self._direct.pop()
            if stream.receiving():  # (flush would drop what a stream with no reader holds; ipyparallel's all read)
                stream.flush(zmq.POLLIN)

    def _extract_metadata(self, msg: dict[str, Any]) -> dict[str, Any]:
        meta = msg["metadata"]
        started = meta.pop("started", None)  # ipyparallel's own parse of it is dateutil's
        try:
            md: dict[str, Any] = super()._extract_metadata(msg)
        finally:
            if started is not None:
                meta["started"] = started
        if started is not None:
            md["started"] = parse_date(started)
        return md


class _Direct:
    """What ``Session.send`` sends through: the stream's socket at once while the stream has nothing queued
    (never blocking: a full pipe queues on the stream, and everything after it then does, in order)."""

    def __init__(self, stream: ZMQStream, used: set[ZMQStream]) -> None:
        self.stream, self.used = stream, used

    def send_multipart(self, parts: list[Any], copy: bool = True, **_: Any) -> None:
        if not self.stream.sending():
            try:
                self.stream.socket.send_multipart(parts, flags=zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                pass
            else:
                self.used.add(self.stream)
                return
        self.stream.send_multipart(parts, copy=copy)


def connect(cluster: ipp.Cluster) -> LeanClient:
    """A :class:`LeanClient` on ``cluster``'s controller: ``cluster.connect_client_sync()`` with this class."""

    async def make() -> LeanClient:
        info = cluster.controller.get_connection_info()
        if inspect.isawaitable(info):
            info = await info
        return LeanClient(info["client"], cluster=cluster, profile_dir=cluster.profile_dir,
                          cluster_id=cluster.cluster_id)

    return cluster._synchronize(make)
