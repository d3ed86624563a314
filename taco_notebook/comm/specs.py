"""Parsing of every comm setting, in one place: compression specs, true/false flags, the environment.

``taco.configure()``, ``%%taco_run``'s options and the environment all end up here, so a value is checked
the same way and a bad one gets the same message (naming the setting and what it accepts) wherever it came
from. The environment gives the defaults: TACO-Training's LightCC flags (``LIGHT_2D_ALLREDUCE``,
``LIGHT_TOPK_ALLREDUCE`` / ``LIGHT_TOPK_RATIO`` / ``LIGHT_TOPK_THRESHOLD``), ``TACO_FUSION_MB``, ``TACO_SHM``
and ``TACO_COLLECTIVE_TIMEOUT``; :mod:`.config` turns them into :class:`.config.Settings`.

Pure standard library (no torch): a compression spec parses into a :class:`CompressionSpec`, which
:func:`.compression.build` turns into a compressor.

>>> parse_compression_spec("topk:0.01:threshold=0")
CompressionSpec(kind='topk', ratio=0.01, threshold=0)
>>> parse_flag("TACO_SHM", "off")
False
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ALGORITHMS", "DEFAULT_FUSION_MB", "DEFAULT_TIMEOUT_S", "DEFAULT_TOPK_RATIO", "DEFAULT_TOPK_THRESHOLD",
           "CompressionSpec", "parse_flag", "parse_compression_spec", "parse_ratio", "parse_threshold",
           "check_algorithm", "check_fusion_mb", "check_timeout", "compression_spec_from_env",
           "algorithm_from_env", "fusion_mb_from_env", "shm_from_env", "timeout_from_env", "number_from_env",
           "check_choice", "check_positive"]

ALGORITHMS = ("auto", "flat", "2d")
DEFAULT_FUSION_MB = 64.0
DEFAULT_TIMEOUT_S = 1800.0  # a collective (and the rendezvous) waits this long for its peers
# LightCC's LIGHT_TOPK_THRESHOLD default: below 2M elements the index overhead and the selection cost
# outweigh the bandwidth saved, so small tensors travel dense.
DEFAULT_TOPK_THRESHOLD = 2_097_152
DEFAULT_TOPK_RATIO = 0.01

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_ACCEPTED = "use none, fp16, bf16 or topk:RATIO (e.g. topk:0.01)"


@dataclass(frozen=True)
class CompressionSpec:
    """A parsed compression spec: ``kind`` is none, fp16, bf16 or topk (ratio and threshold only for topk)."""

    kind: str
    ratio: float | None = None
    threshold: int | None = None


def parse_flag(name: str, raw: str | None) -> bool | None:
    """A true/false setting: 1/true/yes/on or 0/false/no/off (any case); None when unset or blank."""
    if raw is None or not raw.strip():
        return None
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{name} must be 1/true/yes/on or 0/false/no/off, got {raw!r}")


def parse_ratio(text: str, what: str) -> float:
    try:
        ratio = float(text)
    except ValueError:
        raise ValueError(f"{what} must be a number in (0, 1], got {text!r}") from None
    if not 0 < ratio <= 1:
        raise ValueError(f"{what} must be a number in (0, 1], got {text!r}")
    return ratio


def parse_threshold(text: str, what: str) -> int:
    try:
        threshold = int(text.strip())
    except ValueError:
        raise ValueError(f"{what} must be a non-negative integer (elements), got {text!r}") from None
    if threshold < 0:
        raise ValueError(f"{what} must be a non-negative integer (elements), got {text!r}")
    return threshold


def parse_compression_spec(spec: str | None) -> CompressionSpec:
    """``None``/``"none"``, ``"fp16"``, ``"bf16"``, ``"topk:RATIO"`` or ``"topk:RATIO:threshold=N"``."""
    if spec is None:
        return CompressionSpec("none")
    if not isinstance(spec, str):
        raise TypeError(f"compression spec must be a string or None, got {type(spec).__name__}")
    text = spec.strip().lower()
    if text in ("none", "fp16", "bf16"):
        return CompressionSpec(text)
    name, _, rest = text.partition(":")
    if name != "topk":
        raise ValueError(f"unknown compression {spec!r}; {_ACCEPTED}")
    if not rest:
        raise ValueError(f"topk needs a ratio in (0, 1], got {spec!r}; use topk:RATIO (e.g. topk:0.01)")
    ratio_text, *options = rest.split(":")
    ratio = parse_ratio(ratio_text, f"topk ratio in {spec!r}")
    threshold = DEFAULT_TOPK_THRESHOLD
    for option in options:
        opt_name, eq, value = option.partition("=")
        if opt_name.strip() != "threshold" or not eq:
            raise ValueError(f"unknown topk option {option!r} in {spec!r}; "
                             "use topk:RATIO or topk:RATIO:threshold=N")
        threshold = parse_threshold(value, f"topk threshold in {spec!r}")
    return CompressionSpec("topk", ratio, threshold)


def compression_spec_from_env(environ: Mapping[str, str] | None = None) -> CompressionSpec:
    """What LightCC's flags ask for: ``LIGHT_TOPK_ALLREDUCE=1`` selects TopK with ``LIGHT_TOPK_RATIO``
    (default 0.01) and ``LIGHT_TOPK_THRESHOLD`` (default 2,097,152 elements); unset or false gives none,
    and the other two variables are then not read."""
    env = os.environ if environ is None else environ
    if not parse_flag("LIGHT_TOPK_ALLREDUCE", env.get("LIGHT_TOPK_ALLREDUCE")):
        return CompressionSpec("none")
    ratio = parse_ratio(env.get("LIGHT_TOPK_RATIO", str(DEFAULT_TOPK_RATIO)), "LIGHT_TOPK_RATIO")
    threshold = parse_threshold(env.get("LIGHT_TOPK_THRESHOLD", str(DEFAULT_TOPK_THRESHOLD)),
                                "LIGHT_TOPK_THRESHOLD")
    return CompressionSpec("topk", ratio, threshold)


def check_algorithm(name: str) -> str:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; use {', '.join(ALGORITHMS)}")
    return name


def check_choice(value: object, choices: tuple[str, ...], what: str) -> str:
    """``value`` lower-cased and stripped when it is one of ``choices``, else a ValueError naming ``what`` and them.

    >>> check_choice(" Widget", ("auto", "widget"), "--dashboard")
    'widget'
    """
    chosen = value.strip().lower() if isinstance(value, str) else value
    if chosen not in choices:
        raise ValueError(f"{what} must be one of {', '.join(choices)}, got {value!r}")
    return str(chosen)


def check_positive(value: object, what: str, unit: str, convert: Callable[[Any], Any] = float) -> Any:
    """``value`` (a number or its text) converted by ``convert`` (``float`` or ``int``), finite and > 0, else a
    ValueError ``"{what} must be a positive number of {unit}, got …"`` (``a positive integer ({unit})`` for int)."""
    try:
        if isinstance(value, bool):
            raise ValueError
        number = convert(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        number = None
    if number is None or not 0 < number < float("inf"):
        kind = f"a positive integer ({unit})" if convert is int else f"a positive number of {unit}"
        raise ValueError(f"{what} must be {kind}, got {value!r}")
    return number


def check_fusion_mb(value: float) -> float:
    if not value >= 0:
        raise ValueError(f"fusion threshold must be >= 0 MB (0 = no fusion), got {value!r}")
    return float(value)


def check_timeout(value: float, what: str = "collective timeout") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{what} must be a number of seconds > 0, got {value!r}")
    return float(value)


def algorithm_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``LIGHT_2D_ALLREDUCE``: true = 2d, false = flat, unset = auto."""
    env = os.environ if environ is None else environ
    flag = parse_flag("LIGHT_2D_ALLREDUCE", env.get("LIGHT_2D_ALLREDUCE"))
    return "auto" if flag is None else "2d" if flag else "flat"


def number_from_env(env: Mapping[str, str], name: str, convert: Callable[[str], Any], what: str) -> Any:
    """``env[name]`` converted (``int``/``float``), None when unset or blank; a ValueError naming it otherwise."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return convert(raw)
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {raw!r}") from None


def fusion_mb_from_env(environ: Mapping[str, str] | None = None) -> float:
    """``TACO_FUSION_MB``: the fusion threshold in MB (64 by default, 0 = no fusion)."""
    env = os.environ if environ is None else environ
    value = number_from_env(env, "TACO_FUSION_MB", float, "a number of megabytes >= 0")
    return DEFAULT_FUSION_MB if value is None else check_fusion_mb(value)


def shm_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """``TACO_SHM``: false keeps the 2D algorithm's intra-node steps on the process group (default true)."""
    env = os.environ if environ is None else environ
    return parse_flag("TACO_SHM", env.get("TACO_SHM")) is not False


def timeout_from_env(environ: Mapping[str, str] | None = None) -> float:
    """``TACO_COLLECTIVE_TIMEOUT``: seconds a collective waits for its peers (default 1800)."""
    env = os.environ if environ is None else environ
    value = number_from_env(env, "TACO_COLLECTIVE_TIMEOUT", float, "a number of seconds > 0")
    return DEFAULT_TIMEOUT_S if value is None else check_timeout(value, "TACO_COLLECTIVE_TIMEOUT")
