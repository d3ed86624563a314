"""``python -m benchmarks NAME [ARGS…]``, from the repository root: run one benchmark as its script would run.

``python -m benchmarks`` (or ``list``, ``--help``) lists them. The script runs as ``__main__`` with its own
arguments and benchmarks/ on ``sys.path``, so what works as ``python benchmarks/NAME.py ARGS…`` works here
unchanged (its ``--help`` too, and its ``import emulated_run``)::

    python -m benchmarks allreduce_bench --no-emulate --sizes-mib 1
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

__all__ = ["BENCHMARKS", "main"]

HERE = Path(__file__).resolve().parent

# name (benchmarks/NAME.py) -> what it measures, in a line
BENCHMARKS: dict[str, str] = {
    "allreduce_bench": "allreduce on 2 emulated nodes: gloo, mpi4py and taco (2d, fp16, bf16, topk) against the bounds",
    "train_bench": "training throughput and loss of a 25M-parameter MLP: DDP variants against taco's",
    "powersgd_step": "PowerSGD against fp16: one 16 MiB allreduce and one optimizer step",
    "node_allreduce": "allreduce on one host: gloo's ring against taco's shared-memory node algorithm",
    "advisor": "the compression advisor (taco.tune) on 2 emulated nodes, at 1 Gbit/s and on unshaped links",
    "control_plane": "a TacoCluster of N ranks: start time, warm cell round trips, CPU and memory per rank",
    "cell_protocol": "a cell's control-plane cost per rank, old protocol against new, up to 1,000 plain engines",
    "roundtrip": "cluster start and a trivial cell's round trip, %%taco_run against ipyparallel's %%px",
    "first_collective": "a warm cell with one 1 MB allreduce against an empty one, %%taco_run beside %%px + mpi4py",
    "dashboard_cost": "what the live dashboard costs a training step, on the ranks and end to end",
    "stall_overhead": "the stall watchdog's cost per collective (run under mpiexec)",
    "agreement": "the ranks' agreement check per collective (run under mpiexec)",
    "revisions": "allreduce speed of a git revision against the work tree, alternating on one emulated cluster",
    "replica_check": "the replica check after a cell of the 25M-parameter MLP (run under mpiexec)",
    "undo_snapshot": "%taco_cluster undo's snapshot before a cell: the 25M-parameter MLP with Adam, copy and check",
    "autopsy_ranks": "reading every rank's stack in a hang, locally or over ssh",
    "peek_latency": "%taco_peek into a training cell on N ranks: latency, and the loop's steps/s with and without",
    "ddp_hook_describe": "the DDP hook's per-call bucket check",
    "topk_select": "TopK's selection: the sampled threshold against torch.topk, per device",
    "horovod_vs_ddp": "loss per epoch of the Horovod MNIST program on taco against plain DDP",
    "gpu_shared": "ranks sharing one GPU: a training step against DDP's, the allreduce in GPU memory against gloo",
    "gpu_check": "GPU checks: exact collectives, replicas, placement, notebooks, step overhead (skips without CUDA)",
    "perf_model": "docs/performance-model.md's tables, on paper, from measured inputs",
}


def listing() -> str:
    width = max(map(len, BENCHMARKS))
    rows = [f"  {name:<{width}}  {what}" for name, what in BENCHMARKS.items()]
    return "\n".join(["usage: python -m benchmarks NAME [ARGS…]   (NAME --help for its options)", "", *rows])


def run(name: str, args: list[str]) -> None:
    """Run benchmarks/NAME.py as ``__main__`` with ``args``; its SystemExit (its exit status) propagates."""
    script = HERE / f"{name}.py"
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(HERE))
    runpy.run_path(str(script), run_name="__main__")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("list", "-h", "--help"):
        print(listing())
        return 0
    name = argv[0].removesuffix(".py")
    if name not in BENCHMARKS:
        print(f"python -m benchmarks: no benchmark named {argv[0]!r}; known: {', '.join(BENCHMARKS)}",
              file=sys.stderr)
        return 2
    run(name, argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
