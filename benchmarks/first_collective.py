"""A warm cell's first collective: an empty cell against one that runs a 1 MB allreduce, ``%%taco_run`` beside
ipyparallel's ``%%px`` with mpi4py, at N ranks (default 4) in one IPython shell.

Two clusters, both warm: a TacoCluster driven through the magics (``%taco_cluster restart``, ``%%taco_run
--no-dashboard``) and an ``ipyparallel.Cluster(engines="mpi")`` with mpi4py on its engines, driven through
``%%px``. The cells alternate, one of each variant per round, so a burst of load weighs on all alike:

- taco: ``pass``; ``taco.allreduce(torch.ones(262144))`` (1 MB, the tensor is the cell's value: rank 0's comes
  back, as the magic returns it); the same with no value (``_ = …``); ``torch.distributed.all_reduce`` of the
  same tensor on the ranks' process group;
- ipyparallel + mpi4py: ``pass``; ``MPI.COMM_WORLD.Allreduce`` of 262,144 float32 in place.

Prints median and p90 of each and what each allreduce cell costs over the empty cell of its own cluster;
``--json`` writes every sample. Why it exists: a cell's first taco collective looked far dearer than the same
cell's through torch.distributed or mpi4py (it was the cell's value, sent back by every rank: README.md).

    .venv/bin/python -m benchmarks first_collective --ranks 4 --cells 30
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import result_files

__all__ = ["TACO_CELLS", "MPI_CELLS", "main"]

ELEMENTS = 262144  # float32: 1 MB
TACO_CELLS = {
    "taco: empty": "pass",
    "taco: taco.allreduce, its value shown": f"taco.allreduce(torch.ones({ELEMENTS}))",
    "taco: taco.allreduce, no value": f"_ = taco.allreduce(torch.ones({ELEMENTS}))",
    "taco: torch.distributed.all_reduce": f"torch.distributed.all_reduce(torch.ones({ELEMENTS}))",
}
MPI_SETUP = "from mpi4py import MPI\nimport numpy"
MPI_CELLS = {
    "ipyparallel: empty": "pass",
    "ipyparallel: mpi4py Allreduce": (f"_a = numpy.ones({ELEMENTS}, dtype=numpy.float32)\n"
                                      "MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, _a)"),
}
CLUSTER = "first-collective"


def start_mpi_engines(ranks: int) -> Any:
    """An ipyparallel cluster of ``ranks`` MPI engines (mpiexec beside this Python), mpi4py imported on each."""
    import ipyparallel

    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    cluster = ipyparallel.Cluster(engines="mpi", n=ranks)
    client = cluster.start_and_connect_sync(activate=False)
    client.wait_for_engines(ranks, timeout=300)
    view = client[:]
    view.block = True  # %%px waits for the cell, as %%taco_run does
    view.execute(MPI_SETUP)
    sizes = view.apply_sync(lambda: __import__("mpi4py.MPI").MPI.COMM_WORLD.Get_size())
    if set(sizes) != {ranks}:
        cluster.stop_cluster_sync()
        raise RuntimeError(f"the MPI engines see worlds of {sizes}, not {ranks}: mpi4py loads another MPI")
    view.activate(suffix="_mpi")  # %%px_mpi
    return cluster


def timed(run: Callable[[], Any]) -> float:
    began = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        run()
    return time.perf_counter() - began


def cell(ip: Any, magic: str, line: str, code: str) -> Callable[[], Any]:
    def run() -> Any:
        return ip.run_cell_magic(magic, line, code)

    return run


def variants(ip: Any) -> dict[str, Callable[[], Any]]:
    line = f"--cluster {CLUSTER} --no-dashboard --quiet"
    chosen = {name: cell(ip, "taco_run", line, code) for name, code in TACO_CELLS.items()}
    chosen.update({name: cell(ip, "px_mpi", "", code) for name, code in MPI_CELLS.items()})
    return chosen


def check(ip: Any, ranks: int) -> None:
    """The allreduce cell sums: rank 0's value is ``ranks`` everywhere."""
    code = TACO_CELLS["taco: taco.allreduce, its value shown"]
    value = ip.run_cell_magic("taco_run", f"--cluster {CLUSTER} --no-dashboard --quiet", code)
    if float(value.min()) != ranks or float(value.max()) != ranks:
        raise RuntimeError(f"taco.allreduce gave {value[:4]}…, not {ranks}")


def summary(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    rows = {}
    for name, seconds in samples.items():
        ordered = sorted(seconds)
        rows[name] = {"median_ms": statistics.median(ordered) * 1e3,
                      "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3}
    for name, row in rows.items():
        empty = rows[f"{name.split(':')[0]}: empty"]["median_ms"]
        row["over_empty_ms"] = row["median_ms"] - empty
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--cells", type=int, default=30, help="rounds of timed cells (one of each variant a round)")
    parser.add_argument("--warmup", type=int, default=3, help="rounds before the timed ones")
    result_files.add_json_option(parser, "first_collective")
    args = parser.parse_args()
    if args.ranks < 2 or args.cells < 1:
        parser.error("needs at least 2 ranks and 1 cell")

    from IPython.testing.globalipapp import start_ipython

    registry = tempfile.mkdtemp(prefix="taco-fc-registry-")
    os.environ["TACO_REGISTRY_DIR"] = registry  # this run's clusters stay out of the user's sidebar
    ip = start_ipython()
    ip.run_line_magic("load_ext", "taco_notebook")
    mpi = None
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            ip.run_line_magic("taco_cluster", f"restart -n {args.ranks} --cluster {CLUSTER}")
        mpi = start_mpi_engines(args.ranks)
        check(ip, args.ranks)
        cells = variants(ip)
        samples: dict[str, list[float]] = {name: [] for name in cells}
        for round_ in range(args.warmup + args.cells):
            for name, run in cells.items():
                seconds = timed(run)
                if round_ >= args.warmup:
                    samples[name].append(seconds)
    finally:
        with contextlib.redirect_stdout(io.StringIO()):
            ip.run_line_magic("taco_cluster", f"stop --cluster {CLUSTER}")
        if mpi is not None:
            mpi.stop_cluster_sync()
    rows = summary(samples)
    load = os.getloadavg()[0]
    print(f"| {args.ranks} ranks, {args.cells} rounds, load {load:.1f} | median ms | p90 ms | over its empty cell |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['median_ms']:.1f} | {row['p90_ms']:.1f} | {row['over_empty_ms']:+.1f} |")
    if args.json:
        path = result_files.write(args.json, {"ranks": args.ranks, "cells": args.cells, "load": load, "rows": rows,
                                              "samples_ms": {k: [s * 1e3 for s in v] for k, v in samples.items()}})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
