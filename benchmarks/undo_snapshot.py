"""What ``%taco_cluster undo``'s snapshot costs before a cell, for the 25M-parameter MLP of
benchmarks/replica_check.py trained with Adam (so 2 × 25M values of optimizer state are copied too): the copy
before a cell after one that trained (the first one allocating its host buffers, later ones reusing them), the
check before a cell after one that trained nothing (the copy is kept), the restore, and the memory of one copy.

One process, no ranks: the model and optimizer are registered as ``taco.DistributedOptimizer`` registers them
(``replicas.track``), and :class:`taco_notebook.engine.undo.Undo` takes its snapshot from that registry, as the
runner's ``before_cell`` does. Medians of REPEATS; with CUDA, the same on the GPU (``--devices cpu cuda``).

    python -m benchmarks undo_snapshot --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from taco_notebook.comm.diagnostics import replicas
from taco_notebook.engine.undo import Undo

IN_FEATURES, HIDDEN, CLASSES = 2048, 4096, 10  # the 25M-parameter MLP of benchmarks/train_bench.py


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))


def timed(action: Callable[[], object], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    action()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began


def rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def measure(device: str, repeats: int, batch: int) -> dict[str, float]:
    model = build_model().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    replicas.track(model.named_parameters(), opt)  # what DistributedOptimizer does
    x = torch.randn(batch, IN_FEATURES, device=device)
    y = torch.randint(0, CLASSES, (batch,), device=device)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    undo = Undo()
    step()
    resident = rss()
    first = timed(undo.take, device)
    grown = rss() - resident
    copies, checks, restores, steps = [], [], [], []
    for _ in range(repeats):
        steps.append(timed(step, device))  # a cell that trained
        copies.append(timed(undo.take, device))
        checks.append(timed(undo.take, device))  # a cell that trained nothing: the copy is kept
        restores.append(timed(undo.restore, device))
    assert undo.copies == repeats + 1 and undo.kept == repeats, (undo.copies, undo.kept)
    assert undo.snapshot is not None
    return {"params": sum(p.numel() for p in model.parameters()), "bytes": undo.snapshot.nbytes, "rss": grown,
            "first": first, "copy": statistics.median(copies), "check": statistics.median(checks),
            "restore": statistics.median(restores), "step": statistics.median(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="samples per training step (for scale)")
    parser.add_argument("--devices", nargs="+", default=["cpu", "cuda"], choices=["cpu", "cuda"],
                        help="where the model lives (cuda skipped without a GPU)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}")
    print("| device | parameters | one copy (MB) | RSS growth (MB) | first copy (ms) | copy (ms) | check, nothing "
          "changed (ms) | restore (ms) | a training step (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for device in args.devices:
        if device == "cuda" and not torch.cuda.is_available():
            print("| cuda | skipped: no CUDA device |")
            continue
        r = measure(device, args.repeats, args.batch)
        print(f"| {device} | {r['params'] / 1e6:.1f}M | {r['bytes'] / 1e6:.1f} | {r['rss'] / 1e6:.1f} | "
              f"{r['first'] * 1e3:.1f} | {r['copy'] * 1e3:.1f} | {r['check'] * 1e3:.3f} | {r['restore'] * 1e3:.1f} | "
              f"{r['step'] * 1e3:.1f} |")


if __name__ == "__main__":
    main()
