"""``hvd.DistributedOptimizer``: Horovod's arguments over comm/'s ``DistributedOptimizer``.

The machinery (a hook per parameter, fusion buckets reduced while backward runs, ``synchronize()`` before
``step()``) is comm/'s; this class maps Horovod's arguments onto it: ``compression=hvd.Compression.*`` to a
compression spec, ``op=hvd.Average/Sum`` to ``avg``/``sum``, ``gradient_predivide_factor`` to the bucket's
pre- and postscale factors (``1/f`` before the sum, ``f`` after the average, as Horovod splits it), and
Horovod's environment knobs ``HOROVOD_FUSION_THRESHOLD`` (bytes) and ``HOROVOD_HIERARCHICAL_ALLREDUCE=1`` to the
fusion size and the 2D algorithm. ``skip_synchronize()`` behaves as Horovod's: ``step()`` inside it uses the
gradients as they are (after a manual ``synchronize()``, or local ones), and ``step()`` after a manual
``synchronize()`` outside it warns once and reduces again. Arguments with no equivalent here are accepted and
warned about once: ``num_groups``, ``groups``. Sparse gradients (``nn.Embedding(sparse=True)``) are reduced
dense in their bucket and handed back sparse, which is what ``sparse_as_dense=True`` asks for (accepted).
``process_set=`` reduces over that set's ranks only (uncompressed, the backend's allreduce over its group).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..comm.diagnostics import metrics
from ..comm.training.optimizer import DistributedOptimizer as _CommOptimizer
from .basics import (
    Average,
    ProcessSet,
    ReduceOp,
    check_initialized,
    check_process_set,
    global_process_set,
    reduce_op,
    warn_once,
)
from .compression import Compression, spec_of

__all__ = ["DistributedOptimizer"]

_STEP_AFTER_SYNC = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code."
)


def _warn_unmatched(num_groups: int, groups: Any) -> None:
    if num_groups or groups is not None:
        warn_once(
            "groups",
            "DistributedOptimizer(num_groups=/groups=) has no effect here: gradients are fused "
            "into buckets of up to TACO_FUSION_MB (or HOROVOD_FUSION_THRESHOLD) instead; "
            "set that, or taco.configure(fusion_mb=...)",
        )


def _all_named(
    optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]
) -> list[tuple[str, torch.nn.Parameter]]:
    """``named_parameters`` as a list, checked as Horovod does: (name, tensor) pairs, unique names, and every
    parameter of the optimizer named (a ValueError naming the ones that are not)."""
    named = list(named_parameters)
    if any(not (isinstance(item, tuple) and len(item) == 2) for item in named):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually produced "
            "by model.named_parameters()"
        )
    names = [name for name, _ in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(duplicates)}"
        )
    named_ids = {id(p) for _, p in named}
    unnamed = [
        f"param_groups[{g}]['params'][{i}] (shape {list(p.shape)})"
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
        if id(p) not in named_ids
    ]
    if unnamed:
        raise ValueError(
            f"named_parameters was specified, but {len(unnamed)} of the optimizer's parameters were "
            f"not named: {', '.join(unnamed[:8])}{' ...' if len(unnamed) > 8 else ''}; pass "
            "model.named_parameters() of the whole model the optimizer was built for"
        )
    return named


def _horovod_env() -> tuple[float | None, str | None]:
    """Fusion size (MB) and algorithm from Horovod's environment variables, when set."""
    threshold = os.environ.get("HOROVOD_FUSION_THRESHOLD", "").strip()
    fusion_mb = int(threshold) / (1024 * 1024) if threshold else None
    hierarchical = os.environ.get("HOROVOD_HIERARCHICAL_ALLREDUCE", "").strip()
    return fusion_mb, ("2d" if hierarchical == "1" else None)


class DistributedOptimizer(_CommOptimizer):
    """Wraps ``optimizer`` so that ``step()`` uses gradients reduced over every rank, with Horovod's arguments.

    >>> opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
    ...                                named_parameters=model.named_parameters(),
    ...                                compression=hvd.Compression.fp16, backward_passes_per_step=2)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        compression: Any = Compression.none,
        backward_passes_per_step: int = 1,
        op: Any = Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        sparse_as_dense: bool = False,
        process_set: Any = global_process_set,
    ) -> None:
        check_initialized()
        found = reduce_op(op)  # Adasum raises, naming it
        if found not in (Average, ReduceOp.SUM):
            raise ValueError(f"DistributedOptimizer's op must be hvd.Average or hvd.Sum, got {found.name.title()}")
        if gradient_predivide_factor != 1.0 and found is not Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if gradient_predivide_factor <= 0:
            raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor}")
        if named_parameters is not None:
            named_parameters = _all_named(optimizer, named_parameters)
        # Horovod's table, which programs read: one unique name per parameter, "allreduce.noname.<group>.<index>"
        # when none are given (unique across param groups, the same on every rank).
        self._parameter_names: dict[torch.nn.Parameter, str] = (
            {p: name for name, p in named_parameters}
            if named_parameters is not None
            else {
                p: f"allreduce.noname.{i}.{j}"
                for i, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"])
            }
        )
        spec = spec_of(compression)
        if spec is None:
            raise TypeError(
                f"DistributedOptimizer(compression={compression!r}): only hvd.Compression members "
                "(none, fp16, bf16, topk, powersgd) run inside taco's fused allreduce; a custom "
                "Compressor works with hvd.allreduce only"
            )
        _warn_unmatched(num_groups, groups)
        # a rank outside the set steps on its own gradients (as Horovod's); inside, buckets go over the set's ranks
        outside = isinstance(process_set, ProcessSet) and process_set.group is not None and not process_set.included()
        group = None if outside else check_process_set(process_set)
        if group is not None and spec.kind != "none":
            raise ValueError(
                "DistributedOptimizer(process_set=..., compression=...): over a process set the gradients are "
                "reduced uncompressed (the backend's allreduce over the set's group); pass hvd.Compression.none"
            )
        fusion_mb, algorithm = _horovod_env()
        average = found is Average
        super().__init__(
            optimizer,
            named_parameters,
            compression=spec,
            algorithm=algorithm,
            backward_passes_per_step=backward_passes_per_step,
            fusion_mb=fusion_mb,
            op="avg" if average else "sum",
            prescale_factor=1.0 / gradient_predivide_factor if average else 1.0,
            postscale_factor=gradient_predivide_factor if average else 1.0,
            group=group,
        )
        self.gradient_predivide_factor = gradient_predivide_factor
        self._outside = outside
        if outside:
            self.remove_hooks()

    def synchronize(self) -> None:
        if self._outside:  # not in the optimizer's process set: the local gradients are the gradients
            self._synchronized = True
            return
        super().synchronize()

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate before the gradients are reduced (Horovod's setter)."""
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = passes

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if self._skip:  # Horovod: step on the gradients as they are
            self._synchronized = False
            result = self.optimizer.step(closure)
            metrics.step(samples=self.samples_per_step)
            return result
        if self._synchronized:
            warn_once("step-after-synchronize", _STEP_AFTER_SYNC)
        return super().step(closure)
