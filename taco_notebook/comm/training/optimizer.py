"""``DistributedOptimizer``: Horovod's API over taco's allreduce, with communication overlapping backward.

A hook on every parameter fires once its gradient is accumulated; when every gradient of a fusion bucket has
arrived (``backward_passes_per_step`` times), the bucket is packed and its allreduce starts on the
communication thread while backward carries on. Buckets start strictly in order, so every rank issues the
same collectives in the same order. ``step()`` first waits for all of them (``synchronize()``) and writes
the averaged gradients back.

    opt = taco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), compression="topk:0.01")
    loss.backward(); opt.step()
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch

from ..collectives.algorithms import allreduce_async, single_rank
from ..compression.spec import CompressionSpec
from ..config import check_algorithm, compressor_for, settings
from ..diagnostics import metrics
from ..diagnostics.replicas import track
from .fusion import Bucket, bucket_of, build_buckets

__all__ = ["DistributedOptimizer"]


def _named(optimizer: torch.optim.Optimizer,
           named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None) -> list[tuple[str, Any]]:
    if named_parameters is not None:
        named = [(name, p) for name, p in named_parameters if p.requires_grad]
        names = [name for name, _ in named]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"named_parameters has duplicate names: {duplicates}")
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [name for name, p in named if id(p) not in in_optimizer]
        if missing:
            raise ValueError(f"parameters not in the optimizer: {missing[:5]}; pass the model the optimizer "
                             "was built for")
        return named
    return [(f"param.{i}", p) for i, p in
            enumerate(p for group in optimizer.param_groups for p in group["params"] if p.requires_grad)]


def _weakly(method: Callable[[torch.nn.Parameter], None]) -> Callable[[torch.nn.Parameter], None]:
    """``method`` called through a weak reference to its object (nothing once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def hook(param: torch.nn.Parameter) -> None:
        bound = ref()
        if bound is not None:
            bound(param)

    return hook


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` so that ``step()`` uses gradients averaged over every rank.

    It is a ``torch.optim.Optimizer`` (learning-rate schedulers accept it) that delegates its state and
    parameter groups to the wrapped one instead of copying them.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 compression: CompressionSpec | str | None = None, algorithm: str | None = None,
                 backward_passes_per_step: int = 1, fusion_mb: float | None = None, op: str = "avg",
                 samples_per_step: int = 0, *, prescale_factor: float = 1.0,
                 postscale_factor: float = 1.0, group: Any = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
        self.group = group  # a comm.groups.SubGroup: reduce over its ranks only (the backend's allreduce)
        if group is not None and (algorithm is not None or CompressionSpec.parse(compression).kind != "none"):
            raise ValueError("DistributedOptimizer(group=...) reduces over the group with the backend's "
                             "allreduce, uncompressed: pass no compression or algorithm with a group")
        self.optimizer = optimizer
        # parsed now (a bad spec fails here, not at the first step); None: the rank's default at this moment
        self.compression = (CompressionSpec("none") if group is not None else settings().compression
                            if compression is None else CompressionSpec.parse(compression))
        self.algorithm = check_algorithm(algorithm) if algorithm is not None else None
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.samples_per_step = samples_per_step  # this rank's batch size, for taco.metrics' samples/s
        # Each bucket is multiplied by prescale_factor before the sum and by postscale_factor after it (after
        # averaging for op="avg"): Horovod's gradient_predivide_factor splits the average this way so that
        # fp16 sums do not overflow.
        self.prescale_factor, self.postscale_factor = float(prescale_factor), float(postscale_factor)
        mb = settings().fusion_mb if fusion_mb is None else fusion_mb
        self.buckets: list[Bucket] = build_buckets(reversed(_named(optimizer, named_parameters)),
                                                   int(mb * 1024 * 1024))
        self._bucket_of = bucket_of(self.buckets)
        track(((n, p) for b in self.buckets for n, p in zip(b.names, b.params, strict=True)), optimizer)  # replicas.py
        compressor = compressor_for(self.compression)
        for bucket in self.buckets:  # a new model: nothing kept from the last one under the same bucket name
            compressor.forget(("bucket", bucket.index))
            compressor.describe_buffer(("bucket", bucket.index), [p.shape for p in bucket.params])
        self._passes: dict[Any, int] = {}
        self._waiting = [len(b.params) for b in self.buckets]  # per bucket: gradients still to come
        self._ready: set[int] = set()
        self._launched: dict[int, Future[torch.Tensor]] = {}
        self._synchronized = False
        self._skip = False
        # Through a weak reference: a parameter's hooks live where gc cannot see them, so a bound method there
        # (optimizer -> wrapped optimizer -> parameters -> hook -> optimizer) would keep every dropped optimizer,
        # its fusion buffers and momentum alive (a notebook cell builds a new one each time it runs).
        self._hook = _weakly(self._on_grad)
        self._hooks: list[Any] = []
        self._detached = False  # remove_hooks() was called: stay off whatever the world does
        self._follow_world()

    def _alone(self) -> bool:
        """This rank is the job and nothing is scaled: the reduced gradients are the gradients themselves."""
        return (self.prescale_factor == 1.0 and self.postscale_factor == 1.0
                and (single_rank() if self.group is None else self.group.size == 1))

    def _follow_world(self) -> None:
        """Hooks on while there are other ranks, off while this rank is the job (checked again after each
        step: an elastic job can grow). With one rank a step is the wrapped optimizer's and nothing else: no
        hook call per gradient, no copy into a fusion buffer, no collective."""
        alone = self._alone()
        if alone and self._hooks:
            for handle in self._hooks:
                handle.remove()
            self._hooks.clear()
        elif not alone and not self._hooks and not self._detached:
            self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for p in self._bucket_of]

    # ------------------------------------------------------------ delegation to the wrapped optimizer
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._launched:
            raise RuntimeError("zero_grad() while gradients are being reduced: call step() or synchronize() "
                               "first (or zero_grad before backward)")
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, {len(self.buckets)} buckets, "
                f"compression={self.compression.name!r}, algorithm={self.algorithm or settings().algorithm!r})")

    # ------------------------------------------------------------ overlap
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        passes = self._passes[param] = self._passes.get(param, 0) + 1
        if passes > self.backward_passes_per_step:
            raise RuntimeError(f"a gradient was computed {passes} times before step(); set "
                               f"backward_passes_per_step={passes} to accumulate, or call step() each time")
        if passes < self.backward_passes_per_step:
            return
        bucket = self._bucket_of[param]
        self._waiting[bucket.index] -= 1
        if self._waiting[bucket.index] == 0:
            self._ready.add(bucket.index)
            self._launch_in_order()

    def _launch_in_order(self) -> None:
        while len(self._launched) < len(self.buckets) and len(self._launched) in self._ready:
            self._launch(self.buckets[len(self._launched)])

    def _launch(self, bucket: Bucket) -> None:
        if self.group is not None:
            from ..collectives.ops import allreduce_async as over_group

            self._launched[bucket.index] = over_group(bucket.pack(), op=self.op, name=("bucket", bucket.index),
                                                      prescale=self.prescale_factor,
                                                      postscale=self.postscale_factor, group=self.group)
            return
        self._launched[bucket.index] = allreduce_async(bucket.pack(), op=self.op, compression=self.compression,
                                                       algorithm=self.algorithm, name=("bucket", bucket.index),
                                                       prescale=self.prescale_factor,
                                                       postscale=self.postscale_factor)

    def synchronize(self) -> None:
        """Wait for every bucket's allreduce and write the reduced gradients back (buckets that got no
        gradient travel as zeros, so every rank runs the same collectives). With one rank it does nothing."""
        if not self._launched and self._alone():
            self._synchronized = True
            return
        for bucket in self.buckets[len(self._launched):]:
            self._launch(bucket)
        waited = time.perf_counter()
        try:
            for index, future in self._launched.items():
                future.result()
                self.buckets[index].unpack()
        finally:
            metrics.add_wait(time.perf_counter() - waited)
            self._launched.clear()
            self._ready.clear()
            self._passes.clear()
            self._waiting = [len(b.params) for b in self.buckets]
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Use when ``synchronize()`` was called by hand (e.g. to clip gradients) before ``step()``."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if not self._skip:
            self.synchronize()
        elif not self._synchronized:
            raise RuntimeError("step() inside skip_synchronize() needs synchronize() to be called first")
        self._synchronized = False
        result = self.optimizer.step(closure)
        metrics.step(samples=self.samples_per_step)
        self._follow_world()
        return result

    def set_compression(self, compression: CompressionSpec | str | None) -> None:
        """Compress with ``compression`` from the next step on (None: the rank's default now), starting afresh:
        what the old and the new compressor kept for these buckets (residuals, warm starts) is dropped.
        ``taco.tune`` switches its candidates this way. Not while gradients are being reduced."""
        if self._launched:
            raise RuntimeError("set_compression() while gradients are being reduced: call step() first")
        old = compressor_for(self.compression)
        self.compression = settings().compression if compression is None else CompressionSpec.parse(compression)
        new = compressor_for(self.compression)
        for bucket in self.buckets:
            old.forget(("bucket", bucket.index))
            new.forget(("bucket", bucket.index))
            new.describe_buffer(("bucket", bucket.index), [p.shape for p in bucket.params])

    def remove_hooks(self) -> None:
        """Detach from the model's parameters (the wrapped optimizer keeps working on its own)."""
        self._detached = True
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
