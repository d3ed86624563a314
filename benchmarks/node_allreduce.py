"""Allreduce on one host: gloo's ring against taco's node algorithm (shared memory), at several rank counts.

A one-node job (a notebook's default local cluster, a single multi-GPU box running CPU tensors) resolves
``algorithm="auto"`` to the node algorithm: every rank copies its tensor into a shared segment, sums its shard
across the slots and reads every shard back (:func:`taco_notebook.comm.transport.pipeline.reduce_node_shm`).
``flat`` is gloo's ring over the same ranks. Each launch is one ``mpiexec -n N``; the variants are interleaved
iteration by iteration::

    .venv/bin/python -m benchmarks node_allreduce --ranks 4 16 64 --sizes-mib 1 16 --json

Per variant and size (float32, sum, in place): the median over ``--iters`` of the slowest rank's time, each
iteration started after a barrier; and a check that every rank holds the exact sum (the node algorithm sums each
element in one order on one rank, so every rank's result is bitwise the same).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import emulated_run as er  # mpiexec (run, and killed with its ranks on a timeout or Ctrl-C), the table
import result_files

VARIANTS = ("flat", "auto")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 64], help="ranks per launch (one host)")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16], help="payload sizes (MiB)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per variant and size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations before them")
    result_files.add_json_option(parser, "node_allreduce")
    parser.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be at least 1 and --warmup at least 0")
    if min(args.ranks) < 2:
        parser.error("--ranks: an allreduce needs at least 2 ranks")
    if min(args.sizes_mib) <= 0:
        parser.error("--sizes-mib must be positive")
    return args


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import taco_notebook.comm as taco

    r, n = taco.rank(), taco.size()
    rows = []
    for mib in args.sizes_mib:
        numel = int(mib * (1 << 20)) // 4
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for it in range(args.warmup + args.iters):
            for variant in VARIANTS:
                t = torch.full((numel,), float(r + 1))
                taco.barrier()
                began = time.perf_counter()
                taco.allreduce(t, algorithm=variant)
                took = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                exact = float(n * (n + 1) // 2)
                if not bool((t == exact).all()):
                    raise SystemExit(f"rank {r}: {variant} gave {t[:4].tolist()}..., not {exact}")
                if it >= args.warmup:
                    times[variant].append(float(took))
        rows.append({"ranks": n, "mib": mib, **{f"{v}_ms": statistics.median(times[v]) * 1e3 for v in VARIANTS}})
    if r == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.rank_mode:
        rank_main(args)
        return 0
    results = []
    for n in args.ranks:
        cmd = [er.mpiexec_path(), "-n", str(n), sys.executable, __file__, "--rank-mode", "--iters", str(args.iters),
               "--warmup", str(args.warmup), "--sizes-mib", *map(str, args.sizes_mib)]
        try:
            out = er.run_mpiexec(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, 3600, capture=True)
        except er.RanksFailed as failure:
            print(failure, file=sys.stderr)
            return 1
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"no RESULT line from rank 0:\n{out[-3000:]}", file=sys.stderr)
            return 1
        results.extend(json.loads(line[len("RESULT "):]))
    print(er.markdown_table(["ranks", "MiB", "gloo ring (flat) ms", "node (shared memory) ms", "speed-up"],
                            [[row["ranks"], f"{row['mib']:g}", f"{row['flat_ms']:.1f}", f"{row['auto_ms']:.1f}",
                              f"{row['flat_ms'] / row['auto_ms']:.1f}x"] for row in results]))
    if args.json:
        result_files.write(args.json, {"argv": argv, "cores": os.cpu_count(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
