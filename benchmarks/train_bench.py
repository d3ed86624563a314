"""Training throughput of a 25M-parameter MLP on 2 emulated nodes x 2 ranks (1 Gbit/s): DDP variants vs taco.

One launch = one ``EmulatedNodes`` + one ``mpiexec``; every variant is measured in that run, one after another::

    .venv/bin/python benchmarks/train_bench.py                    # root: emulated nodes, 1 Gbit/s links
    .venv/bin/python benchmarks/train_bench.py --no-emulate --steps 5 --warmup 2   # localhost quick check

Model: Linear 2048→4096→4096→10 with ReLUs (25.2M float32 parameters, ~101 MB of gradients a step), SGD with
momentum, cross-entropy on a synthetic, learnable task (a mixture of 10 Gaussians in 2048 dimensions), batch
``--batch`` per rank; every variant starts from the same weights (seeded) and sees the same batches (seeded per
rank). One torch thread per rank (4 ranks share 2 cores).

samples/s = world · batch · steps / time, time measured on rank 0 between barriers around the timed steps (after
``--warmup`` untimed steps). Final loss = cross-entropy on a fixed evaluation batch after the last step, averaged
over ranks; "replicas equal" checks that every rank ended with the same weights (not expected for compute-only,
where each rank trains alone on its own data).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any

import emulated_run as er

DDP_VARIANTS = ["compute-only", "ddp", "ddp+fp16", "ddp+powersgd"]
TACO_VARIANTS = ["taco-2d", "taco-2d+fp16", "taco-2d+topk:0.01", "taco-2d+powersgd", "taco-flat+powersgd",
                 "ddp+taco-powersgd"]
TACO_MISSING = "taco API not available yet (no taco_notebook.comm.DistributedOptimizer)"
IN_FEATURES, HIDDEN, CLASSES = 2048, 4096, 10
CENTROID_SCALE = 0.1


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them (default 5)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step (default 32)")
    parser.add_argument("--hidden-layers", type=int, default=1,
                        help="extra 4096x4096 layers after the first (default 1: 25.2M parameters)")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--powersgd-rank", type=int, default=1, help="PowerSGD matrix approximation rank")
    parser.add_argument("--variants", nargs="+", default=None, help="only these variants (names as in the table)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every variant this many times, interleaved (round 1: all, round 2: all, ...); "
                        "the table shows the median samples/s")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="also evaluate the loss every N steps (untimed; 0: only at the end), for the table "
                        "of when each variant reaches DDP's loss")
    parser.add_argument("--catch-up-step", type=int, default=None,
                        help="the DDP step whose evaluated loss the variants must reach (default: DDP's last); "
                        "run more steps than this to see compressed variants catch up")
    parser.add_argument("--fusion-mb", nargs="+", type=float, default=None,
                        help="fusion thresholds to measure, each a variant of every taco DistributedOptimizer row")
    er.add_launch_args(parser, timeout_s=1200)
    return parser.parse_args(argv)


def taco_spec(variant: str, args: argparse.Namespace) -> tuple[str | None, str]:
    """(compression, algorithm) of a taco variant; PowerSGD starts compressing at step 2, as torch's hook does
    here (``start_powerSGD_iter=2``), at the same rank."""
    base = variant.split(" [")[0]
    algorithm = "flat" if "flat" in base or base.startswith("ddp") else "2d"
    kind = base.split("+", 1)[1] if "+" in base else None
    if kind is not None and "powersgd" in kind:
        kind = f"powersgd:{args.powersgd_rank}:warmup=2"
    return kind, algorithm


def variant_names(args: argparse.Namespace, taco_ok: bool) -> list[str]:
    names = DDP_VARIANTS + (TACO_VARIANTS if taco_ok else [])
    if args.variants:
        names = [v for v in names if v in args.variants]
    if args.fusion_mb:
        names = [f"{v} [fusion {mb:g}]" if v.startswith("taco") else v for v in names
                 for mb in (args.fusion_mb if v.startswith("taco") else [None])]
    return names


def build_model(hidden_layers: int) -> Any:
    import torch

    torch.manual_seed(0)  # the same initial weights on every rank and for every variant
    layers: list[Any] = [torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.ReLU()]
    for _ in range(hidden_layers):
        layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(HIDDEN, CLASSES))
    return torch.nn.Sequential(*layers)


def synthetic_batches(count: int, batch: int, seed: int) -> list[tuple[Any, Any]]:
    """A mixture of 10 Gaussians: x = mu[y] + N(0, 1), class means fixed (the same on every rank).

    Learnable but not trivially: with the defaults the loss falls from ln 10 = 2.30 to ~1.7 over 35 steps,
    where the quality of the averaged gradient still shows.
    """
    import torch

    means = CENTROID_SCALE * torch.randn(CLASSES, IN_FEATURES, generator=torch.Generator().manual_seed(12345))
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        y = torch.randint(0, CLASSES, (batch,), generator=gen)
        out.append((means[y] + torch.randn(batch, IN_FEATURES, generator=gen), y))
    return out


# ---- rank side ---------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import taco_notebook.comm as taco

    torch.set_num_threads(1)
    topo = taco.init()
    comm = MPI.COMM_WORLD
    rank, n = topo.rank, topo.size
    batches = synthetic_batches(args.warmup + args.steps, args.batch, seed=100 + rank)
    eval_x, eval_y = synthetic_batches(1, 1024, seed=999)[0]
    taco_ok = hasattr(taco, "DistributedOptimizer")
    names = variant_names(args, taco_ok)
    result: dict[str, Any] = {"world_size": n, "nodes": topo.num_nodes, "node_ranks": topo.node_ranks,
                              "parameters": sum(p.numel() for p in build_model(args.hidden_layers).parameters()),
                              "taco_available": taco_ok, "taco_note": None if taco_ok else TACO_MISSING,
                              "rows": []}

    def evaluate(model: Any) -> float:
        """Cross-entropy on the evaluation batch, each rank a quarter of it (the replicas are the same), between
        barriers: the caller keeps this time out of the timed steps."""
        with torch.no_grad():
            part = F.cross_entropy(model(eval_x[rank::n]), eval_y[rank::n]).item()
        return comm.allreduce(part) / n

    def make(variant: str) -> tuple[Any, Any, Any]:
        model = build_model(args.hidden_layers)
        sgd = lambda params: torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)  # noqa: E731
        if variant == "compute-only":
            return model, model, sgd(model.parameters())
        if variant == "ddp+taco-powersgd":  # taco's hook: DDP's own buckets, taco's PowerSGD per weight
            net = DDP(model)
            compression, algorithm = taco_spec(variant, args)
            net.register_comm_hook(taco.hooks.TacoHookState(compression=compression, algorithm=algorithm),
                                   taco.hooks.allreduce_hook)
            return model, net, sgd(net.parameters())
        if variant.startswith("ddp"):
            if variant == "ddp+powersgd":  # gloo: one bucket, and compress from step 2 (ENVIRONMENT.md)
                net = DDP(model, bucket_cap_mb=1024)
                state = powerSGD_hook.PowerSGDState(process_group=None,
                                                    matrix_approximation_rank=args.powersgd_rank,
                                                    start_powerSGD_iter=2)
                net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            else:
                net = DDP(model)
                if variant == "ddp+fp16":
                    net.register_comm_hook(None, default_hooks.fp16_compress_hook)  # type: ignore[arg-type]
            return model, net, sgd(net.parameters())
        compression, algorithm = taco_spec(variant, args)
        fusion = float(variant.split("[fusion ")[1].rstrip("]")) if "[fusion " in variant else None
        opt = taco.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),  # type: ignore[operator]
                                        compression=compression, algorithm=algorithm, fusion_mb=fusion)
        return model, model, opt

    for round_, variant in [(i, v) for i in range(args.rounds) for v in names]:
        row: dict[str, Any] = {"variant": variant, "round": round_}
        try:
            model, net, opt = make(variant)
            losses, curve, paused = [], [], 0.0
            for i, (x, y) in enumerate(batches):
                if i == args.warmup:
                    comm.Barrier()
                    began = time.perf_counter()
                opt.zero_grad()
                loss = F.cross_entropy(net(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                if args.eval_every and (i + 1) % args.eval_every == 0:
                    comm.Barrier()
                    stopped = time.perf_counter()
                    curve.append((i + 1, evaluate(model)))
                    comm.Barrier()
                    paused += time.perf_counter() - stopped if i >= args.warmup else 0.0
            comm.Barrier()
            seconds = time.perf_counter() - began - paused
            with torch.no_grad():
                eval_loss = F.cross_entropy(model(eval_x), eval_y).item()
                checksum = float(sum(p.double().sum().item() for p in model.parameters()))
            mean_loss = comm.allreduce(eval_loss) / n
            mean_train = comm.allreduce(losses[-1]) / n
            sums = comm.allgather(checksum)
            row.update(seconds=seconds, samples_per_s=n * args.batch * args.steps / seconds,
                       final_loss=mean_loss, last_train_loss=mean_train, first_train_loss=losses[0],
                       replicas_equal=max(sums) == min(sums), curve=curve)
            if hasattr(opt, "remove_hooks"):  # DistributedOptimizer: its gradient hooks hold it (and the model)
                opt.remove_hooks()
            del model, net, opt
            gc.collect()  # each variant's model, gradients and optimizer state (~450 MB a rank) must not pile up
        except Exception as exc:  # noqa: BLE001 (a variant that raises on every rank is reported, not fatal)
            row["error"] = f"{type(exc).__name__}: {exc}"
            print(f"[rank {rank}] {variant} failed: {row['error']}", file=sys.stderr, flush=True)
        if rank == 0:
            result["rows"].append(row)
            er.write_result(args.worker, result)  # after every variant: a later hang keeps these
            if "samples_per_s" in row:
                print(f"{variant}: {row['samples_per_s']:.1f} samples/s, loss {row['final_loss']:.4f} "
                      f"({row['seconds']:.1f} s)", flush=True)
        comm.Barrier()
    if rank == 0:
        result["complete"] = True
        er.write_result(args.worker, result)
    er.shutdown_process_group(taco)


# ---- driver ------------------------------------------------------------------------------------------------
def median_rows(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant: the median samples/s over rounds (the mean of the middle two for an even count),
    the other columns from its first round (the loss is the same in every round), all rounds' figures kept."""
    rows = []
    for name in dict.fromkeys(r["variant"] for r in raw):
        runs = [r for r in raw if r["variant"] == name]
        timed = [r for r in runs if "samples_per_s" in r]
        row = dict(timed[0] if timed else runs[0])
        if timed:
            row["samples_per_s"] = statistics.median(r["samples_per_s"] for r in timed)
        row["samples_per_s_all"] = [round(r.get("samples_per_s", 0.0), 1) for r in runs]
        rows.append(row)
    return rows


def build_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = median_rows(result.get("rows", []))
    by_name = {r["variant"]: r for r in rows}
    ddp, alone = by_name.get("ddp", {}), by_name.get("compute-only", {})
    for r in rows:
        if "samples_per_s" not in r:
            continue
        if ddp.get("samples_per_s"):
            r["vs_ddp"] = r["samples_per_s"] / ddp["samples_per_s"]
        if alone.get("samples_per_s"):
            r["vs_compute_only"] = r["samples_per_s"] / alone["samples_per_s"]
        if ddp.get("final_loss"):
            r["loss_diff_vs_ddp_pct"] = 100 * (r["final_loss"] - ddp["final_loss"]) / ddp["final_loss"]
    if not result.get("taco_available") and result.get("rows") is not None:
        rows.append({"variant": "taco-2d, taco-2d+fp16, taco-2d+topk:0.01",
                     "note": result.get("taco_note") or TACO_MISSING})
    return rows


REACHED = 1.01  # "reached DDP's loss": within 1% of it (fp16 rounding alone leaves ~0.03% above)


def catch_up(rows: list[dict[str, Any]], world: int, batch: int, at_step: int | None = None) -> list[dict[str, Any]]:
    """When each variant's evaluated loss reaches DDP's at step ``at_step`` (default: DDP's last evaluated step):
    the first step within 1% of it and the training time that takes at the variant's samples/s, and the step
    from which it stays within 5% of DDP's loss at the same step (None: not within the run)."""
    by_name = {r["variant"]: r for r in rows}
    ddp = dict(by_name.get("ddp", {}).get("curve") or [])
    if not ddp:
        return []
    at_step = max(ddp) if at_step is None else at_step
    if at_step not in ddp:
        raise ValueError(f"--catch-up-step {at_step} is not an evaluated step (every --eval-every, up to {max(ddp)})")
    target = ddp[at_step]
    out = []
    for r in rows:
        curve = r.get("curve") or []
        if not curve or "samples_per_s" not in r or r["variant"] == "compute-only":
            continue
        step_s = world * batch / r["samples_per_s"]
        reach = next((step for step, loss in curve if loss <= REACHED * target), None)
        close = [step for step, loss in curve if step in ddp and loss <= 1.05 * ddp[step]]
        within = next((s for s in close if all(t in close for t, _ in curve if t >= s and t in ddp)), None)
        out.append({"variant": r["variant"], "reach_step": reach, "reach_s": reach * step_s if reach else None,
                    "within5_from": within, "last_step": curve[-1][0]})
    ddp_s = next((c["reach_s"] for c in out if c["variant"] == "ddp"), None)
    for c in out:
        c["speedup"] = ddp_s / c["reach_s"] if ddp_s and c["reach_s"] else None
    return out


def catch_up_table(rows: list[dict[str, Any]]) -> str:
    header = ["variant", "steps to DDP's loss (±1%)", "time to it (s)", "vs DDP", "within 5% of DDP from step"]
    body = [[c["variant"],
             str(c["reach_step"]) if c["reach_step"] else f"not in {c['last_step']}",
             f"{c['reach_s']:.1f}" if c["reach_s"] else "",
             f"{c['speedup']:.2f}×" if c["speedup"] else "",
             str(c["within5_from"]) if c["within5_from"] else f"not in {c['last_step']}"] for c in rows]
    return er.markdown_table(header, body)


def table(rows: list[dict[str, Any]]) -> str:
    header = ["variant", "samples/s (median)", "all rounds", "vs ddp", "vs compute-only", "final loss",
              "Δ loss vs ddp", "replicas equal", "note"]
    out = []
    for r in rows:
        ok = "samples_per_s" in r
        out.append([
            r["variant"],
            f"{r['samples_per_s']:.1f}" if ok else "",
            ", ".join(f"{x:g}" for x in r.get("samples_per_s_all", [])),
            f"{r['vs_ddp']:.2f}×" if "vs_ddp" in r else "",
            f"{r['vs_compute_only']:.2f}×" if "vs_compute_only" in r else "",
            f"{r['final_loss']:.4f}" if ok else "",
            f"{r['loss_diff_vs_ddp_pct']:+.1f}%" if "loss_diff_vs_ddp_pct" in r else "",
            ("yes" if r["replicas_equal"] else "no") if ok else "",
            r.get("error") or r.get("note") or ("no sync: each rank trains alone" if r["variant"] ==
                                                "compute-only" else ""),
        ])
    return er.markdown_table(header, out)


def report(args: argparse.Namespace, result: dict[str, Any], meta: dict[str, Any]) -> tuple[str, Any, str]:
    rows = build_rows(result)
    params = result.get("parameters")
    caption = (f"Training, MLP {params / 1e6:.1f}M parameters, batch {args.batch}/rank, {meta['world_size']} ranks "
               f"({er.describe_setup(args)}); {args.steps} timed steps after {args.warmup}" if params else "Training")
    text = table(rows)
    reached = catch_up(rows, meta["world_size"], args.batch, args.catch_up_step)
    if reached:
        target = f"step {args.catch_up_step}" if args.catch_up_step else "its last evaluated step"
        text += (f"\n\nLoss evaluated every {args.eval_every} steps (steps counted from the first, warm-up "
                 f"included; DDP's loss at {target} is the one to reach; time = steps at the variant's "
                 "samples/s):\n\n" + catch_up_table(reached))
    return caption, rows, text


if __name__ == "__main__":
    sys.exit(er.main(__file__, sys.argv[1:], parse_args, worker, report))
