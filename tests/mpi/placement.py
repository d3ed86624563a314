"""Run under ``mpiexec -n N`` with ``TACO_GPUS`` set: prints 'OK <rank> <mode> <device> <backend>'.

On a CPU node every mode places the rank on the CPU over gloo, and the collectives work; with ``none`` the
GPUs are hidden (``CUDA_VISIBLE_DEVICES=""``) before torch could see them. On a GPU node the same script
checks CPU and CUDA tensors in one process group.
"""

from __future__ import annotations

import os

import torch

import taco_notebook.comm as taco
from taco_notebook.comm.group import bootstrap, placement

mode = placement.gpu_mode()
if mode == "none":
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()
device = taco.device()
taco.init()
r, n = taco.rank(), taco.size()
backend = bootstrap.state.backend
if device.type == "cuda":
    assert device.index == taco.local_rank() % torch.cuda.device_count()  # its own GPU, or shared round-robin
cpu = torch.full((4,), float(r))
taco.allreduce(cpu)
assert cpu.tolist() == [float(sum(range(n)))] * 4, cpu
if device.type == "cuda":  # the same group carries CUDA tensors (nccl, or gloo when GPUs are shared)
    gpu = torch.full((5,), float(r), device=device)
    taco.allreduce(gpu, op="avg")
    assert gpu.device == device and gpu.cpu().tolist() == [(n - 1) / 2] * 5, gpu
    taco.broadcast(gpu, root=n - 1)
    assert gpu.cpu().tolist() == [(n - 1) / 2] * 5
gpu = taco.metrics.snapshot()["gpu"]
if device.type == "cuda":  # the dashboard's per-rank GPU data
    assert gpu["name"] and gpu["peak_bytes"] >= gpu["memory_bytes"] > 0, gpu
else:
    assert gpu is None, gpu
taco.barrier()
print(f"OK {r} {mode} {device.type} {backend}", flush=True)
taco.shutdown()
