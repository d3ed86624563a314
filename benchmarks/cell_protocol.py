"""A cell's control-plane cost by two protocols, interleaved, at N ranks: how a cell travels (requests per rank)
and how the notebook watches it run (polling every rank, or reading only the ranks with news).

Two protocols, on the same cluster, in turn cell by cell (a burst of load weighs on all alike). The new one is
also sent through ipyparallel's own client (**stock**: a second client on the same controller, beside taco's
``ipp/client.py``, which a TacoCluster connects) and through ipyparallel's coalescing broadcast view, which
answers a request on every engine with one reply:

* **old** (the reference): ``begin_cell`` queued as an ``apply``, the code as an ``execute``, then the replica
  check's question as an ``apply`` (3 requests per rank per empty cell; a 4th, ``fetch_result``, when the
  cell ends in an expression);
* **new**: one ``apply`` of the engine-side runner (``runner.run_cell``), which does the set-up, runs the code
  through the engine's IPython shell and answers both questions in its reply; watched by a ``RankTracker`` as
  ``run.py`` watches it, so a rank whose request sent nothing on IOPub ends at its reply (``quiet_kernel.py``).

Each variant's cell ends as ``%%taco_run`` waits for one: every reply, then every rank's output
(``wait_for_output``). Through the coalescing view, the replies only: ipyparallel never ends that request's
output.

Two watches of a running cell (a cell that sleeps ``--sleep`` seconds, observed every 50 ms as ``run.py`` does):

* **poll all**: every rank's metadata read and every rank's AsyncResult asked ``ready()`` on every wake (the
  reference);
* **news only**: :class:`taco_notebook.cluster.cells.tracker.RankTracker`, which reads only ranks that got
  IOPub messages or finished since the last wake.

Engines: ``--engines taco`` starts a real ``TacoCluster`` (MPI, torch and the process group on every rank:
~275 MiB each, so 64 is about this machine's limit); ``--engines plain`` starts plain ipyparallel engines with
no torch (~60 MiB each), started, and their kernel and streams set up, as a taco engine's are (no nanny,
``quiet_kernel.py``, ``stdstreams.py``, ``signals.py``), and a runner with the same message shape as
``runner.run_cell``, so hundreds fit: the notebook's and the controller's side of the control plane are the
same, which is what is measured.

Per N: wall ms per empty cell (median), the notebook's and the controller's CPU ms per empty cell (over all
cells of the variant), their sum per rank, and the notebook's CPU per second of a running cell for each watch.
A line a + b·N is fitted to the new path's own figures and evaluated at ``--extrapolate``.

    .venv/bin/python benchmarks/cell_protocol.py --engines taco --ranks 2,4,8,16 --cells 20
    .venv/bin/python benchmarks/cell_protocol.py --engines plain --ranks 16,64,128,256 --cells 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import result_files  # noqa: E402
import signals  # noqa: E402
from control_plane import cluster_sizes, cpu_seconds, fit_line  # noqa: E402  (the same CPU reading and line fit)

from taco_notebook.controller import raise_open_files_limit  # noqa: E402
from taco_notebook.engine.wire import CellReply, CellSetup  # noqa: E402
from taco_notebook.ipp.quiet_kernel import quiet_kernel  # noqa: E402
from taco_notebook.ipp.signals import NO_NANNY, answer_signals  # noqa: E402
from taco_notebook.ipp.stdstreams import lean_streams  # noqa: E402

EMPTY = "pass"
POLL_S = 0.05  # run.py's
# what a taco engine's set-up does to its kernel and streams (calls.setup_namespace), without torch: taco's own
# functions, one apply each, which reach the engines by reference
PLAIN_SETUP = (lean_streams, quiet_kernel, answer_signals)
# stock: the new runner sent through ipyparallel's own Client (a second client on the same controller) instead of
# the cluster's LeanClient (ipp/client.py); coalescing: through broadcast_view(is_coalescing=True)
VARIANTS = ("old", "stock", "new", "coalescing")


def plain_run_cell(source: str, captured: bool, silent: bool = False) -> CellReply:
    """The new protocol's runner on a plain engine: ``runner.run_cell``'s message shape without taco (the code
    through the shell; the reply carries the value, the replica answer, and whether the request ended without
    sending anything on IOPub, ``quiet.end_silently``)."""
    from IPython import get_ipython

    from taco_notebook.engine.wire import CellReply
    from taco_notebook.ipp.quiet_kernel import end_silently, iopub_mark

    mark = iopub_mark() if silent else None
    shell = get_ipython()
    result = shell.run_cell(source, store_history=True)
    error = result.error_before_exec or result.error_in_exec
    if error is not None:
        raise error
    return CellReply(shell.user_ns.get("__taco_result__") if captured else None, False, end_silently(mark))


def plain_noop(*_: Any) -> bool:
    return False


class Plain:
    """N plain ipyparallel engines (no torch) on loopback, in a private profile directory."""

    def __init__(self, size: int, timeout: float, controller: str = "taco") -> None:
        import ipyparallel as ipp

        self.size = size
        self.home = tempfile.mkdtemp(prefix="taco-cellproto-")
        os.chmod(self.home, 0o700)
        from traitlets.config import Config

        from taco_notebook.cluster.launch.engineset import CONTROLLER_CMD, controller_args, registration_timeout
        from taco_notebook.ipp.client import connect

        config = Config()  # the same registration timeout and controller as a TacoCluster of this size
        config.LocalEngineSetLauncher.engine_args = [f"--IPEngine.timeout={registration_timeout(size):g}", NO_NANNY]
        if controller == "taco":
            config.LocalControllerLauncher.controller_cmd = CONTROLLER_CMD
        self.cluster = ipp.Cluster(n=size, engines="local", profile_dir=self.home, controller_ip="127.0.0.1",
                                   log_level=40, shutdown_atexit=False, config=config,
                                   controller_args=controller_args(size) if controller != "ipyparallel" else [])
        try:
            self.cluster.start_cluster_sync()
            self.client = connect(self.cluster)  # the client a TacoCluster connects
            self.client.wait_for_engines(size, timeout=timeout, interactive=False)
            self.stock = self.cluster.connect_client_sync()  # ipyparallel's own, for the "stock" variant
            self.stock.wait_for_engines(size, timeout=timeout, interactive=False)
            self.view = self.client[:]
            for setup in PLAIN_SETUP:
                self.view.apply_sync(setup)
        except BaseException:
            self.stop()
            raise

    def controller_processes(self) -> list[Any]:
        import psutil

        controller = psutil.Process(self.cluster.controller.process.pid)
        return [controller, *controller.children(recursive=True)]

    def old(self, source: str) -> None:
        self.view.apply_async(plain_noop, False)  # begin_cell, no reply awaited
        finish(self.view.execute(source, silent=False, block=False))
        self.view.apply_sync(plain_noop, False)  # the replica check's question

    def new(self, source: str, view: Any = None, stock: bool = False) -> Any:
        if view is not None:  # the coalescing view: one reply for every rank, read without a tracker
            return view.apply_async(plain_run_cell, source, False)
        client = self.stock if stock else self.client
        return tracked(client, client[:].apply_async(plain_run_cell, source, False, True), self.size)

    def stop(self) -> None:
        import shutil

        try:
            try:
                for client in (getattr(self, "client", None), getattr(self, "stock", None)):
                    if client is not None:
                        client.close()
            finally:
                self.cluster.stop_cluster_sync()
        finally:
            shutil.rmtree(self.home, ignore_errors=True)


class Taco:
    """A real TacoCluster of N ranks (MPI, torch, process group), tracked in a private registry directory."""

    def __init__(self, size: int, timeout: float) -> None:
        from taco_notebook.cluster.registry.writer import track
        from taco_notebook.cluster.session import TacoCluster

        self.size = size
        self.home = tempfile.mkdtemp(prefix="taco-cellproto-")
        os.chmod(self.home, 0o700)
        self.taco = track(TacoCluster(f"proto{size}-{os.getpid()}", size, start_timeout=timeout), Path(self.home))
        try:
            self.taco.start()  # stops itself when it fails or is interrupted
            self.client = self.taco.client
            self.view = self.client[:]
            self.stock = self.taco.ipp_cluster.connect_client_sync()  # ipyparallel's own, for the "stock" variant
            self.stock.wait_for_engines(size, timeout=timeout, interactive=False)
        except BaseException:
            self.stop()
            raise

    def controller_processes(self) -> list[Any]:
        import psutil

        controller = psutil.Process(self.taco.ipp_cluster.controller.process.pid)
        return [controller, *controller.children(recursive=True)]

    def old(self, source: str) -> None:
        from taco_notebook.engine import calls

        self.view.apply_async(calls.begin_cell, False)
        finish(self.view.execute(source, silent=False, block=False))
        self.view.apply_sync(calls.check_replicas, False)

    def new(self, source: str, view: Any = None, stock: bool = False) -> Any:
        from taco_notebook.engine import runner

        if view is not None:  # the coalescing view: one reply for every rank, read without a tracker
            return view.apply_async(runner.run_cell, source, CellSetup(dashboard=False), False)
        setup = CellSetup(dashboard=False, silent=True)  # as run.py's
        client = self.stock if stock else self.client
        return tracked(client, client[:].apply_async(runner.run_cell, source, setup, False), self.size)

    def stop(self) -> None:
        import shutil

        try:
            if getattr(self, "stock", None) is not None:
                self.stock.close()
            self.taco.stop()
        finally:
            shutil.rmtree(self.home, ignore_errors=True)


def tracked(client: Any, ar: Any, size: int) -> Any:
    """``ar`` with a RankTracker on it, as run.py's: it ends a silent rank's output at its reply."""
    from taco_notebook.cluster.cells.tracker import RankTracker

    RankTracker(client, ar, list(range(size)))
    return ar


def finish(ar: Any, output: bool = True) -> None:
    """A cell's request done as ``%%taco_run`` waits for it: every reply, then every rank's output (not through
    the coalescing view, whose request's output ipyparallel never ends: the ranks' IOPub messages name each
    rank's own request)."""
    ar.get()
    if output:
        ar.wait_for_output()


def watch_poll_all(ar: Any) -> None:
    """The reference wait loop: every rank's metadata and AsyncResult on every wake."""
    parts = ar.split()
    while not ar.ready():
        for md in ar.metadata:
            md["stdout"], md["stderr"], md["outputs"], md["data"].get("taco")
        [part.ready() for part in parts]
        ar.wait(POLL_S)


def watch_news_only(client: Any, ar: Any, size: int) -> None:
    """The wait loop now: only ranks with news; the running ranks every 4th wake (run.py's report interval)."""
    from taco_notebook.cluster.cells.tracker import RankTracker

    tracker = RankTracker(client, ar, list(range(size)))
    wakes = 0
    while not tracker.done():
        for rank in tracker.news():
            md = tracker.metadata[rank]
            md["stdout"], md["stderr"], md["outputs"], md["data"].get("taco")
        tracker.newly_finished()
        if wakes % 4 == 0:
            tracker.running()
        wakes += 1
        tracker.wait(POLL_S)


def measure(kind: str, size: int, cells: int, sleep: float, timeout: float, settings: str = "taco") -> dict[str, Any]:
    """One cluster of ``size`` ranks, ``cells`` empty cells per protocol; ``settings``: whose controller settings
    plain engines get (``--controller``)."""
    began = time.perf_counter()
    cluster = Plain(size, timeout, settings) if kind == "plain" else Taco(size, timeout)
    try:
        start_s = time.perf_counter() - began
        print(f"{size} {kind} engines up in {start_s:.1f} s; measuring", file=sys.stderr, flush=True)
        controller = cluster.controller_processes()
        fds = max(process.num_fds() for process in controller)
        for _ in range(3):  # warm-up
            cluster.old(EMPTY)
            finish(cluster.new(EMPTY, stock=True))
            finish(cluster.new(EMPTY))
        coalescing = cluster.client.broadcast_view(is_coalescing=True)
        finish(cluster.new(EMPTY, coalescing), output=False)
        wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
        cpu = dict.fromkeys(VARIANTS, 0.0)
        ctl = dict.fromkeys(VARIANTS, 0.0)
        for _ in range(cells):
            for variant in VARIANTS:
                c0, k0, t0 = time.process_time(), cpu_seconds(controller), time.perf_counter()
                if variant == "old":
                    cluster.old(EMPTY)
                else:
                    finish(cluster.new(EMPTY, coalescing if variant == "coalescing" else None, variant == "stock"),
                           output=variant != "coalescing")
                wall[variant].append(time.perf_counter() - t0)
                cpu[variant] += time.process_time() - c0
                ctl[variant] += cpu_seconds(controller) - k0
        watch: dict[str, float] = {}
        for name in ("poll all", "news only"):
            ar = cluster.new(f"__import__('time').sleep({sleep})")
            c0, t0 = time.process_time(), time.perf_counter()
            if name == "poll all":
                watch_poll_all(ar)
            else:
                watch_news_only(cluster.client, ar, size)
            ar.get()
            watch[name] = (time.process_time() - c0) / (time.perf_counter() - t0)
    finally:
        cluster.stop()
    row: dict[str, Any] = {"ranks": size, "engines": kind, "start_s": start_s, "load": os.getloadavg()[0],
                           "controller_fds": fds}  # the most open files one of the controller's processes holds
    for variant in VARIANTS:
        row[f"{variant}_wall_ms"] = statistics.median(wall[variant]) * 1e3
        row[f"{variant}_notebook_cpu_ms"] = cpu[variant] / cells * 1e3
        row[f"{variant}_controller_cpu_ms"] = ctl[variant] / cells * 1e3
        row[f"{variant}_per_rank_ms"] = (cpu[variant] + ctl[variant]) / cells / size * 1e3
    row["watch_cpu_share"] = watch
    return row


def table(rows: list[dict[str, Any]], cells: int, at: int) -> str:
    out = [f"Empty cells, {cells} per protocol, in turn; wall ms median; CPU ms per cell over all of them. "
           "Each column: old / new through ipyparallel's client / new (taco's client) / new through the "
           "coalescing broadcast view.", "",
           "| engines | controller | ranks | start s | wall ms | notebook CPU ms | controller CPU ms "
           "| notebook + controller CPU per rank ms | notebook CPU share while a cell runs: poll all / "
           "news only | controller's open files (most in one process) | load |", "|" + "---|" * 11]

    def each(r: dict[str, Any], key: str, form: str) -> str:
        return " / ".join(format(r[f"{v}_{key}"], form) for v in VARIANTS)

    for r in rows:
        w = r["watch_cpu_share"]
        out.append(f"| {r['engines']} | {r.get('controller', 'taco')} | {r['ranks']} | {r['start_s']:.1f} | "
                   f"{each(r, 'wall_ms', '.1f')} | "
                   f"{each(r, 'notebook_cpu_ms', '.1f')} | {each(r, 'controller_cpu_ms', '.1f')} | "
                   f"{each(r, 'per_rank_ms', '.3f')} | {w['poll all']:.1%} / {w['news only']:.1%} | "
                   f"{r.get('controller_fds', '')} | {r['load']:.1f} |")
    first = rows[0].get("controller", "taco")  # the line is fitted to one controller's rows
    fitted = [r for r in rows if r.get("controller", "taco") == first]
    if len({r["ranks"] for r in fitted}) > 1:
        xs = [float(r["ranks"]) for r in fitted]
        out += ["", f"Line fit a + b·N to the new path's figures with the {first} controller "
                f"(N = {', '.join(str(r['ranks']) for r in fitted)}), at N = {at}:", "",
                "| what | a | b per rank | at N |", "|---|---|---|---|"]
        for label, key in (("empty cell wall ms", "new_wall_ms"), ("notebook CPU ms per cell", "new_notebook_cpu_ms"),
                           ("controller CPU ms per cell", "new_controller_cpu_ms")):
            a, b = fit_line(xs, [r[key] for r in fitted])
            out.append(f"| {label} | {a:.2f} | {b:.3f} | {a + b * at:.0f} |")
    return "\n".join(out)


CONTROLLERS = {"taco": "as TacoCluster starts it (engineset.CONTROLLER_CMD and controller_args)",
               "ipyparallel-hub": "taco's settings (controller_args) on ipyparallel's own hub",
               "ipyparallel": "ipyparallel's defaults (its hub, DictDB, DEBUG logger)"}


def controllers(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CONTROLLERS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"controllers are {', '.join(CONTROLLERS)}; got {text!r}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", choices=("taco", "plain"), default="taco")
    parser.add_argument("--ranks", type=cluster_sizes, default="2,4,8,16", help="comma-separated cluster sizes")
    parser.add_argument("--cells", type=int, default=20, help="empty cells per protocol and size (≥ 2)")
    parser.add_argument("--sleep", type=float, default=2.0, help="seconds the watched cell runs")
    parser.add_argument("--extrapolate", type=int, default=1000)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    result_files.add_json_option(parser, "cell_protocol")  # written after each N
    parser.add_argument("--controller", type=controllers, default="taco",
                        help="plain engines only, comma-separated, each size measured with each in turn: "
                             f"{', '.join(f'{k}: {v}' for k, v in CONTROLLERS.items())}")
    args = parser.parse_args()
    raise_open_files_limit()  # hundreds of engines started from here, as from the notebook
    if args.controller != ["taco"] and args.engines != "plain":
        parser.error("--controller other than taco needs --engines plain (a TacoCluster always starts taco's)")
    sizes = args.ranks
    if args.cells < 2:
        parser.error("--cells must be at least 2")
    rows = []
    for size in sizes:
        for settings in args.controller:
            rows.append({**measure(args.engines, size, args.cells, args.sleep, args.start_timeout, settings),
                         "controller": settings})
            print(f"[{size} {args.engines} ranks measured, {settings} controller]", flush=True)
        if args.json:
            result_files.write(args.json, {"rows": rows, "cores": os.cpu_count()})
    print(f"cell protocol, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(table(rows, args.cells, args.extrapolate))


if __name__ == "__main__":
    with signals.stop_on_sigterm():  # SIGTERM and SIGHUP stop the clusters too
        main()
