"""The compression advisor (``taco.tune``) on the 25M-parameter MLP, on 2 emulated nodes x 2 ranks.

At 1 Gbit/s links it should recommend a compressed candidate; with unshaped links (``--rate none``) it should say
compression does not pay. One launch = one ``EmulatedNodes`` + one ``mpiexec`` (see emulated_run.py)::

    .venv/bin/python benchmarks/advisor.py                   # root: emulated nodes, 1 Gbit/s links
    .venv/bin/python benchmarks/advisor.py --rate none       # root: the same nodes, links not shaped
    .venv/bin/python benchmarks/advisor.py --no-emulate --hidden-layers 0 --steps 2   # localhost quick check

Model and data as train_bench.py (Linear 2048→4096→4096→10, SGD with momentum, a learnable mixture of 10
Gaussians, batch ``--batch`` per rank); the training step picks its batch by the ``taco.elastic.State``'s step
counter, so every trial (restored to the same commit) trains on the same batches from the same weights.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import emulated_run as er
from train_bench import build_model, synthetic_batches

CANDIDATES = ["none", "fp16", "bf16", "topk:0.01", "topk:0.001", "powersgd:1:warmup=0", "powersgd:4:warmup=0"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per candidate (default 4)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them (default 1)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step (default 32)")
    parser.add_argument("--hidden-layers", type=int, default=1,
                        help="extra 4096x4096 layers after the first (default 1: 25.2M parameters)")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--candidates", nargs="+", default=CANDIDATES, help="compression specs to try")
    er.add_launch_args(parser, timeout_s=900)
    return parser.parse_args(argv)


# ---- rank side ---------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import taco_notebook.comm as taco

    torch.set_num_threads(1)
    topo = taco.init()
    batches = synthetic_batches(args.warmup + args.steps, args.batch, seed=100 + topo.rank)
    model = build_model(args.hidden_layers)
    opt = taco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum),
                                    model.named_parameters(), samples_per_step=args.batch)
    state = taco.elastic.State(model=model, optimizer=opt, step=0)
    committed = [p.detach().clone() for p in model.parameters()]

    def step() -> Any:
        x, y = batches[state.step % len(batches)]
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        state.step += 1
        return loss

    result = taco.tune(step, state, candidates=args.candidates, steps=args.steps, warmup=args.warmup)
    restored = all(torch.equal(a, b) for a, b in zip(committed, model.parameters(), strict=True))
    if topo.rank == 0:
        print(result, flush=True)
        er.write_result(args.worker, {
            "complete": True, "world_size": topo.size, "nodes": topo.num_nodes,
            "parameters": sum(p.numel() for p in model.parameters()), "best": result.best,
            "reason": result.reason, "restored": restored, "rows": result.rows()})
    er.shutdown_process_group(taco)


def rows_of(result: dict[str, Any]) -> list[list[Any]]:
    out = []
    for row in result.get("rows", []):
        link = row["link_bytes_per_s"]
        relative = row["relative_slope"]
        out.append([row["candidate"], f"{row['step_seconds'] * 1e3:,.0f} ms", f"{row['speedup']:.2f}x",
                    f"{row['wire_bytes_per_step'] / 1e6:,.2f} MB", "-" if link is None else f"{link / 1e6:,.1f} MB/s",
                    "-" if relative is None else f"{relative:.2f}",
                    ("**" + row["verdict"] + "**") if row["candidate"] == result.get("best") else row["verdict"]])
    return out


def report(args: argparse.Namespace, result: dict[str, Any], meta: dict[str, Any]) -> tuple[str, Any, str]:
    params = result.get("parameters")
    caption = (f"taco.tune, MLP {params / 1e6:.1f}M parameters, batch {args.batch}/rank, {meta['world_size']} ranks "
               f"({er.describe_setup(args)}); {args.steps} timed steps after {args.warmup} per candidate"
               if params else "taco.tune")
    rows = rows_of(result)
    text = er.markdown_table(["candidate", "step time", "speed-up", "bytes/step (rank)", "link rate",
                              "loss slope vs none", "verdict"], rows)
    if result:
        text += (f"\n\nRecommends **{result['best']}**: {result['reason']}. Parameters after tune equal the "
                 f"committed ones: {result['restored']}.")
    return caption, rows, text


if __name__ == "__main__":
    sys.exit(er.main(__file__, sys.argv[1:], parse_args, worker, report))
