"""What the stall watchdog costs per collective: numbering and publishing it on the group's progress board.

Two measures, on every rank of a real group (rank 0 prints the slowest rank's):

- the watchdog's own work per collective (``stall.tracked`` around a no-op, what every collective runs on the
  communication thread before and after its real work), with the watchdog on and off;
- end to end, taco allreduces of one float (the case where a fixed cost shows most), in blocks with the
  watchdog on and off, median of the blocks.

    mpiexec -n 4 python benchmarks/stall_overhead.py                          # one host: the mapped board
    TACO_MASTER_ADDR=127.0.0.1 mpiexec -n 4 python benchmarks/stall_overhead.py   # the TCPStore board
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import taco_notebook.comm as taco
from taco_notebook.comm.diagnostics.stall import tracked
from taco_notebook.comm.state import state


def wrapper_cost(calls: int, repeats: int = 20) -> float:
    """Seconds per call of the watchdog's wrapper around a no-op, on this thread: the best of ``repeats`` runs
    (the code's own cost; on a shared machine the others add other processes' time slices)."""
    job = tracked("allreduce", ("ddp-bucket", 3), lambda: None)
    job()
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(calls // repeats):
            job()
        best = min(best, (time.perf_counter() - began) / (calls // repeats))
    return best


def allreduce_cost(blocks: int, per_block: int) -> tuple[float, float]:
    """Median seconds per one-float allreduce with the watchdog off and on (blocks in off-on-on-off order, so a
    drift of the machine's load weighs on both alike)."""
    tensor = torch.zeros(1)
    times: dict[float, list[float]] = {0.0: [], 300.0: []}
    for block in range(2 * blocks):
        timeout = 0.0 if block % 4 in (0, 3) else 300.0
        taco.configure(stall_timeout=timeout)
        taco.barrier()
        began = time.perf_counter()
        for _ in range(per_block):
            taco.allreduce(tensor)
        times[timeout].append((time.perf_counter() - began) / per_block)
    taco.configure(reset=True)
    return statistics.median(times[0.0]), statistics.median(times[300.0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000, help="wrapper calls timed")
    parser.add_argument("--blocks", type=int, default=10, help="allreduce blocks per setting (even)")
    parser.add_argument("--per-block", type=int, default=500, help="allreduces per block")
    args = parser.parse_args()
    taco.init()
    taco.configure(stall_timeout=0)
    off = wrapper_cost(args.calls)
    taco.configure(stall_timeout=300)
    on = wrapper_cost(args.calls)
    taco.configure(reset=True)
    reduce_off, reduce_on = allreduce_cost(args.blocks, args.per_block)
    slowest = state.mpi.gather((off, on, reduce_off, reduce_on), root=0)
    if taco.rank() == 0:
        off, on, reduce_off, reduce_on = (max(values) for values in zip(*slowest, strict=True))
        board = type(state.board).__name__
        print(f"{taco.size()} ranks, {board}: wrapper {off * 1e6:.2f} µs off, {on * 1e6:.2f} µs on "
              f"(+{(on - off) * 1e6:.2f} µs per collective); one-float allreduce {reduce_off * 1e6:.1f} µs off, "
              f"{reduce_on * 1e6:.1f} µs on ({(reduce_on - reduce_off) * 1e6:+.1f} µs)")


if __name__ == "__main__":
    main()
