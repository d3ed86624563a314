"""What the replica check after a cell costs, for a 25M-parameter MLP trained with DistributedOptimizer (SGD with
momentum, so 25M momentum values are checked too): a training "cell" of STEPS steps, then the check as it runs
after the cell (``taco_notebook.comm.diagnostics.replicas.after_cell``: fingerprints of every tracked tensor, one
allgather).

Rank 0 prints the slowest rank's figures, medians of REPEATS, as a table row for benchmarks/README.md.

    mpiexec -n 2 python benchmarks/replica_check.py --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import taco_notebook.comm as taco
from taco_notebook.comm.diagnostics import replicas

IN_FEATURES, HIDDEN, CLASSES = 2048, 4096, 10  # the 25M-parameter MLP of benchmarks/train_bench.py


def build_model(hidden_layers: int = 1) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.ReLU()]
    for _ in range(hidden_layers):
        layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(HIDDEN, CLASSES))
    return torch.nn.Sequential(*layers)


def slowest(seconds: float) -> float:
    every = taco.allgather(torch.tensor([seconds], dtype=torch.float64))
    return float(every.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="training steps per cell")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    taco.init()
    model = build_model()
    params = sum(p.numel() for p in model.parameters())
    opt = taco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                    named_parameters=model.named_parameters())
    x, y = torch.randn(args.batch, IN_FEATURES), torch.randint(0, CLASSES, (args.batch,))
    cells, checks, prints = [], [], []
    for _ in range(args.repeats):
        replicas.begin_cell()
        taco.barrier()
        began = time.perf_counter()
        for _ in range(args.steps):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        cells.append(slowest(time.perf_counter() - began))
        began = time.perf_counter()
        report = replicas.after_cell()
        checks.append(slowest(time.perf_counter() - began))
        assert report is not None and report["ok"], report
        began = time.perf_counter()
        for _, tensor in replicas.tracked_tensors():
            replicas.fingerprint(tensor)
        prints.append(slowest(time.perf_counter() - began))
    if taco.rank() == 0:
        cell, check, fingerprints = (statistics.median(v) for v in (cells, checks, prints))
        print(f"| ranks | parameters | tensors checked | cell (s, {args.steps} steps) | check (s) | of which "
              "fingerprints (s) | check / cell |")
        print(f"| {taco.size()} | {params / 1e6:.1f}M | {report['tensors']} | {cell:.2f} | {check:.3f} | "
              f"{fingerprints:.3f} | {check / cell:.2%} |")


if __name__ == "__main__":
    main()
