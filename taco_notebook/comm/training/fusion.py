"""Gradient fusion: pack many small gradients into few flat buckets, one allreduce each.

Like Horovod's fusion buffer and DDP's buckets: per-collective latency dominates small tensors, so gradients
are grouped, in the order backward produces them (reverse of registration), into buckets of at most
``threshold_bytes`` of one dtype and device. A gradient larger than the threshold gets a bucket of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Bucket", "build_buckets", "bucket_of"]


@dataclass
class Bucket:
    """Parameters reduced together, and the flat buffer their gradients travel in.

    The buffer is made at its first use (:attr:`buffer`): a job of one rank reduces nothing, so its
    optimizer never holds a second copy of the gradients.
    """

    index: int
    params: list[torch.nn.Parameter]
    names: list[str]
    numel: int
    dtype: torch.dtype
    device: torch.device

    @property
    def buffer(self) -> torch.Tensor:
        """The flat buffer of ``numel`` elements (zeros when made), the same tensor at every call."""
        held: torch.Tensor | None = self.__dict__.get("_buffer")
        if held is None:
            held = self.__dict__["_buffer"] = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return held

    @property
    def allocated(self) -> bool:
        """Whether :attr:`buffer` was made yet."""
        return "_buffer" in self.__dict__

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def views(self) -> list[torch.Tensor]:
        """Each parameter's slice of the buffer, shaped like it (made once: no per-step slicing)."""
        cached: list[torch.Tensor] | None = self.__dict__.get("_views")
        if cached is None:
            cached, offset = [], 0
            for param in self.params:
                cached.append(self.buffer[offset: offset + param.numel()].view_as(param))
                offset += param.numel()
            self.__dict__["_views"] = cached
        return cached

    def pack(self) -> torch.Tensor:
        """Copy every gradient into the buffer (zeros for a parameter that got none this step).

        One fused multi-tensor copy when every gradient is there (the usual step): on a GPU that is one
        launch for the bucket instead of one per parameter.
        """
        views = self.views()
        grads = [param.grad for param in self.params]
        if all(grad is not None and grad.shape == view.shape and not grad.is_sparse
               for grad, view in zip(grads, views, strict=True)):
            torch._foreach_copy_(views, grads)  # type: ignore[arg-type]
            return self.buffer
        for view, grad in zip(views, grads, strict=True):
            if grad is None:
                view.zero_()
            elif grad.is_sparse:  # nn.Embedding(sparse=True): reduced dense, handed back sparse (unpack)
                view.copy_(grad.to_dense())
            else:
                view.copy_(grad.reshape(view.shape))
        return self.buffer

    def unpack(self) -> None:
        """Write the reduced buffer back into the gradients."""
        views = self.views()
        grads = [param.grad for param in self.params]
        if all(grad is not None and not grad.is_sparse for grad in grads):
            torch._foreach_copy_(grads, views)  # type: ignore[arg-type]
            return
        for param, view in zip(self.params, views, strict=True):
            if param.grad is None:
                param.grad = view.clone()
            elif param.grad.is_sparse:  # sparse as it came (SparseAdam wants it so): the rows any rank touched
                param.grad = view.to_sparse(param.grad.sparse_dim())
            else:
                param.grad.copy_(view)


def build_buckets(named_params: Iterable[tuple[str, torch.nn.Parameter]], threshold_bytes: int) -> list[Bucket]:
    """Group parameters (given in the order their gradients become ready) into buckets.

    ``threshold_bytes == 0`` turns fusion off: one bucket per parameter.
    """
    buckets: list[Bucket] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[str], list[torch.nn.Parameter], int]] = {}

    def close(kind: tuple[torch.dtype, torch.device]) -> None:
        names, params, numel = open_.pop(kind)
        buckets.append(Bucket(len(buckets), params, names, numel, *kind))

    for name, param in named_params:
        kind = (param.dtype, param.device)
        size = param.numel() * param.element_size()
        if kind in open_:
            names, params, numel = open_[kind]
            if (numel * param.element_size() + size > threshold_bytes) and params:
                close(kind)
        names, params, numel = open_.setdefault(kind, ([], [], 0))
        open_[kind] = (names + [name], params + [param], numel + param.numel())
    for kind in list(open_):
        close(kind)
    return buckets


def bucket_of(buckets: Sequence[Bucket]) -> dict[torch.nn.Parameter, Bucket]:
    return {param: bucket for bucket in buckets for param in bucket.params}
