"""A Horovod PyTorch synthetic benchmark, shaped as Horovod's examples/pytorch/pytorch_synthetic_benchmark.py.

The only line that differs from a program for Horovod itself is the import. torchvision is not available
beside the CPU torch here, so the models are plain torch: ``resnet18``/``resnet34`` (torchvision's layout)
and ``small_cnn`` (for CPU runs); images are random, as in the original.

    mpiexec -n 4 python examples/scripts/hvd_synthetic_benchmark.py --model small_cnn --image-size 32 --no-cuda
    %taco_run -np 4 examples/scripts/hvd_synthetic_benchmark.py --fp16-allreduce

Prints, on rank 0, images per second per rank for each iteration and the mean over all ranks.
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import taco_notebook.horovod as hvd  # the only change: `import horovod.torch as hvd` in Horovod's program


class BasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    """torchvision's ResNet layout with basic blocks (resnet18: [2, 2, 2, 2], resnet34: [3, 4, 6, 3])."""

    def __init__(self, layers: list[int], num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        blocks, inplanes = [], 64
        for i, count in enumerate(layers):
            planes = 64 * 2**i
            for j in range(count):
                blocks.append(BasicBlock(inplanes, planes, 2 if j == 0 and i > 0 else 1))
                inplanes = planes
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = F.adaptive_avg_pool2d(self.layers(x), 1)
        return self.fc(torch.flatten(x, 1))


def small_cnn(num_classes: int = 1000) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(1024, 256), nn.ReLU(),
                         nn.Linear(256, num_classes))


MODELS = {"resnet18": lambda: ResNet([2, 2, 2, 2]), "resnet34": lambda: ResNet([3, 4, 6, 3]), "small_cnn": small_cnn}

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--model", type=str, default="resnet18", choices=sorted(MODELS), help="model to benchmark")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--image-size", type=int, default=224, help="height and width of the random images")
parser.add_argument("--num-warmup-batches", type=int, default=10, help="number of warm-up batches that don't count "
                                                                       "towards benchmark")
parser.add_argument("--num-batches-per-iter", type=int, default=10, help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--use-adasum", action="store_true", default=False, help="use adasum algorithm to do reduction")

args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

hvd.init()

if args.cuda:
    # Horovod: pin GPU to local rank (modulo the GPUs there are: ranks sharing a GPU under --gpus auto)
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
else:
    torch.set_num_threads(1)

model = MODELS[args.model]()
lr_scaler = hvd.size() if not args.use_adasum else 1  # By default, Adasum doesn't need scaling up learning rate.
if args.cuda:
    model.cuda()
    if args.use_adasum and hvd.nccl_built():
        lr_scaler = hvd.local_size()
optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)

# Horovod: broadcast parameters & optimizer state.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

# Set up fixed fake data
data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.LongTensor(args.batch_size).random_() % 1000
if args.cuda:
    data, target = data.cuda(), target.cuda()


def benchmark_step() -> None:
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()


def log(s: str, nl: bool = True) -> None:
    if hvd.rank() != 0:
        return
    print(s, end="\n" if nl else "", flush=True)


log(f"Model: {args.model}")
log(f"Batch size: {args.batch_size}")
device = "GPU" if args.cuda else "CPU"
log(f"Number of {device}s: {hvd.size()}")

# Warm-up
log("Running warmup...")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

# Benchmark
log("Running benchmark...")
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
    img_secs.append(img_sec)

# Results
img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")
