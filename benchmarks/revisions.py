"""Allreduce speed of a git revision against the work tree, alternately in one run on the same emulated cluster.

Each variant (taco ``none``, ``fp16``, ``topk:0.01`` on a ``--mib`` MiB tensor) is timed as a ratio to gloo's
allreduce of the same tensor in the same round, so a machine that is busier at one moment weighs on both. The
revision and the work tree run ``--pairs`` times each, alternating (base, tree, base, tree, ...), every run one
``mpiexec`` over the same emulated nodes with ``PYTHONPATH`` pointing at that tree; the revision is checked out in
a private temporary worktree, removed afterwards. The table gives each variant's median ratio and its spread
(min–max over the runs) for both, and the change. Run it before a change to ``taco_notebook/comm`` lands::

    python -m benchmarks revisions HEAD              # the last commit against the work tree (root: namespaces)
    python -m benchmarks revisions origin/main --pairs 5 --mib 16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import emulated_run
import result_files

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("none", "fp16", "topk:0.01")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks revisions", description=__doc__.split("\n\n")[0])
    parser.add_argument("base", nargs="?", default="HEAD", help="the git revision to compare with (default HEAD)")
    parser.add_argument("--pairs", type=int, default=3, help="runs of each tree, alternating (default 3)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of every variant per run (default 5)")
    parser.add_argument("--mib", type=int, default=16, help="tensor size in MiB (default 16)")
    emulated_run.add_launch_args(parser, timeout_s=300)
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.rounds < 1 or args.mib < 1:
        parser.error("--pairs, --rounds and --mib must be at least 1")
    return args


# ---- rank side ---------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    """Every variant and gloo in interleaved rounds; rank 0 writes each variant's median ratio to gloo."""
    import torch
    import torch.distributed as dist

    import taco_notebook.comm as taco

    if hasattr(taco, "init"):
        taco.init()
    tensor = torch.randn(args.mib * (1 << 18))

    def timed(run: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        run()
        seconds = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return float(seconds.item())

    runs = {"gloo": lambda: dist.all_reduce(tensor.clone())}
    for name in VARIANTS:
        runs[name] = (lambda c: lambda: taco.allreduce(tensor.clone(), compression=c))(name)
    for run in runs.values():  # warm-up: buffers, compressors' state, the agreement check's first signature
        run()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            seconds[name].append(timed(run))
    if taco.rank() == 0:
        ratios = {name: statistics.median(g / t for g, t in zip(seconds["gloo"], seconds[name], strict=True))
                  for name in VARIANTS}
        ms = {name: statistics.median(values) * 1e3 for name, values in seconds.items()}
        emulated_run.write_result(args.worker, {"x_gloo": ratios, "ms": ms, "complete": True})
    emulated_run.shutdown_process_group(taco)


# ---- driver ------------------------------------------------------------------------------------------------
def checkout(base: str) -> tuple[Path, str]:
    """A private worktree of ``base`` and its short hash; ValueError naming the revision when git refuses it."""
    found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "--verify", f"{base}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise ValueError(f"no git revision {base!r} in {REPO}: {found.stderr.strip()}")
    where = Path(tempfile.mkdtemp(prefix="taco-revision-"))  # 0700
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(where / "tree"), base],
                   check=True, capture_output=True)
    return where, found.stdout.strip()


def remove(where: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(where / "tree")],
                   capture_output=True)
    shutil.rmtree(where, ignore_errors=True)


def one_run(args: argparse.Namespace, tree: Path, cluster: Any, argv: list[str]) -> dict[str, Any]:
    """One mpiexec of this file's rank body, importing taco_notebook from ``tree``."""
    outdir = tempfile.mkdtemp(prefix="taco-bench-")
    try:
        base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(tree))
        body = [sys.executable, "-u", str(Path(__file__).resolve()), "--worker", outdir,
                *emulated_run.worker_argv(argv)]
        if cluster is None:
            env = dict(base, LIGHT_INTRA_SIZE=str(args.ranks_per_node))
            launch = [emulated_run.mpiexec_path(), "-n", str(args.nodes * args.ranks_per_node), *body]
        else:
            env = cluster.mpiexec_env(base)
            env.pop("LIGHT_INTRA_SIZE", None)
            launch = [emulated_run.mpiexec_path(), *cluster.mpiexec_args(args.ranks_per_node),
                      "-n", str(args.nodes * args.ranks_per_node), *body]
        emulated_run.run_mpiexec(launch, env, args.timeout, capture=True)
        return dict(json.loads((Path(outdir) / "result.json").read_text()))
    finally:
        shutil.rmtree(outdir, ignore_errors=True)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}× ({min(values):.2f}–{max(values):.2f})"


def report(runs: dict[str, list[dict[str, Any]]], names: tuple[str, str]) -> tuple[list[list[str]], str]:
    rows = []
    for variant in VARIANTS:
        base = [run["x_gloo"][variant] for run in runs["base"]]
        tree = [run["x_gloo"][variant] for run in runs["tree"]]
        change = statistics.median(tree) / statistics.median(base) - 1
        rows.append([variant, spread(base), spread(tree), f"{change:+.1%}"])
    header = ["variant", f"{names[0]}: × gloo, median (min–max)", f"{names[1]}: × gloo", "change"]
    return rows, emulated_run.markdown_table(header, rows)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    try:
        where, short = checkout(args.base)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    trees = {"base": where / "tree", "tree": REPO}
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "tree": []}
    try:
        if args.no_emulate:
            for _ in range(args.pairs):
                for name, tree in trees.items():
                    runs[name].append(one_run(args, tree, None, argv))
        else:
            from taco_notebook.emulate.nodes import EmulatedNodes

            unlimited = args.rate.lower() in ("none", "unlimited")
            with EmulatedNodes(args.nodes, rate=None if unlimited else args.rate) as cluster:
                for pair in range(args.pairs):
                    for name, tree in trees.items():
                        print(f"run {pair + 1}/{args.pairs}: {short if name == 'base' else 'work tree'}",
                              file=sys.stderr, flush=True)
                        runs[name].append(one_run(args, tree, cluster, argv))
    except KeyboardInterrupt as exc:
        return emulated_run.interrupted(exc)
    except emulated_run.RanksFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        remove(where)
    rows, table = report(runs, (short, "work tree"))
    print(f"\n### allreduce {args.mib} MiB, {emulated_run.describe_setup(args)}: {short} against the work tree, "
          f"{args.pairs} runs each, alternating\n")
    print(table)
    kept = {k: v for k, v in vars(args).items() if k not in ("worker", "out")}
    path = result_files.write(args.out or result_files.result_path("revisions"),
                              {"args": kept, "base": short, "runs": runs, "rows": rows})
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
