"""A Horovod PyTorch MNIST program, as Horovod's examples/pytorch/pytorch_mnist.py is shaped, on taco's engine.

The only line that differs from a program for Horovod itself is the import (``import horovod.torch as hvd``
there). The data are synthetic (these machines have no internet, and torchvision does not install beside the
CPU torch): 28x28 one-channel images drawn around ten fixed class templates, so the loss falls as on MNIST.

    mpiexec -n 4 python examples/scripts/hvd_mnist.py --epochs 3
    %taco_run -np 4 examples/scripts/hvd_mnist.py --epochs 3      (from a notebook)

Prints, on rank 0, the train loss of each log interval, each epoch's average train loss over every rank
(``Epoch E: average train loss L``) and the test set's average loss and accuracy, as the original does.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import taco_notebook.horovod as hvd  # the only change: `import horovod.torch as hvd` in Horovod's program


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example (synthetic data)")
    parser.add_argument("--batch-size", type=int, default=64, metavar="N", help="input batch size for training")
    parser.add_argument("--test-batch-size", type=int, default=1000, metavar="N", help="input batch size for testing")
    parser.add_argument("--epochs", type=int, default=10, metavar="N", help="number of epochs to train")
    parser.add_argument("--lr", type=float, default=0.01, metavar="LR", help="learning rate")
    parser.add_argument("--momentum", type=float, default=0.5, metavar="M", help="SGD momentum")
    parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed")
    parser.add_argument("--log-interval", type=int, default=10, metavar="N",
                        help="how many batches to wait before logging training status")
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--use-mixed-precision", action="store_true", default=False,
                        help="use mixed precision for training")
    parser.add_argument("--use-adasum", action="store_true", default=False, help="use adasum algorithm to do reduction")
    parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                        help="apply gradient predivide factor in optimizer (default: 1.0)")
    parser.add_argument("--train-size", type=int, default=6000, help="synthetic training images")
    parser.add_argument("--test-size", type=int, default=1000, help="synthetic test images")
    args = parser.parse_args(argv)
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    return args


def synthetic_mnist(size: int, seed: int) -> torch.utils.data.TensorDataset:
    """MNIST-shaped data: pixels in [0, 1] around ten fixed sparse templates (seed 0) plus noise, normalised
    with MNIST's mean and standard deviation as Horovod's loader does."""
    templates = (torch.rand(10, 1, 28, 28, generator=torch.Generator().manual_seed(0)) > 0.8).float()
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (size,), generator=g)
    images = (templates[labels] + 0.5 * torch.randn(size, 1, 28, 28, generator=g)).clamp(0, 1)
    return torch.utils.data.TensorDataset((images - 0.1307) / 0.3081, labels)


class Net(nn.Module):
    """The network of Horovod's MNIST example: two convolutions, dropout, two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def metric_average(val: torch.Tensor | float, name: str) -> float:
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def train_epoch(epoch: int, model: nn.Module, optimizer: optim.Optimizer, loader: torch.utils.data.DataLoader,
                sampler: torch.utils.data.distributed.DistributedSampler, args: argparse.Namespace,
                scaler: torch.amp.GradScaler | None) -> float:
    model.train()
    sampler.set_epoch(epoch)  # Horovod: set epoch to sampler for shuffling
    total, batches = 0.0, 0
    for batch_idx, (data, target) in enumerate(loader):
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        if scaler is not None:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.nll_loss(model(data), target)
            scaler.scale(loss).backward()
            optimizer.synchronize()  # Horovod: make sure all async allreduces are done
            scaler.unscale_(optimizer)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
        else:
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
        total, batches = total + loss.item(), batches + 1
        if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(sampler)} "
                  f"({100.0 * batch_idx / len(loader):.0f}%)]\tLoss: {loss.item():.6f}", flush=True)
    return metric_average(total / max(batches, 1), "avg_train_loss")


def test(model: nn.Module, loader: torch.utils.data.DataLoader,
         sampler: torch.utils.data.distributed.DistributedSampler, args: argparse.Namespace) -> tuple[float, float]:
    model.eval()
    test_loss, test_accuracy = 0.0, 0.0
    with torch.no_grad():
        for data, target in loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.data.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum().item()
    # Horovod: use test_sampler to determine the number of examples in this worker's partition,
    # then average the metric values across workers.
    test_loss = metric_average(test_loss / len(sampler), "avg_loss")
    test_accuracy = metric_average(test_accuracy / len(sampler), "avg_accuracy")
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%\n", flush=True)
    return test_loss, test_accuracy


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hvd.init()
    torch.manual_seed(args.seed)
    if args.cuda:
        # Horovod: pin GPU to local rank; modulo the GPUs there are, so that more ranks than GPUs (a notebook's
        # 2 or 4 ranks on a 1-GPU box, which --gpus auto shares) pin the GPU taco placed them on, not a missing one
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.manual_seed(args.seed)
    elif args.use_mixed_precision:
        raise ValueError("Mixed precision is only supported with cuda enabled.")
    torch.set_num_threads(1)  # Horovod: limit # of CPU threads to be used per worker

    train_dataset = synthetic_mnist(args.train_size, seed=1)
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, num_replicas=hvd.size(),
                                                                    rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_dataset = synthetic_mnist(args.test_size, seed=2)
    test_sampler = torch.utils.data.distributed.DistributedSampler(test_dataset, num_replicas=hvd.size(),
                                                                   rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net()
    lr_scaler = hvd.size() if not args.use_adasum else 1  # By default, Adasum doesn't need scaling up
    if args.cuda:
        model.cuda()
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = hvd.local_size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)
    scaler = torch.amp.GradScaler("cuda") if args.use_mixed_precision else None

    for epoch in range(1, args.epochs + 1):
        train_loss = train_epoch(epoch, model, optimizer, train_loader, train_sampler, args, scaler)
        if hvd.rank() == 0:
            print(f"Epoch {epoch}: average train loss {train_loss:.6f}", flush=True)
        test(model, test_loader, test_sampler, args)


if __name__ == "__main__":
    main()
