"""The notebook's client (ipp/client.py): ipyparallel's, with requests that cost less each. What views and
cells rely on must hold on real engines: results, errors by engine, tracked sends, the metadata's dates, the
client's caches emptied, requests from several threads at once, and replies that arrive while a batch is sent
straight on the socket (zmq's edge-triggered descriptor: a send can consume a reply's wake-up)."""

from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import CancelledError
from datetime import datetime, timezone
from pathlib import Path

import pytest

pytest.importorskip("ipyparallel")
import ipyparallel as ipp  # noqa: E402
import zmq  # noqa: E402
from ipyparallel import util  # noqa: E402
from tornado.ioloop import IOLoop  # noqa: E402
from zmq.eventloop.zmqstream import ZMQStream  # noqa: E402

from taco_notebook.ipp.client import LeanClient, LeanFuture, _Direct, parse_date  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def plain(monkeypatch):
    """Three plain ipyparallel engines and taco's controller, as benchmarks/cell_protocol.py starts them; its
    ``client`` is a LeanClient (cluster.client.connect), ``stock`` ipyparallel's own on the same controller."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from cell_protocol import Plain

    cluster = Plain(3, timeout=120)
    try:
        yield cluster
    finally:
        cluster.stop()


def _pid_and(value):
    import os

    return os.getpid(), value


def _note_and_sleep(folder, seconds):
    """Leave a file named by this engine's pid in ``folder``, then sleep."""
    import os
    import time

    open(os.path.join(folder, str(os.getpid())), "w").close()
    time.sleep(seconds)


def _fail_on(rank_pid, value):
    import os

    if os.getpid() == rank_pid:
        raise ValueError(f"refused {value}")
    return value


@pytest.mark.cluster
def test_the_cluster_client_is_lean_and_answers_as_ipyparallel(plain):
    """Results, execute and pull, an error named by its engine, the metadata's dates, the caches emptied."""
    assert isinstance(plain.client, LeanClient) and type(plain.stock) is ipp.Client
    lean = plain.client[:].apply_sync(_pid_and, 7)
    stock = plain.stock[:].apply_sync(_pid_and, 7)
    assert lean == stock and len({pid for pid, _ in lean}) == 3
    plain.client[:].execute("x = 41 + 1", block=True)
    assert plain.client[:].pull("x", block=True) == [42, 42, 42]
    _an_error_names_its_engine_and_the_others_still_answer(plain)
    _metadata_dates_are_aware_and_the_caches_emptied(plain)


def _an_error_names_its_engine_and_the_others_still_answer(plain):
    pids = [pid for pid, _ in plain.client[:].apply_sync(_pid_and, 0)]
    ar = plain.client[:].apply_async(_fail_on, pids[1], "x")
    with pytest.raises(ipp.error.CompositeError) as raised:
        ar.get(timeout=30)
    assert "ValueError" in str(raised.value) and "refused x" in str(raised.value)
    assert [info["engine_id"] for _, _, _, info in raised.value.elist] == [1]
    answers = ar.get(return_exceptions=True)
    assert answers[0] == answers[2] == "x" and isinstance(answers[1], ipp.error.RemoteError)


def _metadata_dates_are_aware_and_the_caches_emptied(plain):
    ar = plain.client[:].apply_async(_pid_and, 1)
    ar.get(timeout=30)
    ar.wait_for_output(timeout=30)
    assert ar.sent
    for md in ar.metadata:
        assert isinstance(md["started"], datetime) and md["started"].tzinfo is not None
        assert md["submitted"] <= md["received"]
        assert abs((md["started"] - md["submitted"]).total_seconds()) < 30
    for msg_id in ar.msg_ids:
        assert msg_id not in plain.client._futures and msg_id not in plain.client._output_futures
        assert msg_id not in plain.client.outstanding and msg_id not in plain.client.results
    assert not plain.client.outstanding


@pytest.mark.cluster
def test_a_tracked_send_resolves_its_tracker(plain):
    """A tracked request keeps its own "sent" future and goes through the stream's queue, as ipyparallel's does
    (a ZMQStream cannot track a send: Session.send resolves it at once), and an untracked one after it waits its
    turn behind it (the stream is busy, so _Direct queues it too)."""
    import numpy as np

    big = np.ones(1 << 20)  # 8 MiB
    tracked = plain.client[:]
    tracked.track = True
    ar = tracked.apply_async(_sum, big)
    ar.wait_for_send(timeout=60)
    assert ar.sent and ar.get(timeout=60) == [float(1 << 20)] * 3
    assert plain.client[:].apply_sync(_pid_and, "after")[0][1] == "after"


def _sum(array):
    return float(array.sum())


@pytest.mark.cluster
def test_many_requests_from_several_threads_all_complete(plain):
    """Batches built from four threads at once, each request answered once (the batch's lock), and no reply
    lost when it lands while a batch is being sent on the socket (the flush after a batch)."""
    errors: list[BaseException] = []

    def cells(seed: int) -> None:
        try:
            for i in range(60):
                assert plain.client[:].apply_async(_pid_and, seed * 1000 + i).get(timeout=30)[0][1] == seed * 1000 + i
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=cells, args=(seed,)) for seed in range(4)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "requests hung"
    assert not errors, errors
    assert time.monotonic() - began < 120


@pytest.mark.cluster
def test_a_request_that_cannot_be_sent_fails_and_the_rest_of_its_batch_goes(plain):
    """A send that raises on the IO thread (here a buffer zmq cannot send) fails its own request's futures
    instead of leaving them waiting for ever (ipyparallel's logged it and left them), and the requests batched
    with it still go."""
    client = plain.client
    engine = client._engines[0].encode()
    client._io_loop.add_callback(time.sleep, 0.5)  # the IO thread busy, so that all three requests go in one batch
    bad = client._send(client._mux_stream, "apply_request", buffers=[object()], ident=[engine],
                       track_outstanding=True)
    good = [client[i].apply_async(_pid_and, i) for i in (1, 2)]
    assert len(client._batch) == 3
    with pytest.raises(TypeError, match="buffer protocol"):
        bad.result(timeout=30)
    assert [ar.get(timeout=30)[1] for ar in good] == [1, 2]
    assert bad.msg_id not in client.outstanding


def test_lean_future_waits_as_a_message_future():
    future = LeanFuture("m")
    assert future.wait(0.01) is False and future.tracker.done()
    threading.Timer(0.05, future.set_result, (3,)).start()
    assert future.wait(5) is True and future.result() == 3
    cancelled = LeanFuture("c")
    cancelled.cancel()
    assert cancelled.wait(0) is True
    with pytest.raises(CancelledError):
        cancelled.result()
    assert not LeanFuture("t", track=True).tracker.done()


@pytest.mark.parametrize("text", ["2026-11-27T18:47:00.123456Z", "2026-11-27T18:47:00Z",
                                  "2026-11-27T18:47:00.123456+00:00", "2026-11-27T19:47:00.5+01:00",
                                  "2026-11-27T18:47:00.123456", "not a date", None])
def test_parse_date_agrees_with_ipyparallel(text):
    with warnings.catch_warnings():  # ipyparallel's for a date with no zone (read as local time), from both
        warnings.simplefilter("ignore", DeprecationWarning)
        assert parse_date(text) == util._parse_date(text)
        if isinstance(text, str) and text[0] == "2":
            assert parse_date(text).tzinfo is not None


def test_parse_date_reads_utc():
    assert parse_date("2026-11-27T18:47:00.5Z") == datetime(2026, 11, 27, 18, 47, 0, 500000, tzinfo=timezone.utc)


def test_direct_sends_queue_on_the_stream_once_the_pipe_is_full_and_keep_their_order():
    """A real zmq pipe with room for a message or two and nobody reading yet: the first sends go straight on the
    socket, the one that would block goes to the stream's queue, and so does every later one (the order kept)."""
    context = zmq.Context()
    loop = IOLoop(make_current=False)
    sender = context.socket(zmq.PUSH)
    receiver = context.socket(zmq.PULL)
    try:
        sender.sndhwm = receiver.rcvhwm = 1
        sender.bind("inproc://direct")
        receiver.connect("inproc://direct")
        stream = ZMQStream(sender, loop)
        used: set[ZMQStream] = set()
        direct = _Direct(stream, used)
        for i in range(8):
            loop.add_callback(direct.send_multipart, [b"%d" % i])
        loop.add_callback(loop.stop)
        loop.start()
        assert used == {stream}, "nothing went straight on the socket"
        assert stream.sending(), "nothing waits in the stream's queue"
        got: list[int] = []

        def pump() -> None:
            while receiver.poll(0):
                got.append(int(receiver.recv()))
            if len(got) < 8:
                loop.call_later(0.01, pump)
            else:
                loop.stop()

        loop.add_callback(pump)
        loop.call_later(20, loop.stop)
        loop.start()
        assert got == list(range(8))
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)
        loop.close()
        context.term()


def _no_nanny(engine_pids: list[int]) -> None:
    """The engines run with ``--IPEngine.enable_nanny=False``, and nothing this process started is a nanny."""
    import psutil

    commands = []
    for process in psutil.Process().children(recursive=True):
        try:
            commands.append(" ".join(process.cmdline()))
        except psutil.Error:
            continue
    assert not [c for c in commands if "ipyparallel.engine.nanny" in c], commands
    for pid in engine_pids:
        assert "--IPEngine.enable_nanny=False" in psutil.Process(pid).cmdline(), pid


@pytest.mark.cluster
def test_ctrl_c_in_a_blocking_apply_raises_and_the_engines_take_a_clients_sigint(plain, sigint_as_in_a_kernel,
                                                                                   tmp_path):
    """ipyparallel's ``apply_sync`` swallows Ctrl-C and returns its AsyncResult; the lean client's views raise
    KeyboardInterrupt. The engines run without a nanny, and a client's SIGINT still reaches them
    (ipp/signals.py): their 60 s sleep ends at once, and they answer the next request."""
    import os
    import signal

    _no_nanny([pid for pid, _ in plain.client[:].apply_sync(_pid_and, 0)])

    def ctrl_c_once_every_engine_sleeps() -> None:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.iterdir())) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    pressing = threading.Thread(target=ctrl_c_once_every_engine_sleeps, daemon=True)
    pressing.start()
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        plain.client[:].apply_sync(_note_and_sleep, str(tmp_path), 60)
    pressing.join()
    assert time.monotonic() - began < 50
    asleep = plain.client.history[-3:]  # the three sleeps, still running on the engines
    assert plain.client.send_signal("SIGINT", block=True) is None  # every engine answered ok
    interrupted = ipp.AsyncResult(plain.client, asleep)
    with pytest.raises(ipp.error.CompositeError) as raised:
        interrupted.get(timeout=30)
    assert [error[0] for error in raised.value.elist] == ["KeyboardInterrupt"] * 3, raised.value
    assert len({pid for pid, _ in plain.client[:].apply_sync(_pid_and, 1)}) == 3
    with pytest.raises(ipp.error.RemoteError, match="no such signal"):
        plain.client.send_signal("SIGNOPE", block=True)
