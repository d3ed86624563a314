"""Every option of ``%%taco_run``, ``%taco_cluster`` and ``taco-notebook launch``, declared once: one row each.

A row names the option's flags (with their argparse keywords and help), its ``TacoMagics`` trait (type and help),
its environment variable, its check (:mod:`.checks`), its built-in default and where it takes effect. The magics'
argument stacks (:mod:`taco_notebook.magics.args`), the traits (:mod:`.settings`), the ``launch`` command's parser
(:func:`add_arguments`) and the reference page ``docs/options.md`` (:func:`markdown`; ``python -m
taco_notebook.plan.options > docs/options.md`` writes it) are all made from :data:`OPTIONS`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from traitlets import Bool, Float, Int, TraitType, Unicode

from ..cluster.launch.mpi import LAUNCHERS
from ..cluster.launch.profiles import PROFILES
from ..cluster.launch.slurm.options import check_count, check_partition, check_time
from ..comm.group.placement import GPU_MODES
from ..comm.specs import ALGORITHMS
from . import checks
from .checks import Check

__all__ = ["Flag", "Option", "OPTIONS", "EFFECTS", "DEFAULT_NP", "COMPRESSION_FORMS", "COMPRESSION_CHOICES",
           "DASHBOARD_MODES", "option", "flags_of", "traits", "add_arguments", "or_list", "markdown"]

DEFAULT_NP = 4
COMPRESSION_FORMS = ("none", "fp16", "bf16", "topk:RATIO", "powersgd:RANK")  # comm.compression's specs
COMPRESSION_CHOICES = (*COMPRESSION_FORMS, "auto")  # auto: taco.tune's choice (comm.training.advisor)
DASHBOARD_MODES = ("auto", "widget", "text", "off")  # widgets.dashboard's, which imports bokeh: a test keeps them equal
EFFECTS = {
    "cell": "the ranks' `taco.configure()` for each cell",
    "cluster": "the engines' environment, fixed when the ranks build their process group: a change restarts the "
               "cluster",
    "start": "how a cluster is started: a change restarts it",
    "slurm": "the slurm profile's job (with another profile the options are refused and the traits unused); a "
             "change restarts a slurm cluster",
    "nodes": "checked against every node once its cluster has started (a shortfall stops it)",
    "kernel": "the notebook's (or the `launch` command's) side of a run",
}


def or_list(words: tuple[str, ...]) -> str:
    """``("a", "b", "c")`` → ``"a, b or c"``, how help texts list choices."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


@dataclass(frozen=True)
class Flag:
    """One argparse argument of an option: its spellings, help and what argparse does with it."""

    spellings: tuple[str, ...]
    help: str
    metavar: str | None = None
    action: str | None = None
    const: Any = None
    nargs: Any = None
    default: Any = None

    def keywords(self, dest: str) -> dict[str, Any]:
        """``add_argument``'s keywords (IPython's ``argument`` takes the same), ``dest`` the option's name."""
        words: dict[str, Any] = {} if not self.spellings[0].startswith("-") else {"dest": dest}
        if self.action is not None:
            words["action"] = self.action
        if self.const is not None:
            words["const"] = self.const
        if self.nargs is not None:
            words["nargs"] = self.nargs
        if self.action in (None, "store_const"):  # store_true/false keep their own default
            words["default"] = self.default
        if self.metavar is not None:
            words["metavar"] = self.metavar
        return {**words, "help": self.help}


@dataclass(frozen=True)
class Option:
    """One option: ``name`` is the parsed argument's ``dest`` and the trait's name."""

    name: str
    flags: tuple[Flag, ...] = ()
    commands: tuple[str, ...] = ("run",)  # run: %%taco_run and launch; cluster: %taco_cluster start/restart too
    trait: type[TraitType[Any, Any]] | None = None
    summary: str = ""  # the trait's help, before its default
    env: str | None = None
    env_doc: str | None = None  # how the trait's help names the variable, when not just ``env``
    default: str | None = None  # the built-in default, as the help says it
    check: Check | None = None
    effect: str = "kernel"
    kernel_env: bool = False  # the kernel reads ``env`` itself (setting_from_env) when neither flag nor trait is set

    @property
    def trait_help(self) -> str:
        """What ``%config TacoMagics`` shows: the summary, then the variable and default it falls back to."""
        env = self.env_doc or self.env
        fallback = f"{env}, else {self.default}" if env and self.default else env or self.default
        return f"{self.summary}; default {fallback}" if fallback else self.summary


def _value(spellings: tuple[str, ...], metavar: str, help: str, default: Any = None) -> Flag:
    return Flag(spellings, help, metavar=metavar, default=default)


_CLUSTER = ("run", "cluster")
_SLURM_NOTE = "slurm profile: "

OUTPUT_MODES = ("auto", "all", "rank0", "errors")
OUTPUT_ALL_UP_TO = 32  # --output auto shows every rank's output up to this many ranks, rank 0's beyond


OPTIONS: tuple[Option, ...] = (
    Option("np", (_value(("-np", "--np"), "N", f"number of MPI ranks (default: the running cluster's size, else "
                         f"TacoMagics.np, else {DEFAULT_NP}); at most TacoMagics.max_ranks (TACO_MAX_RANKS, else "
                         f"4 x cores)"),),
           trait=Int, summary="ranks of a cluster started without -np (a running one keeps its size)",
           default=str(DEFAULT_NP), check=checks.positive("ranks", int), effect="start"),
    Option("max_ranks", trait=Int, summary="the most ranks a local cluster may have", env="TACO_MAX_RANKS",
           default="4 x cores (at least 8)", check=checks.positive("ranks", int), effect="start"),
    Option("cluster", (_value(("--cluster",), "NAME", "name of the cluster to use or start (default: 'default')",
                              "default"),), _CLUSTER),
    Option("mpiexec", (_value(("--mpiexec",), "PATH", "mpiexec to launch ranks with (default: the one next to this "
                              "Python, then PATH)"),), _CLUSTER, effect="start"),
    Option("mpi_launcher", (_value(("--mpi-launcher",), "NAME", "MPICH launcher of a cluster started here: auto "
                                   "(gforker when beside mpiexec), hydra or gforker (TacoMagics.mpi_launcher, "
                                   "TACO_MPI_LAUNCHER)"),), _CLUSTER,
           trait=Unicode, summary=f"MPICH launcher of a one-host cluster: {or_list(LAUNCHERS)}",
           env="TACO_MPI_LAUNCHER", default="auto", check=checks.choice(LAUNCHERS), effect="start"),
    Option("gpus", (_value(("--gpus",), "MODE", "auto: one GPU per rank, or the ranks share a node's GPUs "
                           "where it has fewer (CUDA tensors then over gloo, or a one-GPU job's allreduce in "
                           "the GPU's memory; one [taco] line says so), CPU where it has none (default); "
                           "exclusive: one GPU per rank, refuse a node with fewer; shared: ranks share GPUs "
                           "(likewise); none: the ranks see no GPU "
                           "(TacoMagics.gpus, TACO_GPUS). A change restarts the cluster"),), _CLUSTER,
           trait=Unicode, summary=or_list(GPU_MODES), env="TACO_GPUS", default="auto",
           check=checks.choice(GPU_MODES), effect="cluster"),
    Option("shm", (Flag(("--shm",), "intra-node allreduce steps through shared memory: 2D's, and a one-node "
                        "job's whole allreduce (default; TacoMagics.shm, TACO_SHM)", action="store_const",
                        const=True),
                   Flag(("--no-shm",), "... through the process group instead. A change restarts the cluster",
                        action="store_const", const=False)), _CLUSTER,
           trait=Bool, summary="intra-node allreduce steps through shared memory", env="TACO_SHM",
           default="on", check=checks.flag, effect="cluster"),
    Option("collective_timeout", (_value(("--collective-timeout",), "SECONDS", "how long a collective waits for its "
                                         "peers (default 1800; TacoMagics.collective_timeout, "
                                         "TACO_COLLECTIVE_TIMEOUT). A change restarts the cluster"),), _CLUSTER,
           trait=Float, summary="seconds a collective waits for its peers", env="TACO_COLLECTIVE_TIMEOUT",
           default="1800", check=checks.positive("seconds"), effect="cluster"),
    Option("require_hugepages", (_value(("--require-hugepages",), "N", "every node must have N free huge pages of "
                                        "its default size, else the cluster just started is stopped, naming the "
                                        "nodes (TacoMagics.require_hugepages, TACO_REQUIRE_HUGEPAGES)"),), _CLUSTER,
           trait=Int, summary="free huge pages (each node's default size) every node must have, else the cluster "
                              "is stopped", env="TACO_REQUIRE_HUGEPAGES", default="none",
           check=checks.positive("free huge pages per node", int), effect="nodes", kernel_env=True),
    Option("profile", (_value(("--profile",), "NAME", "where the engines run: local (this machine, default), hosts "
                              "(over ssh), slurm (a Slurm job, or a step of the allocation this kernel runs in) or "
                              "mpijob (the workers of the Kubeflow MPIJob whose launcher pod runs this notebook, "
                              "from its hostfile) (TacoMagics.profile)"),), _CLUSTER,
           trait=Unicode, summary=f"where engines run: {or_list(PROFILES)}", check=checks.choice(PROFILES),
           effect="start"),
    Option("hosts", (_value(("--hosts",), "SPEC", "hosts profile: HOST:SLOTS,… such as n0:2,n1:2, ranks filled in "
                            "order (TacoMagics.hosts)"),), _CLUSTER,
           trait=Unicode, summary="the hosts profile's HOST:SLOTS,… (n0:2,n1:2)", check=checks.hosts, effect="start"),
    Option("hostfile", (_value(("--hostfile",), "FILE", "hosts profile: a file with HOST:SLOTS per line "
                               "(TacoMagics.hostfile)"),), _CLUSTER,
           trait=Unicode, summary="the hosts profile's hostfile, HOST:SLOTS per line", check=checks.text,
           effect="start"),
    Option("controller_ip", trait=Unicode, summary="the hosts profile's controller address",
           default="emulated nodes' bridge, else the route to the first host", check=checks.address, effect="start"),
    Option("partition", (_value(("--partition",), "NAME", _SLURM_NOTE + "the job's partition (TacoMagics.partition; "
                                "default Slurm's)"),), _CLUSTER,
           trait=Unicode, summary="the slurm profile's partition", default="Slurm's", check=check_partition,
           effect="slurm"),
    Option("time", (_value(("--time",), "LIMIT", _SLURM_NOTE + "the job's time limit, MM, MM:SS, HH:MM:SS, D-HH, "
                           "D-HH:MM or D-HH:MM:SS (TacoMagics.time; default the partition's)"),), _CLUSTER,
           trait=Unicode, summary="the slurm profile's time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)",
           default="the partition's", check=check_time, effect="slurm"),
    Option("nodes", (_value(("--nodes",), "N", _SLURM_NOTE + "nodes the job spans (TacoMagics.nodes; default as "
                            "Slurm places the ranks)"),), _CLUSTER,
           trait=Int, summary="nodes of the slurm profile's job", default="Slurm's",
           check=checks.positive("nodes", int), effect="slurm"),
    Option("gpus_per_node", (_value(("--gpus-per-node",), "N", _SLURM_NOTE + "GPUs per node (--gres=gpu:N; 0 asks "
                                    "for none, the default; TacoMagics.gpus_per_node)"),), _CLUSTER,
           trait=Int, summary="GPUs per node of the slurm profile's job (--gres=gpu:N)", default="0",
           check=check_count, effect="slurm"),
    Option("queue_timeout", (_value(("--queue-timeout",), "SECONDS", _SLURM_NOTE + "cancel the job if it waits "
                                    "longer in the queue (TacoMagics.queue_timeout; default no limit). A change of "
                                    "any of these restarts the cluster"),), _CLUSTER,
           trait=Float, summary="seconds the slurm profile's job may wait in the queue before it is cancelled",
           default="no limit", check=checks.positive("seconds"), effect="slurm"),
    Option("timeout", (_value(("--timeout",), "SECONDS", "stop the cell after this many seconds and report the ranks "
                              "still running (TacoMagics.timeout)"),),
           trait=Float, summary="seconds after which a cell is stopped", default="none",
           check=checks.positive("seconds")),
    Option("targets", (_value(("--targets",), "RANKS", "run on these ranks only, e.g. '0', '0,2' or '1-3' "
                              "(collectives need every rank)"),)),
    Option("stream", (Flag(("--no-stream",), "show each rank's output when the cell ends instead of live",
                           action="store_false"),)),
    Option("check_replicas", (Flag(("--no-check-replicas",), "after the cell, do not compare the parameters and "
                                   "optimizer state that taco trained across ranks (the check warns, naming the "
                                   "ranks and tensors that differ; it runs only after a cell that ran collectives "
                                   "on every rank)", action="store_false"),)),
    Option("output", (_value(("--output",), "WHOSE", "whose output the cell shows: all (every rank's), rank0 "
                             "(rank 0's, plus what any rank writes to stderr and the output of a rank that "
                             "fails) or errors (only stderr and failing ranks); auto, the default: all up to "
                             f"{OUTPUT_ALL_UP_TO} ranks, rank0 beyond (TacoMagics.output, TACO_OUTPUT)"),),
           trait=Unicode, summary=f"whose output cells show: {or_list(OUTPUT_MODES)}", env="TACO_OUTPUT",
           default="auto", check=checks.choice(OUTPUT_MODES), kernel_env=True),
    Option("gather", (Flag(("--gather",), "return every rank's value of the last expression (default: rank 0's)",
                           action="store_true"),)),
    Option("quiet", (Flag(("--quiet",), "print no cluster start/resize messages", action="store_true"),)),
    Option("dashboard", (_value(("--dashboard",), "MODE", "auto (widget in a notebook, else text), widget, text or "
                                "off (TacoMagics.dashboard, TACO_DASHBOARD)"),
                         Flag(("--no-dashboard",), "no live dashboard (and no end-of-cell metrics summary); the "
                              "ranks publish no metrics", action="store_const", const="off")),
           trait=Unicode, summary=or_list(DASHBOARD_MODES), env="TACO_DASHBOARD", default="auto",
           check=checks.choice(checks.dashboard_modes)),
    Option("link_gbits", (_value(("--link-gbits",), "GBITS", "a node's network link in Gbit/s, the link heatmaps' "
                                 "scale (TacoMagics.link_gbits, TACO_LINK_GBITS)"),),
           trait=Float, summary="a node's link in Gbit/s, the scale of the link heatmaps", env="TACO_LINK_GBITS",
           check=checks.positive("Gbit/s"), kernel_env=True),
    Option("algorithm", (_value(("--algorithm",), "NAME", "allreduce for this cell: auto (2d across several nodes), "
                                "flat or 2d (TacoMagics.algorithm, LIGHT_2D_ALLREDUCE)"),),
           trait=Unicode, summary=f"allreduce: {or_list(ALGORITHMS)}", env="LIGHT_2D_ALLREDUCE", default="auto",
           check=checks.algorithm, effect="cell"),
    Option("compression", (_value(("--compression",), "SPEC", f"what crosses nodes: {or_list(COMPRESSION_CHOICES)}"
                                  "; auto is what taco.tune(step, state) last recommended on this cluster, and none "
                                  "(saying so) before any tune (TacoMagics.compression, LIGHT_TOPK_ALLREDUCE)"),),
           trait=Unicode, summary=or_list(COMPRESSION_CHOICES), env="LIGHT_TOPK_ALLREDUCE",
           env_doc="LIGHT_TOPK_ALLREDUCE/_RATIO/_THRESHOLD", default="none", check=checks.compression,
           effect="cell"),
    Option("fusion_mb", (_value(("--fusion-mb",), "MB", "fuse gradients into buckets of up to MB megabytes (default "
                                "64; 0 = no fusion; TacoMagics.fusion_mb, TACO_FUSION_MB)"),),
           trait=Float, summary="gradient fusion buckets in MB (0 = none)", env="TACO_FUSION_MB", default="64",
           check=checks.fusion_mb, effect="cell"),
    Option("stall_timeout", (_value(("--stall-timeout",), "SECONDS", "a collective that waits this long for ranks "
                                    "that have not entered it fails the cell, naming them (default 300; 0 or off: "
                                    "never; TacoMagics.stall_timeout, TACO_STALL_TIMEOUT)"),),
           trait=Float, summary="seconds a collective waits for ranks that have not entered it before the cell "
                                "fails naming them (0 = never)", env="TACO_STALL_TIMEOUT", default="300",
           check=checks.stall_timeout, effect="cell"),
    Option("intra_size", (_value(("--intra-size",), "N", "ranks per node, to emulate several nodes on one machine "
                                 "(TacoMagics.intra_size, LIGHT_INTRA_SIZE); a change restarts the cluster"),),
           trait=Int, summary="ranks per node, to emulate several nodes on one machine", env="LIGHT_INTRA_SIZE",
           env_doc="LIGHT_INTRA_SIZE (read by the ranks)", check=checks.positive("ranks per node", int),
           effect="start"),
    Option("elastic", (_value(("--elastic",), "MIN:MAX", "when a rank dies, the survivors roll back to the last "
                              "taco.elastic.State commit and the cell runs again on them, while at least MIN remain "
                              "(a new cluster starts MAX ranks)"),)),
    Option("horovod", (Flag(("--horovod",), "the script is a Horovod PyTorch program, run with no edit: on its ranks "
                            "`import horovod` and `import horovod.torch as hvd` give taco's Horovod face (a cell "
                            "takes none: it imports taco_notebook.horovod)", action="store_true"),)),
    # the line form's script: the first word that is no option nor an option's value; every word after it is
    # the script's own, options of this magic included (`train.py --lr 0.1 -np 3` gives the script `-np 3`)
    Option("script", (Flag(("script",), "the line form's script (a cell takes none): a Python file, relative to the "
                           "working directory (the kernel's, in a notebook), run on every rank as `python SCRIPT "
                           "ARGS` (sys.argv, __name__ == '__main__', __file__); its source is sent to the ranks",
                           metavar="SCRIPT", nargs="?"),)),
    Option("script_args", (Flag(("script_args",), "the script's arguments: everything after SCRIPT, options of this "
                                "command included", metavar="ARGS", nargs=argparse.REMAINDER),)),
)
_BY_NAME = {row.name: row for row in OPTIONS}


def option(name: str) -> Option:
    """The row of option ``name`` (its dest and trait name)."""
    return _BY_NAME[name]


def flags_of(command: str) -> list[tuple[str, Flag]]:
    """(dest, flag) of every flag of ``command`` (``run`` or ``cluster``), in the order its help lists them."""
    return [(row.name, flag) for row in OPTIONS if command in row.commands for flag in row.flags]


def traits() -> list[Option]:
    """The rows that are ``TacoMagics`` traits."""
    return [row for row in OPTIONS if row.trait is not None]


def add_arguments(parser: argparse.ArgumentParser, command: str = "run") -> argparse.ArgumentParser:
    """Put ``command``'s options on a plain argparse ``parser``: ``taco-notebook launch`` takes ``%%taco_run``'s."""
    for dest, flag in flags_of(command):
        parser.add_argument(*flag.spellings, **flag.keywords(dest))
    return parser


_PAGE_HEAD = """\
<!-- Made by `python -m taco_notebook.plan.options > docs/options.md` from the option table in
taco_notebook/plan/options.py: change the table, then run that command (a test compares this page with it). -->

# Options

Every option of `%%taco_run` (and of `taco-notebook launch`, which takes the same), declared once. Most are also a
`TacoMagics` trait, set with `%config TacoMagics.compression = "fp16"` in a notebook or `c.TacoMagics.compression`
in `ipython_config.py` (`%config TacoMagics` lists them), and an environment variable. For each cell the option
wins, then the trait when set, then the environment (read when the cell runs), then the built-in default.
`%taco_cluster start|restart` takes the options marked *also %taco_cluster*. `taco-notebook launch` has no traits:
its defaults come from the environment, as a plain `mpiexec` job's would.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _spelled(flag: Flag) -> str:
    if not flag.spellings[0].startswith("-"):
        return f"`{flag.metavar}`"
    return ", ".join(f"`{spelling}{' ' + flag.metavar if flag.metavar else ''}`" for spelling in flag.spellings)


def _row(row: Option) -> str:
    flags = ", ".join(_spelled(flag) for flag in row.flags) or "-"
    trait = f"`{row.name}`" if row.trait is not None else "-"
    env = f"`{row.env}`" if row.env else "-"
    given = next((flag.default for flag in row.flags if isinstance(flag.default, str)), None)
    default = row.default or (f"`{given}`" if given else "-")
    return f"| {_cell(flags)} | {trait} | {env} | {_cell(default)} | {row.effect} |"


def _details(row: Option) -> list[str]:
    lines = [f"- **{row.name}**{' (also %taco_cluster)' if 'cluster' in row.commands else ''}:"]
    lines += [f"  {_spelled(flag)}: {flag.help}." if not flag.help.endswith(".") else f"  {_spelled(flag)}: {flag.help}"
              for flag in row.flags]
    if row.trait is not None:
        lines.append(f"  Trait `TacoMagics.{row.name}` ({row.trait.__name__}): {row.trait_help}.")
    return [lines[0] + lines[1][1:], *lines[2:]] if len(lines) > 1 else lines


def markdown() -> str:
    """The options reference page (``docs/options.md``): a table of every option, what each flag and trait does,
    and where each takes effect."""
    lines = [_PAGE_HEAD, "| option | trait (`TacoMagics.…`) | environment | default | takes effect |",
             "|---|---|---|---|---|", *(_row(row) for row in OPTIONS), "", "## What each does", ""]
    for row in OPTIONS:
        lines += _details(row)
    lines += ["", "## Where each takes effect", ""]
    lines += [f"- *{effect}*: {text}." for effect, text in EFFECTS.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
