"""Allreduce on 2 emulated nodes x 2 ranks with 1 Gbit/s links: gloo, mpi4py (MPICH) and taco, against the bounds.

One launch = one ``EmulatedNodes`` + one ``mpiexec``; every variant of the table is measured in that run::

    .venv/bin/python benchmarks/allreduce_bench.py                     # root: emulated nodes, 1 Gbit/s links
    .venv/bin/python benchmarks/allreduce_bench.py --no-emulate --sizes-mib 1 16   # localhost quick check

Per variant and size (float32, sum, in place; variants interleaved iteration by iteration): median over ``--iters``
timed iterations (after ``--warmup``) of
the per-iteration time of the slowest rank, each iteration started after a barrier; algbw = S/t and
busbw = algbw * 2(n-1)/n (nccl-tests definitions, GB = 1e9 B, n = world size); the bytes that crossed a node's
link per operation, measured from the interface counters of each emulated node (max over nodes and directions,
as a multiple of S; TCP/IP headers and ACKs included); the speed-up over gloo; and the largest error against an
exact fp32 sum relative to the largest exact value. Bounds: ring 2(n-1)/n * S/B, 2D 2(m-1)/m * S/B with m nodes,
B = link rate in bytes/s.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from typing import Any

import emulated_run as er

TACO_VARIANTS = [  # (label, compression, algorithm)
    ("taco flat", None, "flat"),
    ("taco 2d", None, "2d"),
    ("taco 2d+fp16", "fp16", "2d"),
    ("taco 2d+bf16", "bf16", "2d"),
    ("taco 2d+topk:0.01", "topk:0.01", "2d"),
]
TACO_MISSING = "taco API not available yet (taco_notebook.comm.allreduce has no `algorithm` parameter)"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 100], help="payload sizes (MiB)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per variant and size")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations before them")
    parser.add_argument("--chunk-mb", nargs="+", default=["auto"],
                        help="2D pipeline chunk sizes to measure, each a variant of every taco 2d row (MiB, 'auto' "
                        "= chosen from measured speeds, 0 = no pipelining); labels get ' [chunk X]' unless only auto")
    parser.add_argument("--variants", nargs="+", default=None,
                        help="only these variants (labels as in the table, e.g. gloo mpi4py 'taco 2d')")
    er.add_launch_args(parser, timeout_s=900)
    return parser.parse_args(argv)


# ---- rank side ---------------------------------------------------------------------------------------------
def chunked(taco: Any, chunk: str) -> bool:
    """Set the 2D pipeline's chunk size for the next call (when this taco has the setting); always True."""
    try:
        taco.configure(chunk_mb=chunk)
    except TypeError:  # a taco from before the pipeline
        pass
    return True


def calibration(sizes_mib: list[float]) -> dict[str, Any] | None:
    """The speeds the 2D pipeline measured and the chunk size they give each size (None before the pipeline)."""
    from taco_notebook.comm.state import state

    found = getattr(state.hierarchy.get(state.generation), "calibration", None)  # built already: no collective
    if found is None:
        return None
    chunks = {f"{s:g} MiB": found.chunk_bytes(int(s * (1 << 20))) for s in sizes_mib}
    return {**found.as_dict(), "auto_chunk_bytes": chunks}


def measure(op: Any, buf: Any, src: Any, comm: Any, row: dict[str, Any], timed: bool, counts_links: bool) -> None:
    """One iteration of one variant: fresh input, barrier, the op timed; link bytes counted around it."""
    phases = pipeline_phases()
    buf.copy_(src)
    comm.Barrier()
    before = er.link_counters() if counts_links and timed else None
    if phases is not None:
        phases.clear()
    began = time.perf_counter()
    op(buf)
    elapsed = time.perf_counter() - began
    if timed:
        row["times"].append(elapsed)
        for phase, seconds in (phases or {}).items():  # this rank's time in each phase of the 2D pipeline
            row.setdefault("phases_s", {}).setdefault(phase, []).append(round(seconds, 5))
    if timed:
        comm.Barrier()  # every rank's share of this op has crossed the link (on every rank: same barriers)
    if before is not None:
        after = er.link_counters()
        if after is not None:
            row["link"] = [row["link"][0] + after[0] - before[0], row["link"][1] + after[1] - before[1]]


def pipeline_phases() -> dict[str, float] | None:
    """The 2D pipeline's per-phase seconds (a taco from before the pipeline has none)."""
    try:
        from taco_notebook.comm.transport.pipeline import phase_seconds
    except ImportError:
        return None
    return phase_seconds


def finish(row: dict[str, Any], comm: Any, rank: int, iters: int) -> None:
    """Slowest rank's time per iteration, its median, the link bytes per op of every node (collective)."""
    import numpy as np
    from mpi4py import MPI

    times, link = row.pop("times"), row.pop("link")
    err = row.pop("err")
    if "error" in row or len(times) != iters:
        row.setdefault("error", "not every iteration ran")
        return
    slowest = np.array(times)
    comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
    nodes_link = comm.gather([link[0] / iters, link[1] / iters] if any(link) else None, root=0)
    row.update(times_s=slowest.tolist(), median_s=float(np.median(slowest)), max_rel_err=err)
    if rank == 0:
        measured = [x for x in nodes_link or [] if x is not None]
        row["link_bytes_per_op_tx_rx_per_node"] = measured or None
        if measured:
            row["link_bytes_per_op"] = max(max(x) for x in measured)


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import taco_notebook.comm as taco

    torch.set_num_threads(1)
    topo = taco.init()
    comm = MPI.COMM_WORLD
    rank, n = topo.rank, topo.size
    counts_links = topo.local_rank == 0 and er.link_counters() is not None

    variants: list[tuple[str, Any]] = [
        ("gloo", lambda buf: dist.all_reduce(buf)),
        ("mpi4py", lambda buf: comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM)),
    ]
    taco_ok = "algorithm" in inspect.signature(taco.allreduce).parameters
    if taco_ok:
        sweep = args.chunk_mb != ["auto"]
        for label, compression, algorithm in TACO_VARIANTS:
            for chunk in args.chunk_mb if algorithm == "2d" else ["auto"]:
                variants.append((f"{label} [chunk {chunk}]" if sweep and algorithm == "2d" else label,
                                 lambda buf, c=compression, a=algorithm, k=chunk: chunked(taco, k) and
                                 taco.allreduce(buf, op="sum", compression=c, algorithm=a)))
    if args.variants:
        variants = [v for v in variants if v[0] in args.variants or v[0].split(" [")[0] in args.variants]

    result: dict[str, Any] = {"world_size": n, "nodes": topo.num_nodes, "node_ranks": topo.node_ranks,
                              "taco_available": taco_ok, "taco_note": None if taco_ok else TACO_MISSING,
                              "rows": []}
    for size_mib in args.sizes_mib:
        numel = int(size_mib * (1 << 20)) // 4
        src = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))
        exact = src.to(torch.float64)
        dist.all_reduce(exact)  # reference sum in fp64
        scale = exact.abs().max().item()
        buf = torch.empty_like(src)
        rows = {label: {"size_mib": size_mib, "bytes": numel * 4, "variant": label, "times": [], "link": [0, 0],
                        "err": 0.0} for label, _ in variants}
        # Interleaved: iteration i of every variant runs before iteration i+1 of any, so a burst of load from
        # other jobs on the machine spreads over the variants instead of landing on one.
        for i in range(args.warmup + args.iters):
            for label, op in variants:
                row = rows[label]
                if "error" in row:
                    continue
                try:
                    measure(op, buf, src, comm, row, timed=i >= args.warmup, counts_links=counts_links)
                    if i == args.warmup + args.iters - 1:
                        err = np.array([(buf.to(torch.float64) - exact).abs().max().item() / scale])
                        comm.Allreduce(MPI.IN_PLACE, err, op=MPI.MAX)
                        row["err"] = float(err[0])
                except Exception as exc:  # noqa: BLE001 (a variant that raises on every rank is reported)
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    print(f"[rank {rank}] {label} {size_mib:g} MiB failed: {row['error']}", file=sys.stderr,
                          flush=True)
        for label, _ in variants:
            finish(rows[label], comm, rank, args.iters)
            if rank == 0:
                result["rows"].append(rows[label])
                if "median_s" in rows[label]:
                    print(f"{size_mib:g} MiB {label}: {rows[label]['median_s'] * 1e3:.1f} ms", flush=True)
        if rank == 0:
            er.write_result(args.worker, result)  # after every size: a later hang keeps these
        del src, exact, buf
    if rank == 0:
        result["calibration"] = calibration(args.sizes_mib) if taco_ok else None
        result["complete"] = True
        er.write_result(args.worker, result)
    er.shutdown_process_group(taco)


# ---- driver ------------------------------------------------------------------------------------------------
def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if seconds < 10 else f"{seconds * 1e3:.0f}"


def build_rows(result: dict[str, Any], meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Measured rows plus the bound rows and derived columns, grouped by size."""
    n = meta["world_size"]
    m = meta["nodes"]
    rate = meta.get("rate_bits_per_s")
    rows: list[dict[str, Any]] = []
    sizes = list(dict.fromkeys(r["size_mib"] for r in result.get("rows", [])))
    for size in sizes:
        measured = [dict(r) for r in result["rows"] if r["size_mib"] == size]
        nbytes = measured[0]["bytes"]
        gloo = next((r.get("median_s") for r in measured if r["variant"] == "gloo"), None)
        if not result.get("taco_available"):
            measured.append({"size_mib": size, "bytes": nbytes, "variant": "taco (flat, 2d, 2d+fp16, 2d+bf16, "
                             "2d+topk:0.01)", "note": result.get("taco_note") or TACO_MISSING})
        if rate:
            B = rate / 8
            measured.append({"size_mib": size, "bytes": nbytes, "variant": "bound: ring", "bound": True,
                             "median_s": 2 * (n - 1) / n * nbytes / B, "link_bytes_per_op": 2 * (n - 1) / n * nbytes})
            measured.append({"size_mib": size, "bytes": nbytes, "variant": "bound: 2d", "bound": True,
                             "median_s": 2 * (m - 1) / m * nbytes / B, "link_bytes_per_op": 2 * (m - 1) / m * nbytes})
        for r in measured:
            t = r.get("median_s")
            if t:
                r["algbw_GBps"] = nbytes / t / 1e9
                r["busbw_GBps"] = r["algbw_GBps"] * 2 * (n - 1) / n
                if gloo:
                    r["speedup_vs_gloo"] = gloo / t
            rows.append(r)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    header = ["size", "variant", "median ms", "algbw GB/s", "busbw GB/s", "node link bytes/op",
              "vs gloo (speed-up)", "max rel err", "note"]
    out = []
    for r in rows:
        t = r.get("median_s")
        link = r.get("link_bytes_per_op")
        out.append([
            f"{r['size_mib']:g} MiB", r["variant"],
            fmt_ms(t) if t else "",
            f"{r['algbw_GBps']:.3f}" if t else "",
            f"{r['busbw_GBps']:.3f}" if t else "",
            f"{link / r['bytes']:.2f}×S" if link else ("n/a" if t and not r.get("bound") else ""),
            f"{r['speedup_vs_gloo']:.2f}×" if "speedup_vs_gloo" in r else "",
            f"{r['max_rel_err']:.1e}" if "max_rel_err" in r else "",
            r.get("error") or r.get("note") or ("lower bound" if r.get("bound") else ""),
        ])
    return er.markdown_table(header, out)


def report(args: argparse.Namespace, result: dict[str, Any], meta: dict[str, Any]) -> tuple[str, Any, str]:
    rows = build_rows(result, meta)
    caption = (f"Allreduce, float32 sum, {meta['world_size']} ranks ({er.describe_setup(args)}); "
               f"median of {args.iters}")
    return caption, rows, table(rows)


if __name__ == "__main__":
    sys.exit(er.main(__file__, sys.argv[1:], parse_args, worker, report))
