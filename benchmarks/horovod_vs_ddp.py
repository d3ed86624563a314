"""Loss per epoch of the Horovod MNIST program on ``taco_notebook.horovod`` against the same training under plain DDP.

    python benchmarks/horovod_vs_ddp.py --np 2 --epochs 5

Runs ``examples/scripts/hvd_mnist.py`` under ``mpiexec -n NP`` (uncompressed, and with ``--fp16-allreduce``),
then the same model, synthetic data, sampler, seed and optimizer (SGD, lr x size, momentum) wrapped in
``torch.nn.parallel.DistributedDataParallel`` with its default allreduce (gloo), started by this file in
``--ddp-rank`` mode. Both consume the random number generator in the same order (initial weights, dropout
masks), so uncompressed training should follow DDP's curve to float rounding. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import emulated_run as er

ROOT = Path(__file__).resolve().parents[1]
MNIST = ROOT / "examples" / "scripts" / "hvd_mnist.py"


def load_mnist_program() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hvd_mnist", MNIST)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ddp_rank(argv: list[str]) -> None:
    """One rank of the DDP twin of hvd_mnist.py's training (the process group comes from MPI via comm/)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import taco_notebook.comm as taco

    program = load_mnist_program()
    args = program.parse_args(argv)
    taco.init()
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train = program.synthetic_mnist(args.train_size, seed=1)
    train_sampler = torch.utils.data.distributed.DistributedSampler(train, num_replicas=size, rank=rank)
    train_loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, sampler=train_sampler)
    test = program.synthetic_mnist(args.test_size, seed=2)
    test_sampler = torch.utils.data.distributed.DistributedSampler(test, num_replicas=size, rank=rank)
    test_loader = torch.utils.data.DataLoader(test, batch_size=args.test_batch_size, sampler=test_sampler)
    model = program.Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=args.momentum)
    ddp = torch.nn.parallel.DistributedDataParallel(model)

    def mean(value: float) -> float:
        t = torch.tensor(value)
        dist.all_reduce(t)
        return float(t) / size

    for epoch in range(1, args.epochs + 1):
        ddp.train()
        train_sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.nll_loss(ddp(data), target)
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
        train_loss = mean(total / batches)
        ddp.eval()
        test_loss = correct = 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = ddp(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                correct += output.argmax(1).eq(target).float().sum().item()
        test_loss, accuracy = mean(test_loss / len(test_sampler)), mean(correct / len(test_sampler))
        if rank == 0:
            print(f"Epoch {epoch}: average train loss {train_loss:.6f}", flush=True)
            print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * accuracy:.2f}%", flush=True)
    taco.shutdown()


def run(np_: int, argv: list[str], timeout: float) -> list[tuple[float, float, float]]:
    """(train loss, test loss, test accuracy) per epoch of one mpiexec run of ``argv``."""
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([mpiexec, "-n", str(np_), sys.executable, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        er.kill_tree(proc)  # mpiexec and its ranks (each in a session of its own under hydra)
        out, err = proc.communicate()
        raise SystemExit(f"{argv[0]} overran {timeout:g} s; killed with its ranks:\n{out}\n{err}") from None
    except BaseException:  # Ctrl-C: the ranks must not outlive the driver
        er.kill_tree(proc)
        raise
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{out}\n{err}")
    train = [float(v) for v in re.findall(r"Epoch \d+: average train loss ([\d.]+)", out)]
    test = re.findall(r"Test set: Average loss: ([\d.]+), Accuracy: ([\d.]+)%", out)
    return [(t, float(loss), float(acc)) for t, (loss, acc) in zip(train, test, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2, help="ranks")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--train-size", type=int, default=6000)
    parser.add_argument("--test-size", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=1200, help="seconds for each mpiexec run")
    args = parser.parse_args()
    common = ["--epochs", str(args.epochs), "--train-size", str(args.train_size), "--test-size", str(args.test_size),
              "--log-interval", str(10**9), "--no-cuda"]
    columns = {
        "taco.horovod": run(args.np, [str(MNIST), *common], args.timeout),
        "taco.horovod fp16": run(args.np, [str(MNIST), *common, "--fp16-allreduce"], args.timeout),
        "DDP (gloo)": run(args.np, [str(Path(__file__).resolve()), "--ddp-rank", *common], args.timeout),
    }
    names = list(columns)
    print(f"MNIST-shaped program, {args.np} ranks, {args.train_size} synthetic images, batch 64 per rank, "
          "SGD lr 0.01 x size, momentum 0.5, seed 42\n")
    print("| epoch | " + " | ".join(f"train loss, {n}" for n in names) + " | "
          + " | ".join(f"test loss / acc, {n}" for n in names) + " |")
    print("|---:|" + "---:|" * (2 * len(names)))
    for epoch in range(args.epochs):
        train = " | ".join(f"{columns[n][epoch][0]:.6f}" for n in names)
        test = " | ".join(f"{columns[n][epoch][1]:.4f} / {columns[n][epoch][2]:.1f}%" for n in names)
        print(f"| {epoch + 1} | {train} | {test} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--ddp-rank":
        ddp_rank(sys.argv[2:])
    else:
        main()
