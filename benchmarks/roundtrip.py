"""Overheads of the notebook layer: cluster start time, and a trivial cell's warm round trip.

Compares ``%%taco_run`` with ipyparallel's own ``%%px`` on the same running 4-engine cluster, in one real
IPython shell, so the difference is what taco adds (per-rank labelling, liveness checks, result capture).

    .venv/bin/python benchmarks/roundtrip.py --ranks 4 --starts 3 --cells 100
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time

from IPython.testing.globalipapp import start_ipython


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    return f"{statistics.median(ordered) * 1e3:8.1f} ms median, {p90 * 1e3:8.1f} ms p90"


def time_cells(ip, magic: str, line: str, cell: str, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        began = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ip.run_cell_magic(magic, line, cell)
        samples.append(time.perf_counter() - began)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--starts", type=int, default=3, help="cluster starts to time")
    parser.add_argument("--cells", type=int, default=100, help="warm cells to time per magic")
    args = parser.parse_args()

    from taco_notebook.cluster.session import clusters

    ip = start_ipython()
    ip.run_line_magic("load_ext", "taco_notebook")
    starts = []
    for _ in range(args.starts):
        began = time.perf_counter()
        ip.run_line_magic("taco_cluster", f"restart -n {args.ranks} --cluster bench")
        starts.append(time.perf_counter() - began)
    cluster = clusters["bench"]
    view = cluster.client[:]
    view.block = True  # %%px waits for the cell, as %%taco_run does
    view.activate()  # registers %%px on the very same engines

    rows = []
    for label, magic, line, cell in [
        ("%%px (ipyparallel)", "px", "", "pass"),
        ("%%taco_run", "taco_run", "--cluster bench", "pass"),
        ("%%px, print on every rank", "px", "", "print(1)"),
        ("%%taco_run, print on every rank", "taco_run", "--cluster bench", "print(1)"),
        ("%%taco_run, rank 0's value back", "taco_run", "--cluster bench", "taco.rank()"),
    ]:
        time_cells(ip, magic, line, cell, 5)  # warm-up
        rows.append((label, percentiles(time_cells(ip, magic, line, cell, args.cells))))
    ip.run_line_magic("taco_cluster", "stop --cluster bench")

    print(f"cluster start, {args.ranks} ranks ({args.starts} starts): {percentiles(starts)}, "
          f"min {min(starts):.2f} s")
    print(f"| warm round trip, {args.ranks} engines, {args.cells} cells | time |")
    print("|---|---|")
    for label, figure in rows:
        print(f"| {label} | {figure} |")


if __name__ == "__main__":
    main()
