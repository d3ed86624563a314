"""A compression spec as a value: :class:`CompressionSpec`, parsed once where a user gives it, then carried.

``%%taco_run --compression``, ``TacoMagics.compression``, ``taco.configure(compression=...)``,
``DistributedOptimizer(compression=...)``, the DDP hook and ``hvd.Compression`` all take the text
``none``, ``fp16``, ``bf16``, ``topk:RATIO[:threshold=N]`` or ``powersgd:RANK[:warmup=N][:min_size=N]``
(or LightCC's ``LIGHT_TOPK_ALLREDUCE`` variables). Each parses it here, once, into a frozen, hashable,
picklable value whose :attr:`~CompressionSpec.name` is the canonical text, and hands that value on:
to the ranks, into :class:`.config.Settings`, down to the allreduce, where :func:`.compressors.build`
(the one factory) turns it into a compressor. A bad spec gets the same message wherever it was given.

``KIND:FIRST[:key=value]…`` specs are read by one :class:`SpecGrammar` each, whose :class:`SpecOption` s
(type, bounds, default) also check the compressors' constructor arguments and the LightCC variables.
Pure standard library (no torch).

>>> spec = CompressionSpec.parse("TopK:0.05:threshold=7")
>>> spec
CompressionSpec(kind='topk', ratio=0.05, threshold=7, rank=None, warmup=None, min_size=None)
>>> str(spec), spec == CompressionSpec("topk", 0.05, 7), CompressionSpec.parse("powersgd:4").name
('topk:0.05:threshold=7', True, 'powersgd:4')
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..specs import parse_flag

__all__ = ["CompressionSpec", "KINDS", "SpecOption", "SpecGrammar", "TOPK", "POWERSGD", "DEFAULT_TOPK_RATIO",
           "DEFAULT_TOPK_THRESHOLD", "DEFAULT_POWERSGD_WARMUP", "DEFAULT_POWERSGD_MIN_SIZE"]

KINDS = ("none", "fp16", "bf16", "topk", "powersgd")
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

_ACCEPTED = "use none, fp16, bf16 or topk:RATIO (e.g. topk:0.01), or powersgd:RANK (e.g. powersgd:4)"
_PARAMETERS = ("ratio", "threshold", "rank", "warmup", "min_size")  # CompressionSpec's fields after kind


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
        """``topk:0.05:threshold=1000``: the spec of these values (the options at their default left out).
        A float is written short (``0.05``) unless that would read back as another number."""
        def text(number: float) -> str:
            if not isinstance(number, float):
                return str(number)
            short = f"{number:g}"
            return short if float(short) == number else repr(number)

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


@dataclass(frozen=True)
class CompressionSpec:
    """What crosses the network: ``kind`` is none, fp16, bf16, topk (with ``ratio`` and ``threshold``) or
    powersgd (with ``rank``, ``warmup`` and ``min_size``); a kind's fields are None on the others.

    Built checked: a missing option takes its default (``CompressionSpec("topk", 0.05)`` has LightCC's
    threshold), a bad one or one of another kind is a ValueError. Equal specs have equal :attr:`name`, the
    canonical text (``str(spec)``), which :meth:`parse` reads back into an equal spec.
    """

    kind: str = "none"
    ratio: float | None = None
    threshold: int | None = None
    rank: int | None = None
    warmup: int | None = None
    min_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown compression kind {self.kind!r}; use one of {', '.join(KINDS)}")
        grammar = _GRAMMARS.get(self.kind)
        own = {} if grammar is None else {o.key: o for o in (grammar.first, *grammar.options)}
        for key in _PARAMETERS:
            value, option = getattr(self, key), own.get(key)
            if option is None:
                if value is not None:
                    raise ValueError(f"{self.kind} compression takes no {key}, got {key}={value!r}")
                continue
            if value is None:
                if option.default is None:
                    assert grammar is not None
                    raise ValueError(f"{self.kind} needs {grammar.needs}; {grammar.usage}")
                value = option.default
            object.__setattr__(self, key, option.check(value, f"{self.kind} {key}"))  # frozen: set once, here
        object.__setattr__(self, "_name", self._format())  # the canonical text, computed once per value

    def _format(self) -> str:
        grammar = _GRAMMARS.get(self.kind)
        if grammar is None:
            return self.kind
        return grammar.format(getattr(self, grammar.first.key),
                              **{o.key: getattr(self, o.key) for o in grammar.options})

    @property
    def name(self) -> str:
        """The canonical text, e.g. ``topk:0.01`` or ``powersgd:1:warmup=0`` (options at their default left
        out): what messages, metrics and ``repr`` s show."""
        return self._name  # type: ignore[attr-defined,no-any-return]

    def __str__(self) -> str:
        return self.name

    def __hash__(self) -> int:
        return hash(self._name)  # type: ignore[attr-defined]  # a str's hash is cached: cheap per allreduce

    def __reduce__(self) -> tuple[Any, ...]:
        return (CompressionSpec, tuple(getattr(self, key) for key in ("kind", *_PARAMETERS)))

    @classmethod
    def parse(cls, spec: CompressionSpec | str | None) -> CompressionSpec:
        """The spec ``spec`` names: a CompressionSpec as it is, None as ``none``, text such as ``"fp16"``,
        ``" TopK:0.05:threshold=1000"`` or ``"powersgd:4:warmup=0"`` parsed (any case). A ValueError names
        the spec and what is accepted; a TypeError any other type."""
        if isinstance(spec, CompressionSpec):
            return spec
        if spec is None:
            return _NONE
        if not isinstance(spec, str):
            raise TypeError(f"compression spec must be a string or None, got {type(spec).__name__} "
                            f"(or give a CompressionSpec)")
        return _parse_text(spec)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CompressionSpec:
        """What LightCC's flags ask for (``environ`` defaults to ``os.environ``): ``LIGHT_TOPK_ALLREDUCE=1``
        selects TopK with ``LIGHT_TOPK_RATIO`` (default 0.01) and ``LIGHT_TOPK_THRESHOLD`` (default 2,097,152
        elements); unset or false gives none, and the other two variables are then not read."""
        env = os.environ if environ is None else environ
        if not parse_flag("LIGHT_TOPK_ALLREDUCE", env.get("LIGHT_TOPK_ALLREDUCE")):
            return _NONE
        ratio = TOPK.first.read(env.get("LIGHT_TOPK_RATIO", str(DEFAULT_TOPK_RATIO)), "LIGHT_TOPK_RATIO")
        threshold = TOPK.options[0].read(env.get("LIGHT_TOPK_THRESHOLD", str(DEFAULT_TOPK_THRESHOLD)),
                                         "LIGHT_TOPK_THRESHOLD")
        return cls("topk", ratio, threshold)


_NONE = CompressionSpec()


@functools.lru_cache(maxsize=256)
def _parse_text(spec: str) -> CompressionSpec:
    """``spec`` (a string) parsed; cached, so a user passing the same text to every allreduce parses it once."""
    text = spec.strip().lower()
    if text in ("none", "fp16", "bf16"):
        return CompressionSpec(text)
    grammar = _GRAMMARS.get(text.partition(":")[0])
    if grammar is None:
        raise ValueError(f"unknown compression {spec!r}; {_ACCEPTED}")
    return CompressionSpec(grammar.kind, **grammar.read(spec))
