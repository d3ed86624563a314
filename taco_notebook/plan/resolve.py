"""From a run's parsed options to checked values: each option given, else its trait when set, else the environment.

Every check raises :class:`~taco_notebook.errors.OptionError` naming the option, trait or variable and what is
accepted, before anything starts; the magics show it as a ``UsageError``, the command line as a usage error.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..comm.specs import check_positive
from ..errors import OptionError
from .options import DEFAULT_NP
from .settings import CLUSTER_ENV, RANK_SETTINGS, TacoSettings, setting_from_env

if TYPE_CHECKING:
    from ..engine.wire import CellSettings

__all__ = ["DEFAULT_NP", "option_errors", "comm_settings", "cluster_settings", "required_hugepages", "positive_int",
           "cluster_size", "elastic_spec", "positive_float", "parse_targets", "gpu_option"]


@contextmanager
def option_errors() -> Iterator[None]:
    """Turn the ValueErrors of the settings' checks (which name the option, trait or variable) into OptionErrors."""
    try:
        yield
    except ValueError as exc:
        raise OptionError(str(exc)) from None


def elastic_spec(text: str | None, targets: str | None) -> Any:
    """``--elastic MIN:MAX`` checked (None when not given); refused with ``--targets``, which runs on a subset."""
    if text is None:
        return None
    if targets is not None:
        raise OptionError("--elastic runs on every live rank: leave out --targets")
    from ..cluster.elastic.recovery import parse_elastic

    with option_errors():
        return parse_elastic(text)


def _flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def comm_settings(config: TacoSettings, args: Any) -> CellSettings | None:
    """The ranks' ``taco.configure()`` for this cell (None: nothing given): each of ``--algorithm/--compression/
    --fusion-mb/--stall-timeout`` given, else its trait when set (the ranks read the environment themselves),
    checked so that a typo starts nothing."""
    from ..comm.compression.spec import CompressionSpec
    from ..comm.specs import algorithm_from_env, fusion_mb_from_env, stall_timeout_from_env
    from ..comm.training.advisor import AUTO
    from ..engine.wire import CellSettings

    from_env = {"algorithm": algorithm_from_env, "compression": CompressionSpec.from_env,
                "fusion_mb": fusion_mb_from_env, "stall_timeout": stall_timeout_from_env}  # fmt: skip
    chosen: dict[str, Any] = {}
    with option_errors():
        for name in RANK_SETTINGS:
            value = config.chosen(name, getattr(args, name), _flag_of(name))
            if value is not None:
                chosen[name] = value
            else:  # the ranks will read it: a bad value fails here, naming the variable, before anything starts
                from_env[name]()
    if not chosen:
        return None
    compression = chosen.pop("compression", None)
    auto = compression == AUTO  # the option's check gave its canonical text, or auto
    spec = None if compression is None or auto else CompressionSpec.parse(compression)
    return CellSettings(compression=spec, auto_compression=auto, **chosen)


def cluster_settings(config: TacoSettings, args: Any, size: int) -> dict[str, str]:
    """The engines' environment that the process group is built from: ``--gpus`` (checked against this machine's
    GPUs by :func:`gpu_option`), ``--shm/--no-shm``, ``--collective-timeout``, each given or its trait when set."""
    from ..comm.specs import shm_from_env, timeout_from_env

    env: dict[str, str] = {}
    with option_errors():
        gpus = gpu_option(config.chosen("gpus", args.gpus, "--gpus"), size)
        shm = config.chosen("shm", args.shm, "--shm")
        timeout = config.chosen("collective_timeout", args.collective_timeout, "--collective-timeout")
        shm_from_env(), timeout_from_env()  # what the ranks read when not given: checked before anything starts
    if gpus is not None:
        env[CLUSTER_ENV["gpus"]] = gpus  # the ranks place themselves (comm/group/placement.py) before CUDA starts
    if shm is not None:
        env[CLUSTER_ENV["shm"]] = "1" if shm else "0"
    if timeout is not None:
        env[CLUSTER_ENV["collective_timeout"]] = repr(float(timeout))
    return env


def required_hugepages(config: TacoSettings, args: Any) -> int | None:
    """``--require-hugepages N``, else its trait, else ``TACO_REQUIRE_HUGEPAGES``; None: nothing required.
    Checked before anything starts."""
    with option_errors():
        wanted = config.chosen("require_hugepages", args.require_hugepages, "--require-hugepages")
        return wanted if wanted is not None else setting_from_env("require_hugepages")


def positive_int(value: str | None, option: str) -> int | None:
    """An option's text as a positive integer (None when not given), else an OptionError naming ``option``."""
    if value is None:
        return None
    with option_errors():
        return int(check_positive(value, option, "", int))


def cluster_size(value: str | None, option: str, limit: int | None = None) -> int | None:
    """A rank count given as ``option``: a positive integer within the machine's limit (``limit``, from
    ``TacoMagics.max_ranks``, else :func:`taco_notebook.cluster.launch.limits.check_size`'s), checked before anything
    starts or stops."""
    from ..cluster.launch.limits import SizeLimitError, check_size

    number = positive_int(value, option)
    if number is None:
        return None
    try:
        return check_size(number, option, limit=limit)
    except SizeLimitError as exc:
        raise OptionError(str(exc)) from None


def positive_float(value: str | None, option: str) -> float | None:
    """An option's text as a positive, finite number of seconds (None when not given), else an OptionError that
    names ``option``."""
    if value is None:
        return None
    with option_errors():
        return float(check_positive(value, option, "seconds"))


def parse_targets(spec: str | None, size: int, option: str = "--targets") -> list[int] | None:
    """'0,2-3' -> [0, 2, 3]; every rank must be in 0..size-1 (``option`` names the flag in errors).

    >>> parse_targets("0,2-3", 4)
    [0, 2, 3]
    """
    if spec is None:
        return None
    ranks: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part[1:]:
                low, high = part.split("-", 1)
                chosen = range(int(low), int(high) + 1)
                if not chosen:
                    raise ValueError
            else:
                chosen = range(int(part), int(part) + 1)
        except ValueError:
            raise OptionError(f"{option} must be ranks like '0', '0,2' or '1-3', got {spec!r}") from None
        ranks.update(chosen)
    outside = sorted(r for r in ranks if not 0 <= r < size)
    if outside:
        raise OptionError(f"{option} {spec!r} names rank {outside[0]}, outside 0..{size - 1} for -np {size}")
    return sorted(ranks)


def gpu_option(value: str | None, size: int) -> str | None:
    """``--gpus`` checked before anything starts: the mode (None when not given), or an ``OptionError``.

    Local clusters run every rank on this machine, so ``exclusive`` with fewer GPUs than ranks is refused here,
    with the ways out (``auto`` shares them instead, and :func:`~.gpus.sharing_line` says so once the cluster is
    up); the GPUs are counted from /proc, without initialising CUDA in the kernel.
    """
    from ..comm.group.hardware import visible_gpus
    from ..comm.group.placement import PlacementError, check_gpus, decide, too_few_message

    if value is None and not os.environ.get("TACO_GPUS"):
        mode = "auto"
    else:
        try:
            mode = check_gpus(value)
        except ValueError as exc:
            raise OptionError(str(exc)) from None
    try:
        decide(mode, 0, size, visible_gpus(), socket.gethostname())
    except PlacementError:
        raise OptionError(too_few_message(socket.gethostname(), visible_gpus(), size)) from None
    return mode if value is not None else None
