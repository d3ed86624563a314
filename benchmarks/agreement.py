"""What the ranks' agreement check costs per collective in the steady state (comm/collectives/agreement.py).

Every collective first gathers a 16-byte (hash, count) from each rank; the hash of a signature is cached, so in
the steady state the cost is that one tiny allgather. Measured on every rank of a real group, rank 0 prints the
slowest rank's figure:

- per-call µs of a small allreduce (``--numel`` floats, default 1 and 1024) with the check on and off, in
  blocks in on-off-off-on order (a drift of the machine's load weighs on both alike), median of the blocks;
- the check's own exchange alone (``agree`` on the communication thread), and the hash lookup in one process.

    mpiexec -n 2 python benchmarks/agreement.py
    mpiexec -n 4 python benchmarks/agreement.py --blocks 10 --per-block 300
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch

import taco_notebook.comm as taco
from taco_notebook.comm.collectives import agreement
from taco_notebook.comm.state import state


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (what the job waits for)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    agreement.set_enabled(True)
    taco.allreduce(value, op="max")
    return float(value.item())


def allreduce_cost(numel: int, blocks: int, per_block: int) -> tuple[float, float]:
    """Median seconds per allreduce of ``numel`` floats with the check on and off."""
    tensor = torch.zeros(numel)
    times: dict[bool, list[float]] = {True: [], False: []}
    for block in range(2 * blocks):
        on = block % 4 in (0, 3)
        agreement.set_enabled(True)
        taco.barrier()  # every rank switches at the same point (see agreement.set_enabled)
        agreement.set_enabled(on)
        began = time.perf_counter()
        for _ in range(per_block):
            taco.allreduce(tensor)
        times[on].append(slowest((time.perf_counter() - began) / per_block))
    agreement.set_enabled(True)
    return statistics.median(times[True]), statistics.median(times[False])


def exchange_cost(calls: int) -> float:
    """Seconds per agreement exchange alone, on the communication thread (median of 5 runs)."""
    sig = agreement.describe_tensor("allreduce", torch.zeros(4), "bench", op="sum")
    runs = []
    for _ in range(5):
        taco.barrier()

        def loop() -> None:
            for _ in range(calls):
                agreement.agree(sig)

        began = time.perf_counter()
        state.comm_thread.run(loop)
        runs.append(slowest((time.perf_counter() - began) / calls))
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, nargs="+", default=[1, 1024])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--per-block", type=int, default=200)
    args = parser.parse_args()
    taco.init()
    for numel in args.numel:  # warm up: groups, caches, the comm thread
        for _ in range(20):
            taco.allreduce(torch.zeros(numel))
    rows = [(numel, *allreduce_cost(numel, args.blocks, args.per_block)) for numel in args.numel]
    exchange = exchange_cost(args.per_block)
    sig = agreement.describe_tensor("allreduce", torch.zeros(4), "bench", op="sum")
    lookup = min(timeit.repeat(lambda: agreement._hash(sig), number=10000, repeat=5)) / 10000
    if taco.rank() == 0:
        print(
            f"{taco.size()} ranks, {args.blocks} blocks x {args.per_block} calls per setting, slowest rank, "
            "median of blocks"
        )
        print("| allreduce of | check on | check off | cost of the check |")
        print("|---|---|---|---|")
        for numel, on, off in rows:
            print(f"| {numel} float32 | {on * 1e6:.0f} µs | {off * 1e6:.0f} µs | {(on - off) * 1e6:+.0f} µs |")
        print(
            f"agreement exchange alone: {exchange * 1e6:.0f} µs per call; signature hash lookup: {lookup * 1e9:.0f} ns"
        )
    taco.shutdown()


if __name__ == "__main__":
    main()
