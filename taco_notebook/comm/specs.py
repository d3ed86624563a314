"""Parsing of every comm setting, in one place: compression specs, true/false flags, the environment.

``taco.configure()``, ``%%taco_run``'s options and the environment all end up here, so a value is checked
the same way and a bad one gets the same message (naming the setting and what it accepts) wherever it came
from. The environment gives the defaults: TACO-Training's LightCC flags (``LIGHT_2D_ALLREDUCE``,
``LIGHT_TOPK_ALLREDUCE`` / ``LIGHT_TOPK_RATIO`` / ``LIGHT_TOPK_THRESHOLD``), ``TACO_FUSION_MB``, ``TACO_SHM``
and ``TACO_COLLECTIVE_TIMEOUT``; :mod:`.config` turns them into :class:`.config.Settings`.

Pure standard library (no torch): a compression spec parses into a :class:`CompressionSpec`, which
:func:`.compression.build` turns into a compressor. ``KIND:FIRST[:key=value]…`` specs (``topk:RATIO``,
``powersgd:RANK``) are read by one :class:`SpecGrammar` each, whose :class:`SpecOption` s (type, bounds,
default) also check the compressors' constructor arguments and the LightCC variables, so a value is held to
the same rule, in the same words, wherever it is given.

>>> parse_compression_spec("topk:0.01:threshold=0")
CompressionSpec(kind='topk', ratio=0.01, threshold=0, rank=None, warmup=None, min_size=None)
>>> parse_flag("TACO_SHM", "off")
False
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ALGORITHMS", "DEFAULT_FUSION_MB", "DEFAULT_TIMEOUT_S", "DEFAULT_TOPK_RATIO", "DEFAULT_TOPK_THRESHOLD",
           "DEFAULT_POWERSGD_WARMUP", "DEFAULT_POWERSGD_MIN_SIZE", "CompressionSpec", "SpecOption", "SpecGrammar",
           "TOPK", "POWERSGD", "parse_flag", "parse_compression_spec",
           "check_algorithm", "check_fusion_mb", "check_chunk_mb", "chunk_mb_from_env", "check_timeout",
           "compression_spec_from_env",
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
# LightCC's LIGHT_TOPK_THRESHOLD default: below 2M elements the index overhead and the selection cost
# outweigh the bandwidth saved, so small tensors travel dense.
DEFAULT_TOPK_THRESHOLD = 2_097_152
DEFAULT_TOPK_RATIO = 0.01
# Steps (per tensor) PowerSGD reduces uncompressed before it starts: the first gradients change direction
# fast and are large, and compressing them costs accuracy (PyTorch's start_powerSGD_iter, whose default
# of 1000 is for long runs; 10 keeps short notebook runs compressed).
DEFAULT_POWERSGD_WARMUP = 10
# Below 64K elements (256 KiB of float32) PowerSGD's second collective costs more than the bytes it saves.
DEFAULT_POWERSGD_MIN_SIZE = 65536

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_ACCEPTED = "use none, fp16, bf16 or topk:RATIO (e.g. topk:0.01), or powersgd:RANK (e.g. powersgd:4)"


@dataclass(frozen=True)
class CompressionSpec:
    """A parsed compression spec: ``kind`` is none, fp16, bf16, topk (with ``ratio`` and ``threshold``) or
    powersgd (with ``rank``, ``warmup`` and ``min_size``); a kind's fields are None on the others."""

    kind: str
    ratio: float | None = None
    threshold: int | None = None
    rank: int | None = None
    warmup: int | None = None
    min_size: int | None = None


@dataclass(frozen=True)
class SpecOption:
    """One value of a spec (``topk:RATIO``'s ratio, ``:threshold=N``): its ``key``, its type (``int`` or
    ``float``), its bounds (``low`` itself allowed unless ``low_open``), its default, and ``accepts``, the words a
    message uses for what it must be."""

    key: str
    type: type[int] | type[float]
    accepts: str
    low: float
    high: float = math.inf
    low_open: bool = False
    default: int | float | None = None

    def _fits(self, number: float) -> bool:
        return (number > self.low if self.low_open else number >= self.low) and number <= self.high

    def read(self, text: str, what: str, hint: str = "") -> Any:
        """``text`` (from a spec or a variable) as a value; else a ValueError
        ``"{what} must be {accepts}, got {text!r}{hint}"``."""
        try:
            number = self.type(text.strip())
        except ValueError:
            number = None
        if number is None or not self._fits(number):
            raise ValueError(f"{what} must be {self.accepts}, got {text!r}{hint}")
        return number

    def check(self, value: object, what: str) -> Any:
        """``value`` given in Python (a constructor's argument): of this type (an int for a float; never a bool)
        and in bounds, else the same ValueError as :meth:`read`'s."""
        types = (int, float) if self.type is float else (int,)
        if isinstance(value, bool) or not isinstance(value, types) or not self._fits(value):
            raise ValueError(f"{what} must be {self.accepts}, got {value!r}")
        return self.type(value)


@dataclass(frozen=True)
class SpecGrammar:
    """``KIND:FIRST[:key=value]…``: a required first value, then named ones in any order (any case).

    ``needs`` says what a spec without its first value lacks, ``forms`` and ``example`` what the messages
    point to. :meth:`read` gives every option's value (its default when not given) by key; :meth:`format`
    writes a spec that :meth:`read` reads back, leaving defaults out.
    """

    kind: str
    first: SpecOption
    options: tuple[SpecOption, ...]
    needs: str
    forms: str
    example: str

    @property
    def usage(self) -> str:
        return f"use {self.forms} (e.g. {self.example})"

    def read(self, spec: str) -> dict[str, Any]:
        """The values of ``spec`` (whose kind is this one); a ValueError naming the spec and the allowed keys."""
        rest = spec.strip().lower().partition(":")[2]
        if not rest:
            raise ValueError(f"{self.kind} needs {self.needs}, got {spec!r}; "
                             f"use {self.kind}:{self.first.key.upper()} (e.g. {self.example})")
        first_text, *given = rest.split(":")
        texts = {self.first.key: first_text}
        named = {option.key: option for option in self.options}
        for item in given:
            key, eq, text = item.partition("=")
            if key.strip() not in named or not eq:
                raise ValueError(f"unknown {self.kind} option {item!r} in {spec!r}; {self.usage}")
            texts[key.strip()] = text
        values = {option.key: option.default for option in self.options}
        for option in (self.first, *self.options):
            if option.key in texts:
                values[option.key] = option.read(texts[option.key], f"{self.kind} {option.key} in {spec!r}",
                                                 f"; {self.usage}")
        return values

    def format(self, first: float, **values: float) -> str:
        """``topk:0.05:threshold=1000``: the spec of these values (the options at their default left out)."""
        def text(number: float) -> str:
            return f"{number:g}" if isinstance(number, float) else str(number)

        named = [f"{o.key}={text(values[o.key])}" for o in self.options if values[o.key] != o.default]
        return ":".join([f"{self.kind}:{text(first)}", *named])


TOPK = SpecGrammar(
    "topk",
    SpecOption("ratio", float, "a number in (0, 1]", low=0, high=1, low_open=True, default=DEFAULT_TOPK_RATIO),
    (SpecOption("threshold", int, "a non-negative integer (elements)", low=0, default=DEFAULT_TOPK_THRESHOLD),),
    needs="a ratio in (0, 1]", forms="topk:RATIO or topk:RATIO:threshold=N", example="topk:0.01")
POWERSGD = SpecGrammar(
    "powersgd",
    SpecOption("rank", int, "an integer >= 1", low=1),
    (SpecOption("warmup", int, "an integer >= 0", low=0, default=DEFAULT_POWERSGD_WARMUP),
     SpecOption("min_size", int, "an integer >= 0", low=0, default=DEFAULT_POWERSGD_MIN_SIZE)),
    needs="a rank (a positive integer)", forms="powersgd:RANK[:warmup=N][:min_size=N]", example="powersgd:4")
_GRAMMARS = {grammar.kind: grammar for grammar in (TOPK, POWERSGD)}


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


def parse_compression_spec(spec: str | None) -> CompressionSpec:
    """``None``/``"none"``, ``"fp16"``, ``"bf16"``, ``"topk:RATIO[:threshold=N]"`` or
    ``"powersgd:RANK[:warmup=N][:min_size=N]"``."""
    if spec is None:
        return CompressionSpec("none")
    if not isinstance(spec, str):
        raise TypeError(f"compression spec must be a string or None, got {type(spec).__name__}")
    text = spec.strip().lower()
    if text in ("none", "fp16", "bf16"):
        return CompressionSpec(text)
    grammar = _GRAMMARS.get(text.partition(":")[0])
    if grammar is None:
        raise ValueError(f"unknown compression {spec!r}; {_ACCEPTED}")
    return CompressionSpec(grammar.kind, **grammar.read(spec))


def compression_spec_from_env(environ: Mapping[str, str] | None = None) -> CompressionSpec:
    """What LightCC's flags ask for: ``LIGHT_TOPK_ALLREDUCE=1`` selects TopK with ``LIGHT_TOPK_RATIO``
    (default 0.01) and ``LIGHT_TOPK_THRESHOLD`` (default 2,097,152 elements); unset or false gives none,
    and the other two variables are then not read."""
    env = os.environ if environ is None else environ
    if not parse_flag("LIGHT_TOPK_ALLREDUCE", env.get("LIGHT_TOPK_ALLREDUCE")):
        return CompressionSpec("none")
    ratio = TOPK.first.read(env.get("LIGHT_TOPK_RATIO", str(DEFAULT_TOPK_RATIO)), "LIGHT_TOPK_RATIO")
    threshold = TOPK.options[0].read(env.get("LIGHT_TOPK_THRESHOLD", str(DEFAULT_TOPK_THRESHOLD)),
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
    """``TACO_SHM``: false keeps the 2D algorithm's intra-node steps on the process group (default true)."""
    env = os.environ if environ is None else environ
    return parse_flag("TACO_SHM", env.get("TACO_SHM")) is not False


def timeout_from_env(environ: Mapping[str, str] | None = None) -> float:
    """``TACO_COLLECTIVE_TIMEOUT``: seconds a collective waits for its peers (default 1800)."""
    env = os.environ if environ is None else environ
    value = number_from_env(env, "TACO_COLLECTIVE_TIMEOUT", float, "a number of seconds > 0")
    return DEFAULT_TIMEOUT_S if value is None else check_timeout(value, "TACO_COLLECTIVE_TIMEOUT")
