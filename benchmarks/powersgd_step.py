"""PowerSGD vs fp16: one 16 MiB gradient allreduce, and one DistributedOptimizer step with 16 MiB of gradients.

Same harness as ``allreduce_bench.py`` (2 emulated nodes x 2 ranks, 1 Gbit/s links as root; ``--no-emulate``
for localhost)::

    .venv/bin/python benchmarks/powersgd_step.py                  # root: emulated nodes
    .venv/bin/python benchmarks/powersgd_step.py --no-emulate     # localhost, no link limit

Per variant: median over ``--iters`` (after ``--warmup``, which also lets PowerSGD allocate its residual and
warm-start Q) of the slowest rank's time. ``allreduce``: ``taco.allreduce`` of a float32 buffer of
``--size-mib``. ``step``: forward, backward and ``DistributedOptimizer.step()`` of a bias-free
``Linear(k, k)`` holding ``--size-mib`` of parameters, batch 32 per rank (the gradient is rank <= 32*4, a
best case for PowerSGD's accuracy, not for its speed: the cost is the same for any gradient). The ``ddp``
rows run the same step under DistributedDataParallel: plain, with torch's PowerSGD hook (rank 4) and with
taco's hook (``powersgd:4``, flat).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import emulated_run as er

VARIANTS = [  # (label, compression, algorithm)
    ("flat", "none", "flat"), ("flat+fp16", "fp16", "flat"), ("flat+powersgd:4", "powersgd:4:warmup=0", "flat"),
    ("2d", "none", "2d"), ("2d+fp16", "fp16", "2d"), ("2d+powersgd:4", "powersgd:4:warmup=0", "2d"),
    ("2d+powersgd:1", "powersgd:1:warmup=0", "2d"),
]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=16, help="gradient size (MiB of float32)")
    parser.add_argument("--iters", type=int, default=7, help="timed iterations per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations before them")
    er.add_launch_args(parser, timeout_s=900)
    return parser.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from mpi4py import MPI

    import taco_notebook.comm as taco

    torch.set_num_threads(1)
    taco.init()
    comm, rank = MPI.COMM_WORLD, taco.rank()
    numel = int(args.size_mib * (1 << 20)) // 4
    side = math.isqrt(numel)
    src = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    x = torch.randn(32, side, generator=torch.Generator().manual_seed(100 + rank))
    result: dict[str, Any] = {"rows": []}

    def slowest(run: Any) -> float:
        times = []
        for i in range(args.warmup + args.iters):
            comm.Barrier()
            began = time.perf_counter()
            run()
            if i >= args.warmup:
                times.append(time.perf_counter() - began)
        worst = np.array(times)
        comm.Allreduce(MPI.IN_PLACE, worst, op=MPI.MAX)
        return float(np.median(worst))

    for label, spec, algorithm in VARIANTS:
        buf = src.clone()

        def reduce(buf: torch.Tensor = buf, spec: str = spec, algorithm: str = algorithm, label: str = label) -> None:
            buf.copy_(src)
            taco.allreduce(buf, op="avg", compression=spec, algorithm=algorithm, name=("bench", label))

        model = torch.nn.Linear(side, side, bias=False)
        opt = taco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), compression=spec,
                                        algorithm=algorithm, named_parameters=model.named_parameters())

        def step(model: torch.nn.Module = model, opt: Any = opt) -> None:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

        row = {"variant": label, "allreduce_s": slowest(reduce), "step_s": slowest(step)}
        opt.remove_hooks()
        if rank == 0:
            result["rows"].append(row)
            er.write_result(args.worker, result)
            print(f"{label}: allreduce {row['allreduce_s'] * 1e3:.1f} ms, step {row['step_s'] * 1e3:.1f} ms",
                  flush=True)
    for label, hook in (("ddp", None), ("ddp+torch powersgd:4", "torch"), ("ddp+taco powersgd:4", "taco")):
        row = {"variant": label, "allreduce_s": None, "step_s": slowest(ddp_step(side, x, hook))}
        if rank == 0:
            result["rows"].append(row)
            er.write_result(args.worker, result)
            print(f"{label}: step {row['step_s'] * 1e3:.1f} ms", flush=True)
    if rank == 0:
        result["complete"] = True
        er.write_result(args.worker, result)
    er.shutdown_process_group(taco)


def ddp_step(side: int, x: Any, hook: str | None) -> Any:
    """One DDP training step (one bucket: gloo fails torch's PowerSGD hook with several, ENVIRONMENT.md),
    plain, with torch's PowerSGD hook (rank 4, compressing from the 2nd step) or with taco's hook."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    import taco_notebook.comm as taco

    model = DistributedDataParallel(torch.nn.Linear(side, side, bias=False), bucket_cap_mb=64)
    if hook == "torch":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                            start_powerSGD_iter=2, min_compression_rate=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif hook == "taco":
        model.register_comm_hook(taco.hooks.TacoHookState(compression="powersgd:4:warmup=0", algorithm="flat"),
                                 taco.hooks.allreduce_hook)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        sgd.zero_grad()
        model(x).square().mean().backward()
        sgd.step()
    return step


def report(args: argparse.Namespace, result: dict[str, Any], meta: dict[str, Any]) -> tuple[str, Any, str]:
    rows = result.get("rows", [])
    fp16 = {r["variant"].split("+")[0]: r for r in rows if r["variant"].endswith("+fp16")}
    table = er.markdown_table(
        ["variant", "allreduce ms", "step ms", "step vs fp16 (same algorithm)"],
        [[r["variant"], f"{r['allreduce_s'] * 1e3:.1f}" if r["allreduce_s"] else "", f"{r['step_s'] * 1e3:.1f}",
          f"{fp16[r['variant'].split('+')[0]]['step_s'] / r['step_s']:.2f}×"
          if r["variant"].split("+")[0] in fp16 else ""] for r in rows])
    caption = (f"{args.size_mib:g} MiB of float32 gradients, {meta['world_size']} ranks ({er.describe_setup(args)}); "
               f"median of {args.iters}")
    return caption, rows, table


if __name__ == "__main__":
    sys.exit(er.main(__file__, sys.argv[1:], parse_args, worker, report))
