"""Per-process defaults for the accelerated allreduce: algorithm, compression, fusion threshold.

Defaults come from TACO-Training's LightCC flags, so jobs tuned for it behave the same here:
``LIGHT_2D_ALLREDUCE`` (1 = hierarchical, 0 = flat; unset = hierarchical when the job spans several nodes
with several ranks each), ``LIGHT_TOPK_ALLREDUCE`` / ``LIGHT_TOPK_RATIO`` / ``LIGHT_TOPK_THRESHOLD`` (TopK
compression) and ``TACO_FUSION_MB`` (Horovod's fusion threshold, 64 MB by default). ``configure()``,
``%%taco_run --algorithm/--compression/--fusion-mb`` and each call's arguments override them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from .compression import Compressor, compression_from_env, parse_compression

__all__ = ["ALGORITHMS", "Settings", "settings", "configure", "compressor_for", "algorithm_from_env"]

ALGORITHMS = ("auto", "flat", "2d")
DEFAULT_FUSION_MB = 64.0


def algorithm_from_env() -> str:
    raw = os.environ.get("LIGHT_2D_ALLREDUCE", "").strip().lower()
    if raw == "":
        return "auto"
    if raw in ("1", "true", "yes", "on"):
        return "2d"
    if raw in ("0", "false", "no", "off"):
        return "flat"
    raise ValueError(f"LIGHT_2D_ALLREDUCE must be 0 or 1, got {raw!r}")


def _fusion_from_env() -> float:
    raw = os.environ.get("TACO_FUSION_MB", "").strip()
    return check_fusion_mb(float(raw) if raw else DEFAULT_FUSION_MB)


def check_algorithm(name: str) -> str:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; use {', '.join(ALGORITHMS)}")
    return name


def check_fusion_mb(value: float) -> float:
    if not value >= 0:
        raise ValueError(f"fusion threshold must be >= 0 MB (0 = no fusion), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Settings:
    algorithm: str  # "auto" picks 2d when the job spans several nodes of several ranks each
    compression: str  # a parse_compression spec: "none", "fp16", "bf16", "topk:0.01[:threshold=N]"
    fusion_mb: float  # gradients are packed into buckets up to this size before each allreduce


def _from_env() -> Settings:
    return Settings(algorithm_from_env(), compression_from_env().name, _fusion_from_env())


_current: Settings | None = None
_compressors: dict[str, Compressor] = {}  # canonical name -> the one instance
_by_spec: dict[str, Compressor] = {}  # any spelling seen ("TopK:0.01 ", "topk:0.01") -> that instance


def settings() -> Settings:
    """The defaults in force on this rank."""
    global _current
    if _current is None:
        _current = _from_env()
    return _current


def configure(algorithm: str | None = None, compression: str | None = None, fusion_mb: float | None = None,
              reset: bool = False) -> Settings:
    """Change this rank's defaults (``reset=True`` goes back to the environment's). Returns the new ones."""
    global _current
    base = _from_env() if reset else settings()
    changes: dict[str, object] = {}
    if algorithm is not None:
        changes["algorithm"] = check_algorithm(algorithm)
    if compression is not None:
        changes["compression"] = parse_compression(compression).name
    if fusion_mb is not None:
        changes["fusion_mb"] = check_fusion_mb(fusion_mb)
    _current = replace(base, **changes)  # type: ignore[arg-type]
    return _current


def compressor_for(spec: str | None) -> Compressor:
    """The compressor for ``spec`` (None = the default), one instance per canonical spec so TopK residuals
    persist. Called for every allreduce: a spec is parsed once, then looked up."""
    key = settings().compression if spec is None else spec
    found = _by_spec.get(key)
    if found is None:
        name = parse_compression(key).name
        if name not in _compressors:
            _compressors[name] = parse_compression(name)
        found = _by_spec[key] = _compressors[name]
    return found
