"""Parsing of every comm setting but compression, in one place: true/false flags, numbers, the environment.

``taco.configure()``, ``%%taco_run``'s options and the environment all end up here, so a value is checked
the same way and a bad one gets the same message (naming the setting and what it accepts) wherever it came
from. The environment gives the defaults: TACO-Training's LightCC flag ``LIGHT_2D_ALLREDUCE``,
``TACO_FUSION_MB``, ``TACO_SHM`` and ``TACO_COLLECTIVE_TIMEOUT``; :mod:`.config` turns them into
:class:`.config.Settings`. A compression spec (and LightCC's ``LIGHT_TOPK_*`` flags) parses into its own
value, :class:`.compression.spec.CompressionSpec`.

Pure standard library (no torch).

>>> parse_flag("TACO_SHM", "off")
False
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ALGORITHMS", "DEFAULT_FUSION_MB", "DEFAULT_TIMEOUT_S", "parse_flag",
           "check_algorithm", "check_fusion_mb", "check_chunk_mb", "chunk_mb_from_env", "check_timeout",
           "algorithm_from_env", "fusion_mb_from_env", "shm_from_env", "timeout_from_env", "number_from_env",
           "check_choice", "check_positive", "DEFAULT_STALL_TIMEOUT_S", "check_stall_timeout",
           "stall_timeout_from_env"]

ALGORITHMS = ("auto", "flat", "2d")
DEFAULT_FUSION_MB = 64.0
DEFAULT_TIMEOUT_S = 1800.0  # a collective (and the rendezvous) waits this long for its peers
# The stall watchdog (stall.py) fails a collective that waited this long for ranks that never entered it. Longer
# than a notebook step's legitimate imbalance (one rank evaluating, checkpointing or compiling while the others
# wait: minutes at most), far shorter than the 30-minute collective timeout; Horovod warns at 60 s, and so does
# the watchdog, before it fails.
DEFAULT_STALL_TIMEOUT_S = 300.0

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


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
    ValueError ``"{what} must be a positive number of {unit}, got …"`` (``a positive integer ({unit})`` for int,
    ``a positive integer`` when ``unit`` is empty)."""
    try:
        if isinstance(value, bool):
            raise ValueError
        number = convert(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        number = None
    if number is None or not 0 < number < float("inf"):
        kind = (f"a positive number of {unit}" if convert is not int else
                f"a positive integer ({unit})" if unit else "a positive integer")
        raise ValueError(f"{what} must be {kind}, got {value!r}")
    return number


def check_fusion_mb(value: float) -> float:
    if not value >= 0:
        raise ValueError(f"fusion threshold must be >= 0 MB (0 = no fusion), got {value!r}")
    return float(value)


def check_chunk_mb(value: float | str | None, what: str = "pipeline chunk size") -> float | None:
    """A pipeline chunk size in MiB: None or ``"auto"`` = chosen from measured speeds, 0 = no pipelining."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        number = float("nan")
    if not 0 <= number < float("inf"):
        raise ValueError(f"{what} must be 'auto' or a number of MiB >= 0 (0 = no pipelining), got {value!r}")
    return number


def chunk_mb_from_env(environ: Mapping[str, str] | None = None) -> float | None:
    """``TACO_CHUNK_MB``: the 2D pipeline's chunk size in MiB (unset or ``auto``: from measured speeds)."""
    env = os.environ if environ is None else environ
    return check_chunk_mb(env.get("TACO_CHUNK_MB", "").strip() or None, "TACO_CHUNK_MB")


def check_timeout(value: float, what: str = "collective timeout") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{what} must be a number of seconds > 0, got {value!r}")
    return float(value)


def check_stall_timeout(value: object, what: str = "stall_timeout") -> float:
    """Seconds (a number or its text) >= 0, or ``off``/``none``: 0.0 means the stall watchdog is off."""
    text = value.strip().lower() if isinstance(value, str) else value
    if text in ("off", "none"):
        return 0.0
    try:
        if isinstance(text, bool):
            raise ValueError
        number = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = math.nan
    if not 0 <= number < math.inf:
        raise ValueError(f"{what} must be a number of seconds >= 0 (0 or 'off' turns the stall watchdog off), "
                         f"got {value!r}")
    return number


def stall_timeout_from_env(environ: Mapping[str, str] | None = None) -> float:
    """``TACO_STALL_TIMEOUT``: seconds a collective waits for missing ranks before it fails naming them (default
    300; 0 or off: never)."""
    env = os.environ if environ is None else environ
    raw = env.get("TACO_STALL_TIMEOUT", "").strip()
    return check_stall_timeout(raw, "TACO_STALL_TIMEOUT") if raw else DEFAULT_STALL_TIMEOUT_S


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
    """``TACO_SHM``: false keeps the intra-node steps on the process group: the 2D algorithm's, and a one-node
    job's whole allreduce and agreement (default true)."""
    env = os.environ if environ is None else environ
    return parse_flag("TACO_SHM", env.get("TACO_SHM")) is not False


def timeout_from_env(environ: Mapping[str, str] | None = None) -> float:
    """``TACO_COLLECTIVE_TIMEOUT``: seconds a collective waits for its peers (default 1800)."""
    env = os.environ if environ is None else environ
    value = number_from_env(env, "TACO_COLLECTIVE_TIMEOUT", float, "a number of seconds > 0")
    return DEFAULT_TIMEOUT_S if value is None else check_timeout(value, "TACO_COLLECTIVE_TIMEOUT")
