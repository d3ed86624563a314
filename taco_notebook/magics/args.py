"""Argument stacks shared by the magics, and the checks that turn bad input into a ``UsageError``."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

__all__ = ["cluster_args", "run_args", "comm_settings", "positive_int", "cluster_size", "positive_float",
           "parse_targets", "wants_help", "usage", "DEFAULT_NP", "gpu_option"]

DEFAULT_NP = 4


def _stack(*decorators: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def apply(func: Any) -> Any:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


cluster_args = _stack(
    argument("--cluster", default="default", metavar="NAME",
             help="name of the cluster to use or start (default: 'default')"),
    argument("--mpiexec", default=None, metavar="PATH",
             help="mpiexec to launch ranks with (default: the one next to this Python, then PATH)"),
    argument("--gpus", default=None, metavar="MODE",
             help="auto: one GPU per rank, CPU where a node has none (default, or TACO_GPUS); shared: ranks share "
                  "GPUs (CUDA tensors over gloo); none: the ranks see no GPU"),
)

run_args = _stack(
    argument("-np", "--np", dest="np", default=None, metavar="N",
             help=f"number of MPI ranks (default: the running cluster's size, else {DEFAULT_NP})"),
    cluster_args,
    argument("--timeout", default=None, metavar="SECONDS",
             help="stop the cell after this many seconds and report the ranks still running"),
    argument("--targets", default=None, metavar="RANKS",
             help="run on these ranks only, e.g. '0', '0,2' or '1-3' (collectives need every rank)"),
    argument("--no-stream", dest="stream", action="store_false",
             help="show each rank's output when the cell ends instead of live"),
    argument("--gather", action="store_true",
             help="return every rank's value of the last expression (default: rank 0's)"),
    argument("--quiet", action="store_true", help="print no cluster start/resize messages"),
    argument("--no-dashboard", dest="dashboard", action="store_false",
             help="no live dashboard (and no end-of-cell metrics summary); the ranks publish no metrics"),
    argument("--algorithm", default=None, metavar="NAME",
             help="allreduce for this cell: auto (2d across several nodes), flat or 2d (default: LIGHT_2D_ALLREDUCE)"),
    argument("--compression", default=None, metavar="SPEC",
             help="what crosses nodes: none, fp16, bf16 or topk:RATIO (default: LIGHT_TOPK_ALLREDUCE)"),
    argument("--fusion-mb", dest="fusion_mb", default=None, metavar="MB",
             help="fuse gradients into buckets of up to MB megabytes (default 64; 0 = no fusion)"),
    argument("--intra-size", dest="intra_size", default=None, metavar="N",
             help="ranks per node, to emulate several nodes on one machine (LIGHT_INTRA_SIZE)"),
)


def comm_settings(algorithm: str | None, compression: str | None, fusion_mb: str | None) -> dict[str, object]:
    """The cell's allreduce options, checked here so that a typo starts nothing."""
    from ..comm.compression import parse_compression
    from ..comm.config import check_algorithm, check_fusion_mb

    chosen: dict[str, object] = {}
    try:
        if algorithm is not None:
            chosen["algorithm"] = check_algorithm(algorithm)
        if compression is not None:
            chosen["compression"] = parse_compression(compression).name
        if fusion_mb is not None:
            try:
                chosen["fusion_mb"] = check_fusion_mb(float(fusion_mb))
            except ValueError:
                raise ValueError(f"--fusion-mb must be a number of megabytes >= 0, got {fusion_mb!r}") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return chosen


def positive_int(value: str | None, option: str) -> int | None:
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise UsageError(f"{option} must be a positive integer, got {value!r}") from None
    if number <= 0:
        raise UsageError(f"{option} must be a positive integer, got {value!r}")
    return number


def cluster_size(value: str | None, option: str) -> int | None:
    """A rank count given as ``option``: a positive integer within the machine's limit
    (:func:`taco_notebook.cluster.limits.check_size`), checked before anything starts or stops."""
    from ..cluster.limits import SizeLimitError, check_size

    number = positive_int(value, option)
    if number is None:
        return None
    try:
        return check_size(number, option)
    except SizeLimitError as exc:
        raise UsageError(str(exc)) from None


def wants_help(line: str) -> bool:
    """Whether a magic's line asks for its usage (``-h`` or ``--help``): the magics' parsers have no help
    option of their own (IPython builds them with ``add_help=False``)."""
    from IPython.utils.process import arg_split

    try:
        words = arg_split(line, posix=True)
    except ValueError:  # unbalanced quotes: the parser reports them
        return False
    return any(word in ("-h", "--help") for word in words)


def usage(magic: Any, shown_as: str) -> str:
    """A magic's help text (usage, docstring, options) as a terminal shows it, its name written ``shown_as``
    (``%%taco_run`` for a cell magic)."""
    text = magic.parser.format_help()
    if text.startswith("::"):  # IPython formats it for the docstring (reST literal block)
        text = text[2:].lstrip("\n")
    name = "%" + magic.__name__
    return text.replace(f"  {name}", f"usage: {shown_as}", 1)


def positive_float(value: str | None, option: str) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        raise UsageError(f"{option} must be a positive number of seconds, got {value!r}") from None
    if not number > 0 or number == float("inf"):
        raise UsageError(f"{option} must be a positive number of seconds, got {value!r}")
    return number


def parse_targets(spec: str | None, size: int) -> list[int] | None:
    """'0,2-3' -> [0, 2, 3]; every rank must be in 0..size-1.

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
            raise UsageError(f"--targets must be ranks like '0', '0,2' or '1-3', got {spec!r}") from None
        ranks.update(chosen)
    outside = sorted(r for r in ranks if not 0 <= r < size)
    if outside:
        raise UsageError(f"--targets {spec!r} names rank {outside[0]}, outside 0..{size - 1} for -np {size}")
    return sorted(ranks)


def gpu_option(value: str | None, size: int) -> str | None:
    """``--gpus`` checked before anything starts: the mode (None when not given), or a ``UsageError``.

    Local clusters run every rank on this machine, so ``auto`` with fewer GPUs than ranks is refused here,
    with the ways out; the GPUs are counted from /proc, without initialising CUDA in the kernel.
    """
    from ..comm.hardware import visible_gpus
    from ..comm.placement import PlacementError, check_gpus, decide, too_few_message

    if value is None and not os.environ.get("TACO_GPUS"):
        mode = "auto"
    else:
        try:
            mode = check_gpus(value)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    try:
        decide(mode, 0, size, visible_gpus(), socket.gethostname())
    except PlacementError:
        raise UsageError(too_few_message(socket.gethostname(), visible_gpus(), size)) from None
    return mode if value is not None else None
