"""``hvd.Compression``: Horovod's compression objects, each standing for one of comm/'s compressors.

Horovod's ``Compression.none`` and ``Compression.fp16`` are objects with ``compress(tensor) -> (tensor, ctx)``
and ``decompress(tensor, ctx)``. Here each is a :class:`SpecCompression` holding a comm/ compression spec (a
:class:`~taco_notebook.comm.compression.spec.CompressionSpec` value: ``fp16``, ``topk:0.01``, …): the allreduce
and ``DistributedOptimizer`` hand that value to taco's engine, which runs the compressor inside the accelerated
allreduce (fused buckets, 2D, TopK's sparse allgather and error feedback), not around it.
``compress``/``decompress`` still work, through a comm/ compressor of the same spec, for code that calls them
directly. This project's own compressors are the same kind of object::

    hvd.Compression.bf16
    hvd.Compression.topk               # topk:0.01, small tensors dense (LightCC's threshold)
    hvd.Compression.topk(0.05, threshold=0)
    hvd.Compression.powersgd(4, warmup=10)

A user's own Horovod ``Compressor`` subclass (static ``compress``/``decompress``) also works with
``hvd.allreduce``: it is applied around an uncompressed allreduce, as Horovod does.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.compression.base import Compressor as CommCompressor
from ..comm.compression.compressors import build
from ..comm.compression.spec import CompressionSpec

__all__ = ["Compressor", "SpecCompression", "Compression", "spec_of"]


class Compressor:
    """Horovod's interface: static ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class SpecCompression(Compressor):
    """A compression that taco's engine runs itself, named by a comm/ spec (see the module's doc).

    Calling it with arguments gives a variant: ``Compression.topk(0.05, threshold=0)`` is ``topk:0.05:threshold=0``.
    """

    def __init__(self, spec: CompressionSpec | str) -> None:
        self.spec = CompressionSpec.parse(spec)  # a bad spec fails here
        self._compressor: CommCompressor | None = None  # for compress/decompress, built on their first call

    def __call__(self, *args: Any, **options: Any) -> SpecCompression:
        kind = self.spec.kind
        if kind not in ("topk", "powersgd"):
            raise TypeError(f"Compression.{kind} takes no arguments")
        parts = [kind, *(str(a) for a in args), *(f"{k}={v}" for k, v in options.items())]
        return SpecCompression(":".join(parts))

    def compress(self, tensor: torch.Tensor) -> tuple[Any, Any]:  # type: ignore[override]
        """comm/'s compressor on one tensor (stateful compressors need ``hvd.allreduce`` to keep residuals)."""
        return self._own().compress(tensor, key=("hvd-compress", tensor.data_ptr(), tensor.numel()))

    def decompress(self, tensor: Any, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        return self._own().decompress(tensor, ctx)

    def _own(self) -> CommCompressor:
        """This object's own compressor (not the allreduce's: residuals of direct calls stay apart)."""
        if self._compressor is None:
            self._compressor = build(self.spec)
        return self._compressor

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SpecCompression) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return f"<hvd.Compression {self.spec.name!r}>"


class Compression:
    """Horovod's namespace of compressions, plus this project's (bf16, TopK, PowerSGD)."""

    none = SpecCompression("none")
    fp16 = SpecCompression("fp16")
    bf16 = SpecCompression("bf16")
    topk = SpecCompression("topk:0.01")
    powersgd = SpecCompression("powersgd:4")

    @staticmethod
    def from_spec(spec: CompressionSpec | str) -> SpecCompression:
        """The compression a ``%%taco_run --compression`` spec names, e.g. ``"topk:0.01:threshold=0"``."""
        return SpecCompression(spec)


def spec_of(compression: Any) -> CompressionSpec | None:
    """The comm/ spec of a compression (an ``hvd.Compression`` member, a CompressionSpec, its text or ``None``),
    or ``None`` for a user's own Horovod ``Compressor`` (which is applied around the allreduce instead)."""
    if isinstance(compression, SpecCompression):
        return compression.spec
    if compression is None or isinstance(compression, (str, CompressionSpec)):
        return CompressionSpec.parse(compression)
    if callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None)):
        return None
    raise TypeError(f"compression must be an hvd.Compression member (none, fp16, bf16, topk, powersgd), a spec "
                    f"such as 'topk:0.01', or a Compressor with compress/decompress; got {compression!r}")
