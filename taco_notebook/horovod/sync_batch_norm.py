"""``hvd.SyncBatchNorm``: batch normalisation over the batch of every rank, on CPU and CUDA tensors.

Horovod's (and torch's) ``SyncBatchNorm`` use CUDA-only kernels (``batch_norm_stats``, ``batch_norm_elemt``).
This one is written with plain tensor ops and two differentiable allreduces (:func:`.mpi_ops.allreduce` with
``op=Sum``), so it runs on any device and autograd derives the backward pass: the gradient of a sum over ranks
is the sum over ranks of the gradients, which is exactly what the synchronised backward needs. Two passes
(sum, then the sum of squared deviations from the global mean) keep the variance as exact as a local
BatchNorm's. Half-precision inputs are normalised in float32.

In eval mode, or with one rank, it is ``torch.nn.functional.batch_norm`` (the running statistics).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .basics import Sum, size
from .mpi_ops import allreduce

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm1d/2d/3d`` whose training statistics cover every rank's batch.

    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), hvd.SyncBatchNorm(8), torch.nn.ReLU())
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _average_factor(self) -> float:
        if not (self.training and self.track_running_stats):
            return 0.0
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average
            return 1.0 / float(self.num_batches_tracked)
        return float(self.momentum)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = self._average_factor()
        if not self.training or size() == 1:
            use_batch = self.training or not self.track_running_stats
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                use_batch, factor, self.eps)
        return self._synchronised(input, factor)

    def _synchronised(self, input: torch.Tensor, factor: float) -> torch.Tensor:
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        shape = [1, channels] + [1] * (input.dim() - 2)
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        rows = torch.tensor([input.numel() // max(channels, 1)], dtype=x.dtype, device=x.device)
        totals = allreduce(torch.cat([x.sum(dims), rows]), op=Sum, name="sync_batch_norm.sum")
        count = totals[-1].detach()
        if float(count) <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {input.size()}")
        mean = totals[:-1] / count
        centred = x - mean.view(shape)
        var = allreduce((centred * centred).sum(dims), op=Sum, name="sync_batch_norm.var") / count
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape).to(out.dtype) + self.bias.view(shape).to(out.dtype)
        if self.training and self.track_running_stats:
            assert self.running_mean is not None and self.running_var is not None
            with torch.no_grad():
                unbiased = var.detach() * count / (count - 1)
                self.running_mean.mul_(1 - factor).add_(mean.detach().to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return out.to(input.dtype)
