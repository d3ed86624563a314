"""The control plane's cost per rank: cluster start, a warm cell's round trip, engine memory, at N = 2…32 ranks.

For each N it starts a local :class:`~taco_notebook.cluster.session.TacoCluster` of N ranks (the public Python
API, tracked in a private registry directory as the magics do), then measures, interleaving the variants so
that a burst of load from other processes hits them all alike:

- **start**: ``TacoCluster(...).start()`` wall time (controller, ``mpiexec``, engine registration, rank check,
  torch and the process group on every rank), and how much of it passed before the last engine process existed;
- **cells** through ``run_cell`` (what ``%%taco_run`` does, minus the rendering): an empty cell, and a cell that
  allreduces one 1 MB tensor (262,144 float32) and checks the sum; median and p90 of ``--repeats``, and the
  notebook process's CPU time per empty cell;
- **the split** of an empty ``execute`` on the direct view, from ipyparallel's per-engine metadata (``submitted``
  on the client, ``started``/``completed`` on the engine, ``received`` on the client; one host, one clock), along
  the critical path (the engine whose reply came last): client (before ``submitted`` and after ``received``),
  controller out (``submitted`` to ``started``), engine (``started`` to ``completed``), controller back
  (``completed`` to ``received``); and the fan-out (first to last engine ``started``);
- **dispatch**: the direct view against ipyparallel's ``broadcast_view`` (its BroadcastScheduler tree starts with
  every controller, depth 1 by default): ``execute("pass")`` on each (ipyparallel 9 runs a broadcast ``execute``
  without coalescing), and ``apply(int)`` on the direct view against a ``broadcast_view(is_coalescing=True)``;
- **memory**: each engine's RSS and PSS from ``/proc/PID/status`` and ``smaps_rollup`` (PSS splits the shared
  pages of torch's libraries among the engines), the controller's process tree RSS;
- **registry**: one entry's write (``registry_writer.write_entry``) and its size.

Every cluster is stopped (``try``/``finally``). Prints markdown tables and a line fit ``a + b·N`` of start and
round trips, extrapolated to 1000 ranks; ``--json`` writes every figure to benchmarks/results/ (``result_files``).

    .venv/bin/python -m benchmarks control_plane --ranks 2,4,8,16 --repeats 15 --json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import result_files
import signals

from taco_notebook.errors import ClusterStartError

__all__ = ["fit_line", "main", "measure_cluster"]

EMPTY = "pass"
ALLREDUCE = ("_t = torch.ones(262144)\ntaco.allreduce(_t)\n"
             "assert _t[0].item() == taco.size(), f'allreduce gave {_t[0].item()}'")
SPLIT_KEYS = ("client", "controller_out", "engine", "controller_back")
PUBLISH = ("from taco_notebook.engine import calls as _e\n_e.begin_cell(True)\n"
           "for _ in range(20):\n    taco.metrics.step(samples=1)\n"
           "for _ in range({n}):\n    taco.metrics.send()\n"
           "import pickle as _p\n_payload_bytes = len(_p.dumps(taco.metrics.snapshot()))")
VARIANTS = ("direct execute", "broadcast execute", "direct apply", "broadcast apply, coalescing")


class QuietSink:
    """An OutputSink that keeps what the ranks print (an empty cell prints nothing) and shows none of it."""

    def __init__(self) -> None:
        self.text: list[str] = []

    def stream(self, rank: int, name: str, text: str) -> None:
        self.text.append(text)

    def warn(self, text: str) -> None:
        self.text.append(text)

    def display(self, rank: int, content: dict[str, Any]) -> None: ...
    def notice(self, text: str) -> None: ...
    def flush(self) -> None: ...


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def p90_ms(samples: list[float]) -> float:
    ordered = sorted(samples)  # nearest rank: of 2 samples, the larger
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)] * 1e3


def proc_kib(pid: int, path: str, key: str) -> int:
    """A ``key:  N kB`` line of ``/proc/PID/<path>``, in KiB (0 when the process or line is gone)."""
    try:
        for line in Path(f"/proc/{pid}/{path}").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def memory(cluster: Any) -> dict[str, Any]:
    """Engines' RSS and PSS (MiB, sum and per engine) and the controller's process tree RSS."""
    import psutil

    pids = [r.pid for r in cluster.ranks]
    rss = [proc_kib(pid, "status", "VmRSS") / 1024 for pid in pids]
    pss = [proc_kib(pid, "smaps_rollup", "Pss") / 1024 for pid in pids]
    controller = psutil.Process(cluster.ipp_cluster.controller.process.pid)
    tree = [controller, *controller.children(recursive=True)]
    return {"engine_rss_mib": rss, "engine_rss_sum_mib": sum(rss), "engine_pss_sum_mib": sum(pss),
            "controller_rss_mib": sum(proc_kib(p.pid, "status", "VmRSS") for p in tree) / 1024,
            "controller_processes": len(tree)}


def launch_share(cluster: Any, began: float) -> float:
    """Seconds from the start call until the last engine process existed (``mpiexec``'s launch)."""
    import psutil

    created = []
    for rank in cluster.ranks:
        try:
            created.append(psutil.Process(rank.pid).create_time())
        except psutil.Error:
            pass
    return max(created) - began if created else float("nan")


def split_one(view: Any) -> dict[str, float]:
    """One empty ``execute`` on ``view``, cut along the critical path by ipyparallel's metadata timestamps."""
    began = time.time()
    ar = view.execute(EMPTY, silent=False, block=False)
    ar.get()
    ended = time.time()
    mds = list(ar.metadata)
    last = max(mds, key=lambda md: md["received"])
    ts = {k: last[k].timestamp() for k in ("submitted", "started", "completed", "received")}
    starts = [md["started"].timestamp() for md in mds]
    return {"total": ended - began,
            "client": (ts["submitted"] - began) + (ended - ts["received"]),
            "controller_out": ts["started"] - ts["submitted"], "engine": ts["completed"] - ts["started"],
            "controller_back": ts["received"] - ts["completed"], "fanout": max(starts) - min(starts)}


def dispatch_round(client: Any, views: dict[str, Any]) -> dict[str, float]:
    """One empty request through each of :data:`VARIANTS`; seconds each."""
    timed = {}
    for name, (view, call) in views.items():
        began = time.perf_counter()
        if call == "execute":
            view.execute(EMPTY, silent=False, block=True)
        else:
            view.apply_sync(int)
        timed[name] = time.perf_counter() - began
    return timed


def run_cells(cluster: Any, repeats: int) -> dict[str, Any]:
    """Empty and allreduce cells through ``run_cell``, the split and the dispatch variants, interleaved."""
    from taco_notebook.cluster.cells.run import CellOptions, run_cell

    client = cluster.client
    views = {"direct execute": (client[:], "execute"), "broadcast execute": (client.broadcast_view(), "execute"),
             "direct apply": (client[:], "apply"),
             "broadcast apply, coalescing": (client.broadcast_view(is_coalescing=True), "apply")}
    sink = QuietSink()
    for _ in range(3):  # warm-up: first cells pay for imports and the engines' caches
        run_cell(cluster, EMPTY, CellOptions(), sink)
        run_cell(cluster, ALLREDUCE, CellOptions(), sink)
        dispatch_round(client, views)
    empty, allreduce, cpu, splits = [], [], [], []
    dispatch: dict[str, list[float]] = {name: [] for name in views}
    for _ in range(repeats):
        cpu_began, began = time.process_time(), time.perf_counter()
        run_cell(cluster, EMPTY, CellOptions(), sink)
        empty.append(time.perf_counter() - began)
        cpu.append(time.process_time() - cpu_began)
        began = time.perf_counter()
        run_cell(cluster, ALLREDUCE, CellOptions(), sink)
        allreduce.append(time.perf_counter() - began)
        splits.append(split_one(client[:]))
        for name, seconds in dispatch_round(client, views).items():
            dispatch[name].append(seconds)
    split = {key: median_ms([s[key] for s in splits]) for key in ("total", *SPLIT_KEYS, "fanout")}
    return {"empty_ms": median_ms(empty), "empty_p90_ms": p90_ms(empty), "empty_cpu_ms": median_ms(cpu),
            "allreduce_ms": median_ms(allreduce), "allreduce_p90_ms": p90_ms(allreduce), "split_ms": split,
            "dispatch_ms": {name: median_ms(s) for name, s in dispatch.items()},
            "dispatch_p90_ms": {name: p90_ms(s) for name, s in dispatch.items()}}


def publish_cost(cluster: Any, sends: int = 50) -> dict[str, float]:
    """The notebook process's CPU per dashboard payload received: every rank sends ``sends`` metric payloads
    (ipyparallel datapub, as a ``%%taco_run`` cell does every ``calls.SEND_S``); an empty cell's CPU is taken
    off. ``wait_for_output`` returns after the engines' idle status, which follows their payloads on iopub."""
    view, samples = cluster.client[:], []
    for _ in range(3):
        cpu = time.process_time()
        view.execute(EMPTY, silent=False, block=True).wait_for_output()
        base = time.process_time() - cpu
        cpu = time.process_time()
        ar = view.execute(PUBLISH.format(n=sends), silent=False, block=True)
        ar.wait_for_output()
        samples.append((time.process_time() - cpu - base) / (sends * cluster.size))
        steps = {md["data"]["taco"]["metrics"]["steps"] for md in ar.metadata}
        if steps != {20}:
            raise RuntimeError(f"the payloads did not all arrive: steps seen {steps}")
    from taco_notebook.engine import calls

    view.apply_sync(calls.begin_cell, False)  # no sender left behind (the next cell's begin_cell says the same)
    return {"publish_client_cpu_us": statistics.median(samples) * 1e6,
            "payload_bytes": cluster.client[0].pull("_payload_bytes", block=True)}


def cpu_seconds(processes: list[Any]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except Exception:  # psutil.Error: a scheduler that exited counts nothing
            pass
    return total


def start_cpu(cluster: Any) -> dict[str, float]:
    """CPU seconds the start cost each engine (interpreter, ipyparallel, torch, registration, process group) and
    the controller's tree: what N ranks on C cores divide among themselves, whatever else the machine runs."""
    import psutil

    controller = psutil.Process(cluster.ipp_cluster.controller.process.pid)
    engines = [psutil.Process(r.pid) for r in cluster.ranks]
    return {"start_cpu_per_engine_s": cpu_seconds(engines) / len(engines),
            "start_cpu_controller_s": cpu_seconds([controller, *controller.children(recursive=True)])}


# Cells the CPU figures are taken over, at least: process CPU times count in clock ticks (10 ms), and the
# controller spends ~5 ms per empty cell, so over 2 cells it read 0, 5 or 10 ms from run to run
CPU_CELLS = 20


def cpu_per_cell(cluster: Any, repeats: int) -> dict[str, float]:
    """CPU time (not wall time: no other process's load in it) one empty ``run_cell`` costs the notebook
    process, the controller's process tree (hub, schedulers) and all engines together, over ``repeats`` cells
    (:data:`CPU_CELLS` at least, so that a tick is a tenth of a cell's cost or less)."""
    repeats = max(repeats, CPU_CELLS)
    import psutil

    from taco_notebook.cluster.cells.run import CellOptions, run_cell

    controller = psutil.Process(cluster.ipp_cluster.controller.process.pid)
    parts = {"controller": [controller, *controller.children(recursive=True)],
             "engines": [psutil.Process(r.pid) for r in cluster.ranks]}
    before = {name: cpu_seconds(procs) for name, procs in parts.items()}
    client_before = time.process_time()
    for _ in range(repeats):
        run_cell(cluster, EMPTY, CellOptions(), QuietSink())
    spent = {name: cpu_seconds(procs) - before[name] for name, procs in parts.items()}
    return {"cpu_client_ms": (time.process_time() - client_before) / repeats * 1e3,
            "cpu_controller_ms": spent["controller"] / repeats * 1e3,
            "cpu_engines_ms": spent["engines"] / repeats * 1e3}


def registry_cost(cluster: Any, directory: Path) -> dict[str, float]:
    from taco_notebook.cluster.registry.files import entry_path
    from taco_notebook.cluster.registry.writer import write_entry

    samples = []
    for _ in range(20):
        began = time.perf_counter()
        write_entry(cluster, directory)
        samples.append(time.perf_counter() - began)
    return {"registry_write_ms": median_ms(samples),
            "registry_entry_bytes": entry_path(directory, cluster.cluster_id).stat().st_size}


def measure_cluster(size: int, repeats: int, registry: Path, start_timeout: float) -> dict[str, Any]:
    """Start an N-rank cluster, measure everything above, stop it (also on failure)."""
    from taco_notebook.cluster.registry.writer import track
    from taco_notebook.cluster.session import TacoCluster

    load_before = os.getloadavg()[0]
    cluster = track(TacoCluster(f"cp{size}-{os.getpid()}", size, start_timeout=start_timeout),
                    registry)
    try:
        began_wall, began = time.time(), time.perf_counter()
        cluster.start()
        row: dict[str, Any] = {"ranks": size, "start_s": time.perf_counter() - began,
                               "launch_s": launch_share(cluster, began_wall)}
        row.update(start_cpu(cluster))
        row.update(run_cells(cluster, repeats))
        row.update(cpu_per_cell(cluster, repeats))
        row.update(publish_cost(cluster))
        row.update(memory(cluster))
        row.update(registry_cost(cluster, registry))
    finally:
        cluster.stop()
    row["load"] = [load_before, os.getloadavg()[0]]
    return row


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b·x``; returns (a, b). Two points or more."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return mean_y - b * mean_x, b


def fits(rows: list[dict[str, Any]], at: int) -> list[dict[str, Any]]:
    xs = [float(r["ranks"]) for r in rows]
    found = []
    for label, key, unit in [("cluster start", "start_s", "s"), ("empty cell", "empty_ms", "ms"),
                             ("1 MB allreduce cell", "allreduce_ms", "ms"),
                             ("empty execute, direct", ("dispatch_ms", "direct execute"), "ms"),
                             ("empty apply, broadcast coalescing", ("dispatch_ms", "broadcast apply, coalescing"),
                              "ms"),
                             ("controller CPU at start", "start_cpu_controller_s", "s"),
                             ("notebook CPU per empty cell", "cpu_client_ms", "ms"),
                             ("controller CPU per empty cell", "cpu_controller_ms", "ms"),
                             ("engines' CPU per empty cell (sum)", "cpu_engines_ms", "ms"),
                             ("notebook CPU per dashboard payload", "publish_client_cpu_us", "µs"),
                             ("engine RSS sum", "engine_rss_sum_mib", "MiB"),
                             ("engine PSS sum", "engine_pss_sum_mib", "MiB")]:
        ys = [r[key[0]][key[1]] if isinstance(key, tuple) else r[key] for r in rows]
        a, b = fit_line(xs, ys) if len(rows) > 1 else (ys[0], 0.0)
        found.append({"what": label, "unit": unit, "a": a, "b": b, "at": at, "extrapolated": a + b * at})
    return found


def tables(rows: list[dict[str, Any]], fitted: list[dict[str, Any]], repeats: int) -> str:
    out = [f"Per N: start once; cells median (p90) of {repeats}; load = 1-min load average before/after.", "",
           "| ranks | start s | of it launch s | start CPU s per engine / controller | empty cell ms "
           "| 1 MB allreduce cell ms | client CPU µs per dashboard payload (bytes) "
           "| engine RSS MiB (sum / each) | engine PSS sum MiB | controller RSS MiB | registry write ms (bytes) "
           "| load |", "|" + "---|" * 12]
    for r in rows:
        out.append(f"| {r['ranks']} | {r['start_s']:.1f} | {r['launch_s']:.1f} | "
                   f"{r['start_cpu_per_engine_s']:.1f} / {r['start_cpu_controller_s']:.1f} | {r['empty_ms']:.1f} "
                   f"({r['empty_p90_ms']:.1f}) | {r['allreduce_ms']:.1f} "
                   f"({r['allreduce_p90_ms']:.1f}) | {r['publish_client_cpu_us']:.0f} ({r['payload_bytes']}) | "
                   f"{r['engine_rss_sum_mib']:.0f} / "
                   f"{r['engine_rss_sum_mib'] / r['ranks']:.0f} | {r['engine_pss_sum_mib']:.0f} | "
                   f"{r['controller_rss_mib']:.0f} | {r['registry_write_ms']:.2f} ({r['registry_entry_bytes']}) "
                   f"| {r['load'][0]:.1f} / {r['load'][1]:.1f} |")
    out += ["", "Empty `execute` on the direct view, critical path (the last engine to reply), median ms:", "",
            "| ranks | total | client | controller out | engine | controller back | fan-out (first→last start) "
            "| CPU ms per `run_cell`: notebook / controller / all engines |", "|" + "---|" * 8]
    for r in rows:
        s = r["split_ms"]
        out.append(f"| {r['ranks']} | {s['total']:.1f} | {s['client']:.1f} | {s['controller_out']:.1f} | "
                   f"{s['engine']:.2f} | {s['controller_back']:.1f} | {s['fanout']:.1f} | {r['cpu_client_ms']:.1f} / "
                   f"{r['cpu_controller_ms']:.1f} / {r['cpu_engines_ms']:.1f} |")
    out += ["", "Dispatch of an empty request, median (p90) ms:", "",
            "| ranks | " + " | ".join(VARIANTS) + " |", "|" + "---|" * (len(VARIANTS) + 1)]
    for r in rows:
        out.append(f"| {r['ranks']} | " + " | ".join(
            f"{r['dispatch_ms'][v]:.1f} ({r['dispatch_p90_ms'][v]:.1f})" for v in VARIANTS) + " |")
    out += ["", f"Line fit a + b·N over the measured N, and its value at N = {fitted[0]['at']} (extrapolated):", "",
            "| what | a | b per rank | at N |", "|---|---|---|---|"]
    for f in fitted:
        out.append(f"| {f['what']} ({f['unit']}) | {f['a']:.2f} | {f['b']:.3f} | {f['extrapolated']:.0f} |")
    return "\n".join(out)


def cluster_sizes(text: str) -> list[int]:
    """``--ranks``: comma-separated positive integers (an argparse ``type``, shared with cell_protocol.py)."""
    try:
        sizes = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants comma-separated integers like 2,4,8,16, got {text!r}") from None
    if any(n <= 0 for n in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=cluster_sizes, default="2,4,8,16",
                        help="comma-separated cluster sizes (default 2,4,8,16)")
    parser.add_argument("--repeats", type=int, default=15, help="timed cells per variant and size (≥ 2)")
    parser.add_argument("--extrapolate", type=int, default=1000, help="N the line fits are evaluated at")
    parser.add_argument("--start-timeout", type=float, default=600.0,
                        help="seconds N engines get to register (many ranks on few, loaded cores are slow)")
    result_files.add_json_option(parser, "control_plane")  # written after each N
    args = parser.parse_args()
    sizes = args.ranks
    if args.repeats < 2:
        parser.error("--repeats must be at least 2")
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="taco-cp-registry-") as registry:
        os.chmod(registry, 0o700)
        for size in sizes:
            try:
                rows.append(measure_cluster(size, args.repeats, Path(registry), args.start_timeout))
            except ClusterStartError as exc:  # say so, keep what the other sizes measured
                failed.append({"ranks": size, "error": str(exc)})  # with the engines' log tail
                print(f"[{size} ranks: {exc}]", flush=True)
                continue
            print(f"[{size} ranks measured: start {rows[-1]['start_s']:.1f} s]", flush=True)
            if args.json:
                write_json(args.json, rows, failed, args)
    if not rows:
        raise SystemExit("no cluster size could be measured")
    fitted = fits(rows, args.extrapolate)
    print(f"control plane, {os.cpu_count()} cores, {datetime.now().astimezone():%Y-%m-%d %H:%M %Z}")
    print(tables(rows, fitted, args.repeats))
    for failure in failed:
        print(f"not measured: {failure['ranks']} ranks ({failure['error'].splitlines()[0]})")
    if args.json:
        write_json(args.json, rows, failed, args, fitted)


def write_json(path: Path, rows: list[dict[str, Any]], failed: list[dict[str, Any]], args: argparse.Namespace,
               fitted: list[dict[str, Any]] | None = None) -> None:
    result_files.write(path, {"cores": os.cpu_count(), "repeats": args.repeats, "rows": rows, "failed": failed,
                              "fits": fitted, "taken": time.time()})


if __name__ == "__main__":
    with signals.stop_on_sigterm():  # SIGTERM and SIGHUP stop the clusters too
        main()
