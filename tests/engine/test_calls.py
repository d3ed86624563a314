"""The kernel–engine protocol: each function of ``engine/calls.py`` does its job on real engines through
``view.apply``, and nothing but the user's cell reaches the engines as source."""

from __future__ import annotations

import ast
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from taco_notebook.comm.compression.spec import CompressionSpec
from taco_notebook.engine import calls, runner
from taco_notebook.engine.wire import CellReply, CellSettings, CellSetup

from ..support.waiting import wait_until

ENGINE_DIR = Path(calls.__file__).parent
CLUSTER_DIR = ENGINE_DIR.parent / "cluster"
TRAIN = "for _ in taco.progress(range(20)):\n    taco.metrics.step(samples=2)\n"


def _settings() -> dict[str, Any]:
    import dataclasses

    import taco_notebook.comm as taco

    s = taco.settings()  # its fields as they are (asdict would unpack the compression spec into a dict)
    return {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}


def _group_up() -> bool:
    import taco_notebook.comm as taco

    return taco.is_initialized()


def _allreduce_rank() -> float:
    import torch

    import taco_notebook.comm as taco

    t = torch.full((4,), float(taco.rank() + 1))
    taco.allreduce(t)
    return float(t[0])


def _namespace() -> tuple[str, str, int]:
    from IPython import get_ipython

    shell = get_ipython()
    flushes = [cb for cb in shell.events.callbacks["post_execute"] if cb == calls._sender.flush]
    return shell.user_ns["taco"].__name__, shell.InteractiveTB.mode, len(flushes)


def _sender_state() -> tuple[bool, int]:
    from taco_notebook.comm.diagnostics import metrics

    return metrics.sender() is calls._sender, metrics.steps()


def _flushes() -> tuple[str, str, int, bool, str]:
    """The streams' class, and how many tasks flushing handed the IOPub thread: both streams with nothing in
    them, then stdout after a write (ipykernel's own ``schedule``, counted on the real thread object)."""
    pub = sys.stdout.pub_thread
    handed: list[Any] = []
    schedule = pub.schedule
    pub.schedule = lambda task: (handed.append(task), schedule(task))[1]
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        quiet = len(handed)
        print("written", end="")
        sys.stdout.flush()
        loud = len(handed) - quiet >= 2  # ipykernel's flush: its _flush and the event it waits for (and more)
    finally:
        del pub.schedule
    return type(sys.stdout).__name__, type(sys.stderr).__name__, quiet, loud, type(sys.stdout).__mro__[1].__name__


def _say(word: str) -> tuple[str, int]:
    """Prints ``word``; the kernel's class and its logger's level."""
    from IPython import get_ipython

    print(word)
    kernel = get_ipython().kernel
    return type(kernel).__name__, kernel.log.getEffectiveLevel()


def _warn(text: str) -> None:
    from IPython import get_ipython

    get_ipython().kernel.log.warning(text)


def _statuses(client: Any, rank: int, word: str) -> tuple[tuple[str, int], list[tuple[str, str]]]:
    """Send ``_say(word)`` to ``rank`` and list the request's IOPub messages as the notebook's client receives
    them, from before the request leaves (the hook runs before the send is handed to the IO thread), until its
    idle status resolved the request's output future. The idle status is listed only when it came before the
    reply: when it completes the request, ipyparallel drops the request's futures before it calls their callbacks."""
    seen: list[tuple[str, str]] = []

    def watch(future: Any) -> None:
        future.iopub_callbacks.append(lambda msg: seen.append(
            (msg["header"]["msg_type"], msg["content"].get("execution_state") or msg["content"].get("text"))))

    (ident,), _ = client._build_targets(rank)
    future = client.send_apply_request(client[rank]._socket, _say, [word], ident=ident,
                                       message_future_hook=watch)
    reply = future.result(60)
    assert future.output.wait(10), f"rank {rank}'s idle status did not arrive"
    return reply, seen


@pytest.fixture
def view(shared_cluster: Any) -> Iterator[Any]:
    """The shared cluster's engines; each test leaves them with default settings, a group and no sender."""
    yield shared_cluster.view
    shared_cluster.view.apply_sync(calls.reset_settings)
    if not all(shared_cluster.view.apply_sync(_group_up)):
        shared_cluster.view.apply_sync(calls.reinit)
    shared_cluster.view.apply_sync(calls.begin_cell, False)


@pytest.mark.cluster
def test_setup_made_taco_the_rank_api_with_plain_tracebacks_and_one_flush(view):
    assert view.apply_sync(_namespace) == [("taco_notebook.comm", "Plain", 1)] * 4


@pytest.mark.cluster
def test_an_empty_stream_flushes_without_the_iopub_thread_and_output_still_arrives(view):
    """stdstreams.py: flushing a stream with nothing in it hands the IOPub thread nothing (ipykernel's flush
    makes four round trips to it per request); after a write, the flush goes through ipykernel's, and every
    line arrives, also lines a thread wrote just before the cell ended."""
    probe = view.apply_async(_flushes)
    assert probe.get(60) == [("LeanOutStream", "LeanOutStream", 0, True, "OutStream")] * 4
    probe.wait_for_output(5)
    assert probe.stdout == ["written"] * 4
    threaded = view.execute("import threading\n"
                            "t = threading.Thread(target=lambda: [print('line', i) for i in range(300)])\n"
                            "t.start(); t.join()", block=False)
    threaded.get(60)
    threaded.wait_for_output(5)
    assert threaded.stdout == ["".join(f"line {i}\n" for i in range(300))] * 4


@pytest.mark.cluster
def test_a_request_reaches_the_client_with_its_output_and_idle_status_but_no_busy(shared_cluster, view):
    """quiet_kernel.py: the shell's busy status, which no client reads, is not sent; the output and the idle status
    that tells the client the output is complete still arrive, in that order, on every rank."""
    for rank in shared_cluster.client.ids:
        reply, seen = _statuses(shared_cluster.client, rank, f"hello from {rank}")
        assert reply == ("QuietIPythonParallelKernel", logging.WARNING)
        assert [message for message in seen if message != ("status", "idle")] == [("stream", f"hello from {rank}\n")]
    several = view.apply_async(_say, "again")
    several.get(60)
    several.wait_for_output(5)
    assert several.stdout == ["again\n"] * 4


@pytest.mark.cluster
def test_requests_write_no_line_to_the_engines_log_and_warnings_still_do(shared_cluster, view):
    """quiet_kernel.py: ipyparallel logged a line per rank per request into the engine set's log (mpiexec forwards
    it), without end; a warning an engine logs still gets there, after anything logged before it."""
    def lines(text: str) -> int:
        return sum(Path(path).read_text().count(text) for path in shared_cluster.engine_log_paths())

    handled = lines("Handling apply_request")
    for _ in range(5):
        view.apply_sync(_say, "quiet")
    marker = f"taco-test-marker-{id(view)}"
    view.apply_sync(_warn, marker)
    wait_until(lambda: lines(marker) == 4, 30, "the four ranks' warnings in the engine log")
    assert lines("Handling apply_request") == handled


@pytest.mark.cluster
def test_rank_info_is_each_engines_rank_and_check_ranks_is_public(shared_cluster, view):
    infos = view.apply_sync(calls.rank_info)
    assert [info["rank"] for info in infos] == shared_cluster.client.ids == [0, 1, 2, 3]
    ranks = list(shared_cluster.ranks)
    shared_cluster.check_ranks()
    assert shared_cluster.ranks == ranks and [r.pid for r in ranks] == [info["pid"] for info in infos]


@pytest.mark.cluster
def test_configure_for_a_cell_then_reset_restores_the_ranks_settings(view):
    before = view.apply_sync(_settings)
    view.apply_sync(calls.configure_cell, CellSettings("flat", CompressionSpec.parse("fp16"), fusion_mb=8))
    during = view.apply_sync(_settings)
    assert all(s["algorithm"] == "flat" and s["compression"].name == "fp16" and s["fusion_mb"] == 8 for s in during)
    view.apply_sync(calls.reset_settings)
    assert view.apply_sync(_settings) == before


@pytest.mark.cluster
def test_reinit_after_abort_gives_a_working_group(view):
    view.apply_sync(calls.abort)
    assert view.apply_sync(_group_up) == [False] * 4
    view.apply_sync(calls.reinit)
    assert view.apply_sync(_group_up) == [True] * 4
    assert view.apply_sync(_allreduce_rank) == [10.0] * 4  # 1 + 2 + 3 + 4


@pytest.mark.cluster
def test_begin_cell_without_dashboard_sends_nothing_and_with_one_sends_the_end_state(view):
    view.apply_async(calls.begin_cell, False)  # queued before the cell, as run.py does it
    quiet = view.execute(TRAIN, block=False)
    quiet.get(timeout=60)
    quiet.wait_for_output(5)
    assert [calls.KEY in md["data"] for md in quiet.metadata] == [False] * 4
    assert view.apply_sync(_sender_state) == [(False, 20)] * 4

    view.apply_async(calls.begin_cell, True)
    loud = view.execute(TRAIN, block=False)
    loud.get(timeout=60)
    loud.wait_for_output(5)
    payloads = [md["data"].get(calls.KEY) for md in loud.metadata]
    assert all(p is not None and p["metrics"]["steps"] == 20 and p["progress"]["n"] == 20 for p in payloads), \
        payloads
    assert view.apply_sync(_sender_state) == [(True, 20)] * 4


@pytest.mark.cluster
def test_fetch_result_reads_the_captured_name_or_marks_what_cannot_travel(view):
    from taco_notebook.cluster.cells.result import UnpicklableResult, capture_last_expression, unwrap_result

    source, captured = capture_last_expression("x = taco.rank()\nx * 10")
    assert captured
    view.execute(source, block=True)
    assert view.apply_sync(calls.fetch_result) == [0, 10, 20, 30]
    view.execute(capture_last_expression("import threading\nthreading.Lock()")[0], block=True)
    values = [unwrap_result(v) for v in view.apply_sync(calls.fetch_result)]
    assert all(isinstance(v, UnpicklableResult) and "lock" in repr(v) for v in values), values


@pytest.mark.cluster
def test_a_cell_on_one_rank_reports_its_error_and_its_value(ip, view):
    """One target: ``AsyncResult.split()`` hands back the cell's own AsyncResult, whose result is a list."""
    from taco_notebook.errors import RankFailedError

    with pytest.raises(RankFailedError, match=r"rank 2 \(host .*\) raised ValueError: only rank 2") as failed:
        ip.run_cell_magic("taco_run", "--targets 2", "raise ValueError('only rank 2')")
    assert failed.value.first_rank == 2
    assert ip.run_cell_magic("taco_run", "--targets 2", "taco.rank() * 10") == 20
    assert ip.run_cell_magic("taco_run", "--targets 2 --gather", "taco.rank()") == [2]


def test_run_cell_does_the_setup_runs_the_code_as_a_cell_and_answers_in_one_request(view):
    """One request per rank: the set-up (this cell's settings, then back), the code through IPython (a magic,
    the last expression captured as the kernel rewrites it) and the reply (the value, the replica answer)."""
    from taco_notebook.cluster.cells.result import capture_last_expression

    source, captured = capture_last_expression("%time x = taco.rank()\ntaco.settings().fusion_mb, x * 10")
    setup = CellSetup(dashboard=False, settings=CellSettings(fusion_mb=3), reset=True)
    replies = view.apply_sync(runner.run_cell, source, setup, captured)
    assert [r.value for r in replies] == [(3, 0), (3, 10), (3, 20), (3, 30)]
    assert [r.replicas for r in replies] == [False] * 4  # nothing trained through taco
    assert view.apply_sync(_settings)[0]["fusion_mb"] != 3  # reset after the cell


def test_only_the_rank_whose_value_is_shown_sends_it(view):
    """``CellSetup.value_from``: the other ranks' replies bring no value (a cell ending in ``taco.allreduce(t)``
    sent every rank's ``t``); without it every rank's comes back, as ``--gather`` needs."""
    replies = view.apply_sync(runner.run_cell, "__taco_result__ = taco.rank() * 10", CellSetup(False, value_from=2),
                              True)
    assert [r.value for r in replies] == [None, None, 20, None]
    replies = view.apply_sync(runner.run_cell, "__taco_result__ = taco.rank() * 10", CellSetup(False), True)
    assert [r.value for r in replies] == [0, 10, 20, 30]


def _pickled(value: Any) -> Any:
    import pickle

    return pickle.loads(pickle.dumps(calls._travelling(value)))


def test_a_value_travels_back_as_itself_and_a_plain_cpu_tensor_as_its_bytes():
    """What ``fetch_result`` hands the reply unpickles as the value: a plain CPU tensor through its raw bytes
    (any dtype and shape, a view only as its own elements), anything else through its pickle, made once."""
    import pickle

    import torch

    big = torch.arange(1_000_000, dtype=torch.float64)
    tensors = [torch.ones(262144), torch.tensor(3.0), torch.empty(0, 5), torch.arange(12).reshape(3, 4).t(),
               torch.tensor([True, False]), torch.randn(3).to(torch.bfloat16),
               torch.randn(3, dtype=torch.complex64).conj(), big[10:20:3]]
    for tensor in tensors:
        travelling = calls._travelling(tensor)
        assert travelling.rebuild is calls._tensor_from_bytes, tensor
        back = _pickled(tensor)
        assert type(back) is torch.Tensor and back.dtype == tensor.dtype and back.shape == tensor.shape
        assert torch.equal(back, tensor.resolve_conj()), (back, tensor)
    assert len(pickle.dumps(calls._travelling(big[10:20:3]))) < 1000  # not the 8 MB storage it is a view of
    writable = _pickled(torch.zeros(4))
    writable += 1
    assert writable.tolist() == [1.0] * 4

    parameter = torch.nn.Parameter(torch.ones(2))  # not a plain tensor: torch's own pickling keeps what it is
    assert calls._travelling(parameter).rebuild is pickle.loads
    assert type(_pickled(parameter)) is torch.nn.Parameter and _pickled(parameter).requires_grad
    assert _pickled({"a": [1, 2], "b": None}) == {"a": [1, 2], "b": None}
    assert _pickled(5) == 5
    lock = __import__("threading").Lock()
    assert calls._travelling(lock) == (calls.UNPICKLABLE, repr(lock))


def test_run_cell_raises_the_users_exception_with_the_cells_frames(view):
    from ipyparallel.error import RemoteError

    from taco_notebook.cluster.cells.reporting import render_traceback

    ar = view.apply_async(runner.run_cell, "def f():\n    raise KeyError('k')\nf()\n", CellSetup(False), False)
    errors = [e for e in ar.get(return_exceptions=True) if isinstance(e, RemoteError)]
    assert len(errors) == 4 and {e.ename for e in errors} == {"KeyError"}
    shown = re.sub(r"\x1b\[[0-9;]*m", "", render_traceback(errors[0]))
    assert shown.splitlines()[2].strip().startswith("Cell In[") and "raise KeyError('k')" in shown, shown
    assert "calls.py" not in shown and "interactiveshell.py" not in shown, shown


@pytest.mark.parametrize("told", [True, False], ids=["told-by-ipyparallel", "without-its-internals"])
def test_the_tracker_sees_output_and_each_ranks_end(shared_cluster, view, told):
    """Ranks print, then end one after the other (rank r sleeps 0.3 r s): the tracker reports the printing ranks
    as news and each rank as finished once, in the order they ended, with its reply. Without ipyparallel's
    callbacks (``told`` False) it reads every rank on every look and is just as right."""
    import time

    from taco_notebook.cluster.cells.tracker import RankTracker

    code = "print('hello from', taco.rank())\n__import__('time').sleep(0.3 * taco.rank())\n"
    ar = view.apply_async(runner.run_cell, code, CellSetup(False), False)
    tracker = RankTracker(shared_cluster.client, ar, [0, 1, 2, 3])
    assert tracker.told  # this ipyparallel has the callbacks the tracker uses
    tracker.told = told
    news: set[int] = set()
    ended: list[int] = []
    deadline = time.monotonic() + 60
    while len(ended) < 4 and time.monotonic() < deadline:
        news |= tracker.news()
        ended += tracker.newly_finished()
        time.sleep(0.02)
    ar.get()
    tracker.settle()
    ended += tracker.newly_finished()
    assert ended == [0, 1, 2, 3] and tracker.running() == [] and tracker.done() and tracker.wait(0)
    news |= tracker.news()
    assert news == {0, 1, 2, 3}
    assert [tracker.metadata[r]["stdout"] for r in range(4)] == [f"hello from {r}\n" for r in range(4)]
    assert all(tracker.outcome(r) == CellReply(None, replicas=False, silent=False) for r in range(4))


def _iopub_sent() -> int:
    from IPython import get_ipython

    return get_ipython().kernel.iopub_sent


def _sent_by(view: Any, request: Any) -> list[int]:
    """How many IOPub messages each rank sent for ``request()`` (a request whose reply is waited for), its idle
    status included: the count read before and after, less the idle status of the request that read it first
    (a rank handles its requests in order, and sends a request's idle status before it reads the next)."""
    before = view.apply_sync(_iopub_sent)
    request()
    after = view.apply_sync(_iopub_sent)
    return [b - a - 1 for a, b in zip(before, after, strict=True)]


def test_a_silent_cell_ends_at_its_reply_without_an_idle_status(shared_cluster, view):
    """quiet.end_silently: a cell that sends nothing on IOPub says so in its reply and its rank sends no idle
    status; the tracker then ends the request's output at the reply, so ``wait_for_output`` returns and
    ipyparallel forgets the request. A cell that prints sends its output and its idle status as before, and so
    does a runner not asked to be silent."""
    from taco_notebook.cluster.cells.tracker import RankTracker

    client = shared_cluster.client

    def cell(code: str, silent: bool) -> tuple[list[CellReply], Any]:
        ar = view.apply_async(runner.run_cell, code, CellSetup(False, silent=silent), False)
        tracker = RankTracker(client, ar, [0, 1, 2, 3])
        replies = ar.get(60)
        assert tracker.wait(10)
        assert ar.wait_for_output(5), "the output of the request never ended"
        return replies, ar

    found: dict[str, Any] = {}

    def silent() -> None:
        found["replies"], found["ar"] = cell("x = 1", silent=True)

    assert _sent_by(view, silent) == [0, 0, 0, 0]
    assert [reply.silent for reply in found["replies"]] == [True] * 4
    assert not set(found["ar"].msg_ids) & set(client.metadata)  # ipyparallel's bookkeeping of it is gone

    def printing() -> None:
        found["replies"], found["ar"] = cell("print('said', taco.rank())", silent=True)

    assert _sent_by(view, printing) == [2, 2, 2, 2]  # the stream and the idle status
    assert [reply.silent for reply in found["replies"]] == [False] * 4
    assert found["ar"].stdout == [f"said {rank}\n" for rank in range(4)]
    assert _sent_by(view, lambda: cell("x = 2", silent=False)) == [1, 1, 1, 1]  # not asked: the idle status


def _calls(path: Path) -> Iterator[tuple[str, ast.Call]]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node.func.attr, node


def test_no_code_string_is_sent_to_engines_but_the_users_cell():
    """In addition to the behaviour tests above: a grep over cluster/ and engine/ with the parser's eyes. Nothing is
    sent as an ``execute``; the user's cell travels as the argument of the engine-side runner, one request per rank."""
    executes, cells = [], []
    for path in sorted([*CLUSTER_DIR.rglob("*.py"), *ENGINE_DIR.rglob("*.py")]):
        for name, call in _calls(path):
            if name == "execute" and call.args:
                executes.append(f"{path.name}:{call.lineno}")
            if name == "apply_async" and call.args and ast.unparse(call.args[0]) == "runner.run_cell":
                cells.append((path.name, ast.unparse(call.args[1])))
    assert executes == []
    assert cells == [("run.py", "source")]  # the user's cell, after capture_last_expression


def test_no_private_attribute_of_another_module_or_of_ipyparallel_is_read():
    package = CLUSTER_DIR.parent
    progress = package / "comm" / "diagnostics" / "progress.py"
    for path in [*CLUSTER_DIR.rglob("*.py"), *ENGINE_DIR.rglob("*.py"), progress]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if path.name == "tracker.py" and isinstance(node, ast.Attribute) and node.attr == "_children":
                continue  # the one read, of a request's MessageFuture as ipyparallel's stream_output reads it,
                # with a fallback when it is not there (test_the_tracker_works_without_ipyparallels_internals)
            if isinstance(node, ast.Attribute) and node.attr in ("_metadata", "_children", "_publishing",
                                                                  "_metrics", "_sending", "_check_ranks"):
                pytest.fail(f"{path.name}:{node.lineno} reads .{node.attr}")
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "metrics"
                    and node.attr.startswith("_")):
                pytest.fail(f"{path.name}:{node.lineno} reads metrics.{node.attr}")
