"""Run a cell (or a script: :func:`run_script`) on a TacoCluster's ranks: stream output, notice failure, never hang.

The wait loop polls, every few tens of milliseconds, four things: the cell's result, the engines' output, the
mpiexec process (a rank that dies takes it down) and the deadline. When something goes wrong it climbs one
ladder, the same for Ctrl-C, ``--timeout`` and a rank that raised while its peers still run:

1. the torch process group of ranks that already finished is shut down, so peers blocked in a collective
   waiting for them fail at once instead of after the 30-minute collective timeout;
2. SIGINT goes to the ranks still running;
3. ranks still running a few seconds later are killed; the next cell gets a fresh cluster.

Whatever happened, the next cell on a live cluster first rebuilds the process group on every rank.

While the cell runs, what the engines send (metric snapshots and ``taco.progress`` counts, see
``engine/calls.py``) is handed to the cell's monitors (the dashboard, the cluster registry) every
``REPORT_S`` seconds, and once more when the cell ends, whatever the outcome; meanwhile a page's widget requests (a
page reloaded mid-run) are answered while queued cells still wait (``ipp/comm_pump.py``).

A cell reaches each rank as one call of ``engine/runner.py`` (``view.apply``), whose reply brings back the value of
its last expression (``cells/result.py``); the wait loop reads only the ranks with news (``cells/tracker.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ...engine import calls, runner
from ...engine.script import Script
from ...engine.wire import CellReply, CellSettings, CellSetup, Output
from ...errors import CellInterrupted, CellTimeoutError, ClusterStartError, RankFailedError
from ...ipp.comm_pump import CommPump
from ...ipp.upstream import RemoteError
from ..session import TacoCluster
from .autopsy import after_stall
from .replica_check import check_replicas
from .reporting import cell_outcome, error_line, rank_failure, ranks_phrase, render_traceback, were
from .result import capture_last_expression, unwrap_result
from .tracker import RankTracker

__all__ = ["CellOptions", "CellMonitor", "OutputSink", "run_cell", "run_script"]

log = logging.getLogger("taco_notebook")

POLL_S = 0.05
# errors after which a rank's process group is gone (the stall watchdog aborts it; the backend lost a peer)
GROUP_BREAKING = frozenset({"StallError", "DistBackendError", "DistNetworkError"})
REPORT_S = 0.2  # how often the wait loop looks for new payloads (the ranks send one every calls.SEND_S)


class CellMonitor(Protocol):
    """Watches a running cell: ``update`` with every rank's latest payload, ``finish`` once.

    The ranks send metrics only if some monitor ``wants_metrics``; the others read what comes.
    """

    wants_metrics: bool

    def update(self, payloads: Mapping[int, Mapping[str, Any]], running: Sequence[int]) -> None: ...
    def finish(self, outcome: str) -> None: ...


@dataclass
class CellOptions:
    targets: list[int] | None = None
    timeout: float | None = None
    gather: bool = False
    interrupt_grace: float = 2.5  # seconds ranks get to honour SIGINT before they are killed
    failure_grace: float = 10.0  # seconds peers of a failed rank get to finish before the ladder starts
    settings: CellSettings | None = None  # taco.configure() for this cell only: algorithm, compression…
    monitors: Sequence[CellMonitor] = ()  # engines send metrics only when someone watches
    runner: Callable[..., Any] | None = None  # what runs it instead of the plain wait loop (--elastic)
    check_replicas: bool = True  # after a cell on every rank that trained: compare them (cells/replica_check.py)
    output: Output = "all"  # whose stdout the ranks send: all, rank0 or errors


class OutputSink(Protocol):
    def stream(self, rank: int, name: str, text: str) -> None: ...
    def display(self, rank: int, content: dict[str, Any]) -> None: ...
    def notice(self, text: str) -> None: ...
    def warn(self, text: str) -> None: ...
    def flush(self) -> None: ...


class CellRun:
    def __init__(self, cluster: TacoCluster, options: CellOptions, sink: OutputSink) -> None:
        self.cluster = cluster
        self.options = options
        self.sink = sink
        self.targets = options.targets if options.targets is not None else [r.rank for r in cluster.ranks]
        self.engines = cluster.engine_ids(self.targets)  # the targets' engine ids (differ after an elastic change)
        self.shown: dict[tuple[int, str], int] = {}  # (rank, stdout/stderr/outputs) -> how much was shown
        self.errors: dict[int, Any] = {}
        self.shut_down_pg: set[int] = set()
        self.started = 0.0
        self.failure_deadline: float | None = None
        self.killed: list[int] = []
        self.ar: Any = None
        self.tracker: RankTracker | None = None  # which ranks have news (cells/tracker.py)
        self.unshown: set[int] = set()  # ranks with output not yet shown
        self.payloads: dict[int, Any] = {}  # every rank's latest dashboard payload
        self.reported_at = 0.0
        # what the monitors were last handed: rank -> id() of its payload, and the ranks then still running
        self.reported: tuple[dict[int, int], list[int]] = ({}, [])
        self.sending = any(m.wants_metrics for m in options.monitors)
        self.origin: str | None = None  # a script's path: its tracebacks are shown from its first frame
        self.comms = CommPump()  # a page reloaded mid-cell gets its widgets from the kernel (ipp/comm_pump.py)

    # ---------------------------------------------------------------- output
    def absorb(self) -> None:
        """Take in which ranks got messages since the last look (their output, their dashboard payload)."""
        if self.tracker is None:
            return
        for rank in self.tracker.news():
            self.unshown.add(rank)
            data = self.tracker.metadata[rank]["data"]
            if calls.KEY in data:
                self.payloads[rank] = data[calls.KEY]

    def drain(self) -> None:
        """Show what arrived since the last call, from the ranks that got messages. The client appends every
        rank's output to the request's metadata as it comes; reading from there cannot lose what a fast rank
        printed before we looked (every rank is read once at the start)."""
        self.absorb()
        unshown, self.unshown = self.unshown, set()
        for rank in sorted(unshown):
            md = self.tracker.metadata[rank]  # type: ignore[union-attr]
            for name in ("stdout", "stderr"):
                text = md[name]
                seen = self.shown.get((rank, name), 0)
                if len(text) > seen:
                    self.shown[(rank, name)] = len(text)
                    self.sink.stream(rank, name, text[seen:])
            outputs = md["outputs"]
            seen = self.shown.get((rank, "outputs"), 0)
            for content in outputs[seen:]:
                self.sink.display(rank, content)
            self.shown[(rank, "outputs")] = len(outputs)

    def report(self, force: bool = False) -> None:
        """Hand the monitors every rank's latest payload, at most every REPORT_S unless ``force``."""
        if not self.options.monitors or self.ar is None:
            return
        now = time.monotonic()
        if not force and now - self.reported_at < REPORT_S:
            return
        self.reported_at = now
        self.absorb()
        payloads = dict(self.payloads)
        running = self.running()
        fresh = ({rank: id(payload) for rank, payload in payloads.items()}, running)
        if fresh == self.reported:  # a rank that finished with no new payload is news too (the final picture)
            return
        self.reported = fresh
        for monitor in self.options.monitors:
            monitor.update(payloads, running)

    def finish_monitors(self, error: BaseException | None) -> None:
        """The final picture: the engines' last payloads, and how the cell ended."""
        if not self.options.monitors:
            return
        self.report(force=True)
        outcome = cell_outcome(error)
        for monitor in self.options.monitors:
            monitor.finish(outcome)

    # ---------------------------------------------------------------- states
    def running(self) -> list[int]:
        return self.tracker.running() if self.tracker is not None else []

    def outcomes(self) -> dict[int, Any]:
        """What each finished rank's request returned: the runner's reply, or a RemoteError where it raised."""
        return self.tracker.outcomes() if self.tracker is not None else {}

    def collect_errors(self) -> None:
        """Look at the ranks that finished since the last call (each once)."""
        if self.tracker is None:
            return
        for rank in self.tracker.newly_finished():
            result = self.tracker.outcome(rank)
            if getattr(result, "ename", None) == "EngineError":  # the hub saw the engine process go
                self.engine_died()
            if isinstance(result, RemoteError):
                self.errors[rank] = result
                if result.ename in GROUP_BREAKING:
                    # that rank's group is torn down (a stall's watchdog aborts it): rebuild before the next
                    # cell, also when every rank failed at once and release_peers never ran
                    self.cluster.mark_group_broken()
                if self.failure_deadline is None:
                    self.failure_deadline = time.monotonic() + self.options.failure_grace
                if len(self.errors) == 1 and self.running():
                    self.sink.warn(f"rank {rank} raised {error_line(result)}; waiting for the other ranks")
                if result.ename == "StallError" and [e.ename for e in self.errors.values()].count("StallError") == 1:
                    after_stall(self.cluster, self.targets, self.sink, self.submitted_at)  # cells/autopsy.py

    def release_peers(self) -> None:
        """Shut the process group down on finished ranks so peers blocked on them fail fast (ladder step 1)."""
        running = self.running()
        if not running:
            return
        finished = [r for r in self.tracker.finished if r not in self.shut_down_pg]  # type: ignore[union-attr]
        if not finished:
            return
        self.shut_down_pg.update(finished)
        self.cluster.mark_group_broken()
        self.cluster.client[self.cluster.engine_ids(finished)].apply_async(calls.abort)

    def check_alive(self) -> None:
        if not self.cluster.engines_alive():
            self.engine_died()

    def engine_died(self) -> None:
        """Report which rank died and how, shut the cluster down, raise RankDiedError."""
        deadline = time.monotonic() + 5  # mpiexec takes the other ranks down a moment after the first
        while self.cluster.engines_alive() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.drain()
        self.sink.flush()
        error = self.cluster.died_error(ended=self.ended())
        self.cluster.stop()
        raise error

    def ended(self) -> dict[int, str]:
        """How each rank whose cell ended on its own ended: ``finished`` or ``raised …`` (the hub fails a dead
        engine's task with EngineError: not an end of its own)."""
        return {rank: f"raised {error_line(result)}" if isinstance(result, RemoteError) else "finished"
                for rank, result in self.outcomes().items() if getattr(result, "ename", None) != "EngineError"}

    # ---------------------------------------------------------------- main
    def wait_until(self, deadline: float | None) -> bool:
        """Poll until done (True), or until ``deadline`` or the failure grace runs out (False)."""
        while not self.tracker.done():  # type: ignore[union-attr]
            self.check_alive()
            self.drain()
            self.report()
            self.comms()
            self.collect_errors()
            if self.errors:
                self.release_peers()
            limits = [t for t in (deadline, self.failure_deadline) if t is not None]
            if limits and time.monotonic() >= min(limits):
                return False
            self.tracker.wait(POLL_S)  # type: ignore[union-attr]  # returns as soon as the cell is done
        return True

    def stop_ladder(self, why: str) -> list[int]:
        """SIGINT the running ranks, release their peers, kill them if they hang. Returns ranks killed."""
        running = self.running()
        if running:
            self.sink.warn(f"{why}: sending SIGINT to {ranks_phrase(running)}")
            delivered = self.cluster.client.send_signal("SIGINT", targets=running, block=False)
            try:  # a signal still in flight could land in the next cell on a loaded machine: see it delivered
                delivered.result(timeout=1.0)
            except Exception:  # a dead or wedged engine: the ladder's kill step deals with it
                pass
        self.cluster.mark_group_broken()
        self.failure_deadline = float("inf")  # the ladder is climbing: only its own grace counts now
        done = self.wait_until(time.monotonic() + self.options.interrupt_grace)
        self.tracker.settle()  # type: ignore[union-attr]
        if done:
            return []
        stuck = self.killed = self.running()
        self.sink.warn(f"{ranks_phrase(stuck)} ignored SIGINT for {self.options.interrupt_grace:g} s: "
                       f"killing the engines; the next cell starts a fresh cluster")
        self.cluster.kill_engines(f"{ranks_phrase(stuck)} hung after {why}")
        return stuck

    def run(self, submit: Callable[[Any, CellSetup], Any], captured: bool) -> Any:
        """Prepare the ranks, ``submit(view, setup)`` the work (a cell's or a script's runner, which does the
        per-cell ``setup`` in the same request), and wait for it through the ladder; ``captured``: the cell's
        last expression is to be brought back."""
        if self.cluster.needs_reinit:
            self.cluster.reinit()
        settings = self.options.settings
        if settings is not None and settings.auto_compression:  # what auto chose is said before the cell runs
            notes = self.cluster.client[self.engines].apply_sync(calls.configure_cell, settings)
            if notes[0]:  # the ranks agree
                self.sink.notice(notes[0])
            settings = None
        setup = CellSetup(dashboard=self.sending, settings=settings, reset=self.options.settings is not None,
                          output=self.options.output, interval=calls.send_interval(len(self.targets)),
                          silent=True,  # the RankTracker ends a silent rank's output at its reply
                          value_from=None if self.options.gather else self.targets[0])  # the value shown
        try:
            value = self._execute(lambda view: submit(view, setup), captured)
        except BaseException as exc:
            try:
                self.finish_monitors(exc)
            except Exception:  # the cell's own error is what the user must see
                log.exception("the dashboard or the registry failed to record the end of the cell")
            raise
        self.finish_monitors(None)
        return value

    def _execute(self, submit: Callable[[Any], Any], captured: bool) -> Any:
        self.submitted_at = time.time()  # the hang autopsy's "since" (split() may wait: not a start time)
        self.ar = submit(self.cluster.client[self.engines])
        self.tracker = RankTracker(self.cluster.client, self.ar, self.targets)
        self.started = time.monotonic()
        try:
            self._wait_with_ladder()
        except KeyboardInterrupt:
            self.stop_ladder("Interrupted")
            self.drain()
            self.sink.flush()
            raise self.interrupted() from None
        if self.killed:
            raise self.failure()
        self.ar.wait_for_output(1)
        self.tracker.settle()
        self.drain()
        self.sink.flush()
        self.collect_errors()
        if self.errors:
            raise self.failure()
        replies: list[CellReply] = self.ar.get()  # every rank's runner's reply
        if (self.options.check_replicas and self.options.targets is None and self.cluster.elastic is None
                and all(reply.replicas for reply in replies)):
            check_replicas(self.cluster.client[self.engines], self.sink)
        if not captured:
            return None
        values = [unwrap_result(reply.value) for reply in replies]
        return values if self.options.gather else values[0]

    def _wait_with_ladder(self) -> None:
        timeout = self.options.timeout
        deadline = None if timeout is None else self.started + timeout
        if self.wait_until(deadline):
            return
        if deadline is None or time.monotonic() < deadline:  # the failure grace ran out first
            failed = ranks_phrase(sorted(self.errors))
            self.stop_ladder(f"ranks still running {self.options.failure_grace:g} s after {failed} failed")
            return
        running = self.running()
        killed = self.stop_ladder(f"Timeout after {timeout:g} s")
        self.drain()
        self.sink.flush()
        fate = f"; {ranks_phrase(killed)} hung and {were(killed)} killed" if killed else ""
        raise CellTimeoutError(
            f"cell timed out after {timeout:g} s (--timeout) with {ranks_phrase(running)} still "
            f"running{fate}", running)

    def failure(self) -> RankFailedError:
        # the first seen failed first: the others failed after their peers' group was shut down
        return rank_failure(self.errors, self.killed, self.targets, self._host, self.origin)

    def interrupted(self) -> CellInterrupted:
        """The KeyboardInterrupt the user sees: where each rank's code was when SIGINT reached it (the ranks'
        own tracebacks), not the kernel's frames, which only show this wait loop."""
        reached = {rank: error for rank, error in sorted(self.outcomes().items())
                   if isinstance(error, RemoteError) and error.ename == "KeyboardInterrupt"}
        message = f"the cell was interrupted on {ranks_phrase(self.targets)}"
        if self.killed:
            message += f"; {ranks_phrase(self.killed)} ignored SIGINT and {were(self.killed)} killed"
        return CellInterrupted(message, {rank: render_traceback(error, self.origin) for rank, error in reached.items()})

    def _host(self, rank: int) -> str:
        return next((r.host for r in self.cluster.ranks if r.rank == rank), "?")


def run_cell(cluster: TacoCluster, code: str, options: CellOptions, sink: OutputSink) -> Any:
    """Run ``code`` on the cluster's ranks (or ``options.targets``); returns rank 0's (or every rank's, with
    ``gather``) value of the last expression, or None. With ``options.runner`` (``--elastic``) the run survives
    a rank's death and admits joiners (cluster/elastic/recovery.py)."""
    source, captured = capture_last_expression(code)
    return _run(cluster, code, options, sink,
                lambda view, setup: view.apply_async(runner.run_cell, source, setup, captured), captured)


def run_script(cluster: TacoCluster, script: Script, options: CellOptions, sink: OutputSink) -> None:
    """Run ``script`` (:func:`~.script.load_script`) on the cluster's ranks as ``python script args`` would,
    with a cell's live output, failure handling, Ctrl-C ladder and monitors. ``options.gather`` is ignored:
    a script has no last expression."""
    _run(cluster, f"%taco_run {script.command()}", options, sink,
         lambda view, setup: view.apply_async(runner.run_script, script, setup), captured=False, origin=script.path)


def _run(cluster: TacoCluster, shown: str, options: CellOptions, sink: OutputSink,
         submit: Callable[[Any, CellSetup], Any], captured: bool, origin: str | None = None) -> Any:
    """Holds ``cluster.busy`` meanwhile, so a stop or scale asked for from the sidebar waits for the cell to end;
    ``shown`` is what the sidebar says runs."""
    from .reporting import RegistryRun

    with cluster.busy:
        if not cluster.running:  # broken, or stopped or rescaled from the sidebar since the magic looked
            why = cluster.error or "it was stopped or rescaled from the sidebar just before this cell"
            raise ClusterStartError(f"cluster {cluster.name!r} cannot run this cell: {why}; run the cell "
                                    "again to use it or start a fresh one")
        options = replace(options, monitors=[*options.monitors, RegistryRun(cluster, shown)])
        if options.runner is not None:  # --elastic: cluster/elastic/recovery.py's, which survives a rank's death
            return options.runner(cluster, submit, captured, options, sink, origin)
        run = CellRun(cluster, options, sink)
        run.origin = origin
        return run.run(submit, captured)
