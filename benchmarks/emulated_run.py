"""Shared launcher of the benchmarks: one ``mpiexec`` of a per-rank body, on emulated nodes or on localhost.

A benchmark script is its own per-rank body: the driver (``python benchmarks/X.py``) re-runs the same file under
``mpiexec`` with ``--worker OUTDIR``; rank 0 writes ``OUTDIR/result.json``, which the driver reads back.

* emulated (default, root): ``EmulatedNodes(nodes, rate)`` (network namespaces + bridge + htb-shaped links) and
  ``mpiexec`` placed on them by hydra; every rank sees its node's name and ``GLOO_SOCKET_IFNAME``.
* ``--no-emulate``: plain ``mpiexec -n N`` on localhost with ``LIGHT_INTRA_SIZE=ranks_per_node`` (quick checks,
  non-root); there is no link limit, so bounds and link byte counts are not meaningful.

Every failure path tears down: ``mpiexec`` runs in its own session and, on a rank crash, a timeout, Ctrl-C or
SIGTERM of the driver, it and every process it started are killed (collected from the process tree);
then ``EmulatedNodes.__exit__`` kills whatever still runs in the namespaces and deletes them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import result_files

REPO = Path(__file__).resolve().parent.parent


class RanksFailed(RuntimeError):
    pass


def add_launch_args(parser: argparse.ArgumentParser, timeout_s: float) -> None:
    """The options every benchmark shares; ``--worker`` is internal (set by the driver)."""
    group = parser.add_argument_group("cluster")
    group.add_argument("--no-emulate", action="store_true",
                       help="plain localhost mpiexec with LIGHT_INTRA_SIZE (no namespaces, no link limit)")
    group.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    group.add_argument("--ranks-per-node", type=int, default=2, help="MPI ranks per node (default 2)")
    group.add_argument("--rate", default="1gbit",
                       help="each node's link rate, tc syntax (default 1gbit); 'none' = unshaped links "
                       "(tells CPU-bound from link-bound)")
    group.add_argument("--timeout", type=float, default=timeout_s, help=f"seconds for the whole mpiexec "
                       f"(default {timeout_s:g})")
    group.add_argument("--out", type=Path, default=None,
                       help="JSON output (default benchmarks/results/MACHINE/BENCHMARK/UTC-TIMESTAMP.json)")
    parser.add_argument("--worker", metavar="OUTDIR", default=None, help=argparse.SUPPRESS)


def worker_argv(argv: Sequence[str]) -> list[str]:
    """The driver's own arguments minus the driver-only ones, to hand to the ranks."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
            continue
        if word in ("--out", "--timeout"):
            skip = True
            continue
        if word.startswith(("--out=", "--timeout=")):
            continue
        out.append(word)
    return out


def mpiexec_path() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else "mpiexec"


def kill_tree(proc: subprocess.Popen[Any], grace_s: float = 5.0) -> None:
    """SIGTERM mpiexec and every process it started, SIGKILL what is left after ``grace_s``: hydra puts each
    proxy and rank in a session of its own, which mpiexec's group does not reach. The tree is read while
    mpiexec is our unreaped child, as psutil processes, which check pid and creation time before each signal:
    a pid reused in the meantime is never hit."""
    if proc.poll() is not None:
        return
    import psutil

    from taco_notebook.cluster.processes.tree import descendants, kill

    started = descendants(psutil.Process(proc.pid))[1:]  # mpiexec itself is signalled and reaped through Popen
    _signal_group(proc, signal.SIGTERM)  # its session's group: ours while mpiexec, its leader, is unreaped
    for process in started:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(started, timeout=grace_s)
    kill(left)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_mpiexec(argv: list[str], env: dict[str, str], timeout_s: float, capture: bool = False) -> str:
    """Run mpiexec in its own session; kill it and every rank it started on a timeout, Ctrl-C or SIGTERM.

    The ranks' output goes to this terminal, or with ``capture`` is returned (stdout; on a failure the
    :class:`RanksFailed` carries the end of both streams, since nothing was shown).
    """
    print("$", " ".join(argv), flush=True, file=sys.stderr if capture else sys.stdout)
    pipe = subprocess.PIPE if capture else None
    # (with: the captured pipes are closed however this ends, a timeout and Ctrl-C included)
    with subprocess.Popen(argv, env=env, start_new_session=True, cwd=REPO, stdout=pipe, stderr=pipe,
                          text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            raise RanksFailed(f"mpiexec ran past --timeout {timeout_s:g} s and was killed") from None
        except BaseException:  # Ctrl-C, SIGTERM (turned into KeyboardInterrupt), anything
            kill_tree(proc)
            raise
    if proc.returncode != 0:
        shown = f":\n{out[-3000:]}{err[-3000:]}" if capture else " (a rank failed; its traceback is above)"
        raise RanksFailed(f"mpiexec exited with {proc.returncode}{shown}")
    return out or ""


def launch(script: str, args: argparse.Namespace, argv: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``script --worker OUTDIR ARGV`` on every rank; return (rank 0's result, run metadata).

    When the ranks fail, the result is what rank 0 wrote so far (possibly ``{}``) and ``meta["error"]`` says
    why; Ctrl-C and SIGTERM propagate as KeyboardInterrupt after the teardown.
    """
    old_term = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    # Ctrl-C must tear down even when started from a shell that ignores SIGINT (a background job).
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    nranks = args.nodes * args.ranks_per_node
    outdir = Path(tempfile.mkdtemp(prefix="taco-bench-"))
    body = [sys.executable, "-u", str(Path(script).resolve()), "--worker", str(outdir), *worker_argv(argv)]
    meta: dict[str, Any] = {
        "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "emulated": not args.no_emulate, "nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
        "world_size": nranks, "rate": None if args.no_emulate else args.rate,
    }
    started = time.perf_counter()
    try:
        base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if args.no_emulate:
            env = dict(base, LIGHT_INTRA_SIZE=str(args.ranks_per_node))
            for key in ("TACO_NODE_NAME", "GLOO_SOCKET_IFNAME"):
                env.pop(key, None)
            run_mpiexec([mpiexec_path(), "-n", str(nranks), *body], env, args.timeout)
        else:
            from taco_notebook.emulate.nodes import EmulatedNodes, parse_rate

            unlimited = args.rate.lower() in ("none", "unlimited")
            with EmulatedNodes(args.nodes, rate=None if unlimited else args.rate) as cluster:
                meta["rate_bits_per_s"] = None if unlimited else parse_rate(args.rate)
                meta["cluster"] = repr(cluster)
                env = cluster.mpiexec_env(base)
                env.pop("LIGHT_INTRA_SIZE", None)
                run_mpiexec([mpiexec_path(), *cluster.mpiexec_args(args.ranks_per_node), "-n", str(nranks),
                             *body], env, args.timeout)
    except RanksFailed as failure:  # keep what rank 0 wrote before the failure (it writes after each variant)
        meta["error"] = str(failure)
        print(f"\n!! {failure}", file=sys.stderr, flush=True)
    finally:
        try:
            result = json.loads((outdir / "result.json").read_text())
        except (OSError, ValueError):
            result = {}
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
        shutil.rmtree(outdir, ignore_errors=True)
    meta["wall_s"] = round(time.perf_counter() - started, 1)
    return result, meta


def main(script: str, argv: Sequence[str], parse_args: Any, worker: Any, report: Any) -> int:
    """The benchmarks' shared driver: rank body (``--worker``) or launch, then a caption and table from
    ``report(args, result, meta) -> (caption, rows, table)``, the INCOMPLETE line and the JSON file (named
    after the script: ``allreduce_bench.py`` writes ``results/MACHINE/allreduce_bench/…``)."""
    args = parse_args(list(argv))
    if args.worker:
        worker(args)
        return 0
    try:
        result, meta = launch(script, args, argv)
    except KeyboardInterrupt as exc:
        return interrupted(exc)
    caption, rows, table = report(args, result, meta)
    print(f"\n### {caption}\n")
    print(table)
    if meta.get("error") or not result.get("complete"):
        print(f"\nINCOMPLETE: {meta.get('error', 'rank 0 did not finish')}")
    kept = {k: v for k, v in vars(args).items() if k not in ("worker", "out")}
    path = save(Path(script).stem, args, {"meta": meta, "args": kept, "result": result, "rows": rows})
    print(f"\nJSON: {path}")
    return 0 if result.get("complete") and not meta.get("error") else 1


def describe_setup(args: argparse.Namespace) -> str:
    """'2 emulated nodes × 2 ranks, 1gbit links' (or localhost), for table captions."""
    if args.no_emulate:
        return "localhost, no link limit"
    rate = "unshaped" if args.rate.lower() in ("none", "unlimited") else args.rate
    return f"{args.nodes} emulated nodes × {args.ranks_per_node} ranks, {rate} links"


def interrupted(exc: KeyboardInterrupt) -> int:
    print(f"\ninterrupted ({exc or 'Ctrl-C'}): mpiexec killed, emulated nodes removed", file=sys.stderr)
    return 130


def save(benchmark: str, args: argparse.Namespace, payload: dict[str, Any]) -> Path:
    """Write the JSON result to ``--out``, by default ``benchmarks/results/MACHINE/BENCHMARK/UTC-TIMESTAMP.json``,
    with the command line and git revision (``result_files.write``)."""
    return result_files.write(args.out or result_files.result_path(benchmark), payload)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


# ---- rank side ---------------------------------------------------------------------------------------------
def link_counters() -> tuple[int, int] | None:
    """(tx, rx) bytes of this node's emulated interface (``GLOO_SOCKET_IFNAME``), or None off an emulated node.

    Inside ``ip netns exec`` /sys shows the namespace's own interfaces: tx = out of the node, rx = into it.
    """
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if not ifname or not os.environ.get("TACO_NODE_NAME"):
        return None
    base = Path("/sys/class/net") / ifname / "statistics"
    try:
        return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())
    except OSError:
        return None


def write_result(outdir: str, result: dict[str, Any]) -> None:
    tmp = Path(outdir) / "result.json.tmp"
    tmp.write_text(json.dumps(result), encoding="utf-8")
    tmp.rename(Path(outdir) / "result.json")


def shutdown_process_group(taco: Any) -> None:
    """``taco.shutdown()``; should it fail (the comm API is being worked on), warn and destroy the group directly.

    The results are written by then: a failing teardown must not turn a finished run into a failed one.
    """
    try:
        taco.shutdown()
    except Exception as exc:  # noqa: BLE001
        import torch.distributed as dist

        print(f"warning: taco.shutdown() failed ({type(exc).__name__}: {exc}); destroying the process group "
              "directly", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
