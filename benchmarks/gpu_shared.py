"""Ranks sharing one GPU: a training step against DDP's, and the allreduce in the GPU's memory against gloo's.

    python -m benchmarks gpu_shared --json            # on a machine with one GPU; elsewhere it says it skipped
    python -m benchmarks gpu_shared --device cpu      # a self-test of the script on CPU tensors (no figure)

Three tables, every rank under ``mpiexec`` with ``TACO_GPUS=auto`` (a 1-GPU machine's default):

* **step**: ms per training step of a 25.2M-parameter MLP (2048-4096-4096-10, batch 256 a rank) at 1, 2 and 4
  ranks on the one GPU: plain SGD (no communication), DDP (NCCL at 1 rank; gloo when ranks share the GPU, since
  NCCL refuses that), DDP + torch's fp16 hook, and taco's DistributedOptimizer with every compression, with the
  host synchronisations per step of each. At 1 rank the one-rank shortcuts (nothing to reduce) are switched off
  in this process, so fusion, compression and the collective on a one-rank group all run: what each costs.
* **allreduce**: ms of one allreduce of 25M float32 (100 MB) at 2 and 4 ranks: through the GPU's memory (CUDA
  IPC, the default) against gloo through host memory (``taco.configure(shm=False)``), alternating, median of
  each; the sum is checked exactly.
* the goals: taco <= DDP for none and fp16, topk <= 1.2 x DDP, 0 host syncs; 100 MB at 4 ranks >= 5x faster than
  gloo; taco's step at 4 ranks within 1.3 x of one rank's plain step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import gpu_check
from gpu_check import _emit, _results, _syncs, last_line, table
from result_files import add_json_option, write

VARIANTS = ("plain SGD", "DDP", "DDP + torch fp16 hook", "taco", "taco fp16", "taco topk:0.01",
            "taco powersgd:4:warmup=0")
RANKS = (1, 2, 4)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per variant")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    add_json_option(parser, "gpu_shared")
    return parser.parse_args(argv)


# ---- rank side ----------------------------------------------------------------------------------------------
def force_reduction() -> None:
    """Make one rank do what several do: the checks that skip the work when a rank is alone answer no."""
    from taco_notebook.comm.compression import base, compressors, powersgd
    from taco_notebook.comm.training import hooks, optimizer

    for module in (base, compressors, powersgd):
        module.alone = lambda peers: False  # type: ignore[attr-defined]
    for module in (optimizer, hooks):
        module.single_rank = lambda: False  # type: ignore[attr-defined]


def worker_step(steps: int, device_kind: str) -> None:
    import torch

    import taco_notebook.comm as taco

    taco.init()
    if taco.size() == 1:
        force_reduction()
    device = taco.device() if device_kind == "cuda" else torch.device("cpu")
    wide, batch = (4096, 256) if device.type == "cuda" else (64, 8)  # cpu: a self-test, not a measurement
    gen = torch.Generator().manual_seed(taco.rank())
    x = torch.randn(batch, wide // 2, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    ms, syncs, params = gpu_check.timed_mlp_steps(VARIANTS, wide, x, y, device, 5, steps)
    _emit({"rank": taco.rank(), "size": taco.size(), "params": params, "ms": ms, "syncs": syncs})
    gpu_check._close()


def worker_allreduce(steps: int, device_kind: str) -> None:
    import torch

    import taco_notebook.comm as taco
    from taco_notebook.comm.collectives import algorithms
    from taco_notebook.comm.group import bootstrap

    taco.init()
    r, n = taco.rank(), taco.size()
    device = taco.device() if device_kind == "cuda" else torch.device("cpu")
    numel = 25_000_000 if device.type == "cuda" else 250_000
    t = torch.full((numel,), float(r + 1), device=device)
    times: dict[str, list[float]] = {"gpu memory": [], "gloo": []}
    exact = True
    for round_ in range(max(3, steps // 5)):
        for path in times:
            taco.configure(shm=path == "gpu memory")
            t.fill_(float(r + 1))
            taco.barrier()
            began = time.perf_counter()
            taco.allreduce(t)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = (time.perf_counter() - began) * 1000
            if round_:  # the first of each sets up (slots, gloo's buffers)
                times[path].append(elapsed)
            exact &= bool(torch.equal(t[:1000].cpu(), torch.full((1000,), float(n * (n + 1) // 2))))
    taco.configure(reset=True)
    segment = algorithms._node_gpu.get(bootstrap.state.generation)
    _emit({"rank": r, "size": n, "mb": numel * 4 / 1e6, "exact": exact,
           "ms": {path: statistics.median(v) for path, v in times.items()},
           "through_gpu": 0 if segment is None else segment.calls, "refused": getattr(segment, "refused", None)})
    gpu_check._close()


# ---- driver side --------------------------------------------------------------------------------------------
def launch(n: int, worker: str, args: argparse.Namespace) -> tuple[dict[str, Any] | None, str]:
    """Rank 0's result of ``worker`` on ``n`` ranks sharing the GPU, or None and why there is none."""
    done = gpu_check.launch(n, ["--worker", worker, "--steps", str(args.steps), "--device", args.device],
                            {"TACO_GPUS": "auto"}, timeout=900, script=__file__)
    got = sorted(_results(done.stdout), key=lambda found: found["rank"])
    if done.returncode != 0 or len(got) != n:
        return None, last_line(done.stderr, "no output")
    return got[0], ""


def report(steps: dict[int, dict[str, Any]], reduces: dict[int, dict[str, Any]], device: str) -> tuple[str, bool]:
    parts, goals = [], {}
    for n, got in steps.items():
        ms, syncs = got["ms"], got["syncs"]
        rows = [(v, f"{t:.2f}", _syncs(syncs[v])) for v, t in ms.items()]
        label = "1 rank, the reduction forced" if n == 1 else f"{n} ranks sharing the GPU"
        parts.append(f"### Training step, {label}, {got['params'] / 1e6:.1f}M parameters\n\n"
                     + table(("variant", "ms/step", "host syncs/step"), rows))
        ddp, ddp_fp16 = ms["DDP"], ms["DDP + torch fp16 hook"]
        goals[f"{n} rank(s): taco <= DDP ({ddp:.2f} ms)"] = ms["taco"] <= ddp * 1.05
        goals[f"{n} rank(s): taco fp16 <= DDP + torch fp16 ({ddp_fp16:.2f} ms)"] = ms["taco fp16"] <= ddp_fp16 * 1.05
        goals[f"{n} rank(s): taco topk:0.01 <= 1.2 x DDP ({1.2 * ddp:.2f} ms)"] = ms["taco topk:0.01"] <= 1.26 * ddp
        goals[f"{n} rank(s): 0 host syncs on every taco path"] = all(
            syncs[v] in (0, None) for v in ms if v.startswith("taco"))
    if 1 in steps and 4 in steps:
        one, four = steps[1]["ms"]["plain SGD"], steps[4]["ms"]["taco"]
        goals[f"taco at 4 ranks ({four:.2f} ms) within 1.3 x of 1 rank's plain step ({one:.2f} ms)"] = \
            four <= 1.3 * one
    reduce_rows: list[tuple[Any, ...]] = []
    for n, got in reduces.items():
        gpu, gloo = got["ms"]["gpu memory"], got["ms"]["gloo"]
        reduce_rows.append((n, f"{got['mb']:.0f}", f"{gpu:.2f}", f"{gloo:.2f}", f"{gloo / gpu:.1f}x",
                     "yes" if got["exact"] else "NO", got["refused"] or "-"))
        goals[f"{n} ranks: the sum exact, through the GPU's memory"] = got["exact"] and got["through_gpu"] > 0
        if n == 4:
            goals["4 ranks, 100 MB: >= 5x faster than gloo"] = gloo >= 5 * gpu
    if reduce_rows:
        parts.append("### One allreduce, ranks sharing the GPU: its memory (CUDA IPC) against gloo\n\n" + table(
            ("ranks", "MB", "GPU memory ms", "gloo ms", "speed-up", "exact", "IPC refused"), reduce_rows))
    parts.append("\n".join(f"- {goal} (5% noise): {'met' if met else 'NOT met'}" for goal, met in goals.items()))
    return "\n\n".join(parts), device == "cpu" or all(goals.values())


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        {"step": worker_step, "allreduce": worker_allreduce}[args.worker](args.steps, args.device)
        return 0
    import torch

    if args.device == "cuda" and torch.cuda.device_count() != 1:
        print(f"skipped: needs exactly one CUDA GPU, this machine has {torch.cuda.device_count()} "
              f"(torch {torch.__version__})")
        return 0
    steps: dict[int, dict[str, Any]] = {}
    reduces: dict[int, dict[str, Any]] = {}
    failed: list[str] = []
    for n in args.ranks:
        for worker, into in (("step", steps), ("allreduce", reduces)):
            if worker == "allreduce" and n == 1:
                continue
            got, why = launch(n, worker, args)
            if got is None:
                failed.append(f"{worker} on {n} rank(s) FAILED: {why}")
            else:
                into[n] = got
            print(f"{worker} on {n} rank(s): {'done' if got else 'FAILED'}", file=sys.stderr, flush=True)
    text, ok = report(steps, reduces, args.device)
    print("\n\n".join([text, *failed]))
    if args.json:
        print(f"wrote {write(args.json, {'steps': steps, 'allreduce': reduces, 'failed': failed})}")
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
