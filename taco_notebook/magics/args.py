"""Argument stacks shared by the magics, and the checks that turn bad input into a ``UsageError``.

Every option that has a trait and an environment variable (:mod:`.settings`) is resolved here or in ``core``:
the option when given, else the trait when set, else the environment.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

from ..comm.specs import check_positive
from .settings import CLUSTER_ENV, RANK_SETTINGS, TacoSettings, setting_from_env

__all__ = ["cluster_args", "run_args", "comm_settings", "cluster_settings", "usage_errors", "positive_int",
           "cluster_size", "elastic_spec", "positive_float", "parse_targets", "wants_help", "usage", "DEFAULT_NP",
           "gpu_option", "required_hugepages", "add_arguments", "run_wants_help"]

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
    argument("--mpi-launcher", dest="mpi_launcher", default=None, metavar="NAME",
             help="MPICH launcher of a cluster started here: auto (gforker when beside mpiexec), hydra or gforker "
                  "(TacoMagics.mpi_launcher, TACO_MPI_LAUNCHER)"),
    argument("--gpus", default=None, metavar="MODE",
             help="auto: one GPU per rank, CPU where a node has none (default); shared: ranks share GPUs (CUDA "
                  "tensors over gloo); none: the ranks see no GPU (TacoMagics.gpus, TACO_GPUS). A change "
                  "restarts the cluster"),
    argument("--shm", dest="shm", action="store_const", const=True, default=None,
             help="2D allreduce's intra-node steps through shared memory (default; TacoMagics.shm, TACO_SHM)"),
    argument("--no-shm", dest="shm", action="store_const", const=False,
             help="... through the process group instead. A change restarts the cluster"),
    argument("--collective-timeout", dest="collective_timeout", default=None, metavar="SECONDS",
             help="how long a collective waits for its peers (default 1800; TacoMagics.collective_timeout, "
                  "TACO_COLLECTIVE_TIMEOUT). A change restarts the cluster"),
    argument("--require-hugepages", dest="require_hugepages", default=None, metavar="N",
             help="every node must have N free huge pages of its default size, else the cluster just started "
                  "is stopped, naming the nodes (TacoMagics.require_hugepages, TACO_REQUIRE_HUGEPAGES)"),
    argument("--profile", default=None, metavar="NAME",
             help="where the engines run: local (this machine, default), hosts (over ssh), slurm (a Slurm job, "
                  "or a step of the allocation this kernel runs in) or mpijob (the workers of the Kubeflow MPIJob "
                  "whose launcher pod runs this notebook, from its hostfile) (TacoMagics.profile)"),
    argument("--hosts", default=None, metavar="SPEC",
             help="hosts profile: HOST:SLOTS,… such as n0:2,n1:2, ranks filled in order (TacoMagics.hosts)"),
    argument("--hostfile", default=None, metavar="FILE",
             help="hosts profile: a file with HOST:SLOTS per line (TacoMagics.hostfile)"),
    argument("--partition", default=None, metavar="NAME",
             help="slurm profile: the job's partition (TacoMagics.partition; default Slurm's)"),
    argument("--time", default=None, metavar="LIMIT",
             help="slurm profile: the job's time limit, MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS "
                  "(TacoMagics.time; default the partition's)"),
    argument("--nodes", default=None, metavar="N",
             help="slurm profile: nodes the job spans (TacoMagics.nodes; default as Slurm places the ranks)"),
    argument("--gpus-per-node", dest="gpus_per_node", default=None, metavar="N",
             help="slurm profile: GPUs per node (--gres=gpu:N; 0 asks for none, the default; "
                  "TacoMagics.gpus_per_node)"),
    argument("--queue-timeout", dest="queue_timeout", default=None, metavar="SECONDS",
             help="slurm profile: cancel the job if it waits longer in the queue (TacoMagics.queue_timeout; "
                  "default no limit). A change of any of these restarts the cluster"),
)

run_args = _stack(
    argument("-np", "--np", dest="np", default=None, metavar="N",
             help=f"number of MPI ranks (default: the running cluster's size, else TacoMagics.np, else "
                  f"{DEFAULT_NP}); at most TacoMagics.max_ranks (TACO_MAX_RANKS, else 4 x cores)"),
    cluster_args,
    argument("--timeout", default=None, metavar="SECONDS",
             help="stop the cell after this many seconds and report the ranks still running (TacoMagics.timeout)"),
    argument("--targets", default=None, metavar="RANKS",
             help="run on these ranks only, e.g. '0', '0,2' or '1-3' (collectives need every rank)"),
    argument("--no-stream", dest="stream", action="store_false",
             help="show each rank's output when the cell ends instead of live"),
    argument("--gather", action="store_true",
             help="return every rank's value of the last expression (default: rank 0's)"),
    argument("--quiet", action="store_true", help="print no cluster start/resize messages"),
    argument("--dashboard", dest="dashboard", default=None, metavar="MODE",
             help="auto (widget in a notebook, else text), widget, text or off (TacoMagics.dashboard, "
                  "TACO_DASHBOARD)"),
    argument("--no-dashboard", dest="dashboard", action="store_const", const="off",
             help="no live dashboard (and no end-of-cell metrics summary); the ranks publish no metrics"),
    argument("--link-gbits", dest="link_gbits", default=None, metavar="GBITS",
             help="a node's network link in Gbit/s, the link heatmaps' scale (TacoMagics.link_gbits, "
                  "TACO_LINK_GBITS)"),
    argument("--algorithm", default=None, metavar="NAME",
             help="allreduce for this cell: auto (2d across several nodes), flat or 2d (TacoMagics.algorithm, "
                  "LIGHT_2D_ALLREDUCE)"),
    argument("--compression", default=None, metavar="SPEC",
             help="what crosses nodes: none, fp16, bf16, topk:RATIO or powersgd:RANK (TacoMagics.compression, "
                  "LIGHT_TOPK_ALLREDUCE)"),
    argument("--fusion-mb", dest="fusion_mb", default=None, metavar="MB",
             help="fuse gradients into buckets of up to MB megabytes (default 64; 0 = no fusion; "
                  "TacoMagics.fusion_mb, TACO_FUSION_MB)"),
    argument("--stall-timeout", dest="stall_timeout", default=None, metavar="SECONDS",
             help="a collective that waits this long for ranks that have not entered it fails the cell, naming them "
                  "(default 300; 0 or off: never; TacoMagics.stall_timeout, TACO_STALL_TIMEOUT)"),
    argument("--intra-size", dest="intra_size", default=None, metavar="N",
             help="ranks per node, to emulate several nodes on one machine (TacoMagics.intra_size, "
                  "LIGHT_INTRA_SIZE); a change restarts the cluster"),
    argument("--elastic", default=None, metavar="MIN:MAX",
             help="when a rank dies, the survivors roll back to the last taco.elastic.State commit and the cell "
                  "runs again on them, while at least MIN remain (a new cluster starts MAX ranks)"),
    # the line form's script: the first word that is no option nor an option's value; every word after it is
    # the script's own, options of this magic included (`train.py --lr 0.1 -np 3` gives the script `-np 3`)
    argument("script", nargs="?", default=None, metavar="SCRIPT",
             help="the line form's script (a cell takes none): a Python file, relative to the working directory "
                  "(the kernel's, in a notebook), run on every rank as `python SCRIPT ARGS` (sys.argv, "
                  "__name__ == '__main__', __file__); its source is sent to the ranks"),
    argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
             help="the script's arguments: everything after SCRIPT, options of this command included"),
)


def add_arguments(parser: argparse.ArgumentParser, stack: Callable[[Any], Any]) -> argparse.ArgumentParser:
    """Put the options of a magic's argument ``stack`` (such as :data:`run_args`) on a plain argparse
    ``parser``, in their order: the command line (``python -m taco_notebook launch``) takes the same options
    as the magic, defined once."""
    def holder() -> None: ...

    for decorator in reversed(stack(holder).decorators):  # decorators are listed innermost (last) first
        decorator.add_to_parser(parser, None)
    return parser


def run_wants_help(magic: Any, line: str) -> bool:
    """Whether ``%taco_run``'s line asks for its usage: ``-h``/``--help`` among its own options, not among the
    script's arguments (``%taco_run train.py --help`` shows the script's help)."""
    from IPython.utils.process import arg_split

    try:
        _, unknown = magic.parser.parse_known_args(arg_split(line, posix=True))
    except (UsageError, ValueError):  # a bad option: parsing it again says what is wrong, unless help was asked
        return wants_help(line)
    return any(word in ("-h", "--help") for word in unknown)


@contextmanager
def usage_errors() -> Iterator[None]:
    """Turn the ValueErrors of the settings' checks (which name the option, trait or variable) into UsageErrors."""
    try:
        yield
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def elastic_spec(text: str | None, targets: str | None) -> Any:
    """``--elastic MIN:MAX`` checked (None when not given); refused with ``--targets``, which runs on a subset."""
    if text is None:
        return None
    if targets is not None:
        raise UsageError("--elastic runs on every live rank: leave out --targets")
    from ..cluster.elastic.recovery import parse_elastic

    with usage_errors():
        return parse_elastic(text)


def _flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def comm_settings(config: TacoSettings, args: Any) -> dict[str, object]:
    """The ranks' ``taco.configure()`` for this cell: each of ``--algorithm/--compression/--fusion-mb/
    --stall-timeout`` given, else its trait when set (the ranks read the environment themselves), checked so
    that a typo starts nothing."""
    from ..comm.compression.spec import CompressionSpec
    from ..comm.specs import algorithm_from_env, fusion_mb_from_env, stall_timeout_from_env

    from_env = {"algorithm": algorithm_from_env, "compression": CompressionSpec.from_env,
                "fusion_mb": fusion_mb_from_env, "stall_timeout": stall_timeout_from_env}  # fmt: skip
    chosen: dict[str, object] = {}
    with usage_errors():
        for name in RANK_SETTINGS:
            value = config.chosen(name, getattr(args, name), _flag_of(name))
            if value is not None:  # the compression spec goes as its value (parsed once more: a cache hit)
                chosen[name] = CompressionSpec.parse(value) if name == "compression" else value
            else:  # the ranks will read it: a bad value fails here, naming the variable, before anything starts
                from_env[name]()
    return chosen


def cluster_settings(config: TacoSettings, args: Any, size: int) -> dict[str, str]:
    """The engines' environment that the process group is built from: ``--gpus`` (checked against this machine's
    GPUs by :func:`gpu_option`), ``--shm/--no-shm``, ``--collective-timeout``, each given or its trait when set."""
    from ..comm.specs import shm_from_env, timeout_from_env

    env: dict[str, str] = {}
    with usage_errors():
        gpus = gpu_option(config.chosen("gpus", args.gpus, "--gpus"), size)
        shm = config.chosen("shm", args.shm, "--shm")
        timeout = config.chosen("collective_timeout", args.collective_timeout, "--collective-timeout")
        shm_from_env(), timeout_from_env()  # what the ranks read when not given: checked before anything starts
    if gpus is not None:
        env[CLUSTER_ENV["gpus"]] = gpus  # the ranks place themselves (comm/placement.py) before CUDA starts
    if shm is not None:
        env[CLUSTER_ENV["shm"]] = "1" if shm else "0"
    if timeout is not None:
        env[CLUSTER_ENV["collective_timeout"]] = repr(float(timeout))
    return env


def required_hugepages(config: TacoSettings, args: Any) -> int | None:
    """``--require-hugepages N``, else its trait, else ``TACO_REQUIRE_HUGEPAGES``; None: nothing required.
    Checked before anything starts."""
    with usage_errors():
        wanted = config.chosen("require_hugepages", args.require_hugepages, "--require-hugepages")
        return wanted if wanted is not None else setting_from_env("require_hugepages")


def positive_int(value: str | None, option: str) -> int | None:
    """An option's text as a positive integer (None when not given), else a UsageError naming ``option``."""
    if value is None:
        return None
    with usage_errors():
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
    """An option's text as a positive, finite number of seconds (None when not given), else a UsageError naming
    ``option``."""
    if value is None:
        return None
    with usage_errors():
        return float(check_positive(value, option, "seconds"))


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
