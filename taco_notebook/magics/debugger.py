"""The debugger for N ranks: ``%taco_debug`` (pdb in a failed rank's frames), ``%taco_peek`` (an expression read
from every rank while a cell runs, also from another notebook) and ``%taco_diff`` (a value compared across ranks).

The notebook's side is :mod:`taco_notebook.cluster.debug`; this is its IPython face.
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..cluster.session import clusters
from ..plan.resolve import parse_targets
from .args import usage, usage_errors, wants_help
from .registry import registry_cluster

__all__ = ["TacoDebugMagics"]


def _unquoted(text: str) -> str:
    """An option's value without the quotes around it (IPython splits a magic's line keeping quotes)."""
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def _idle_cluster(name: str, magic: str) -> Any:
    cluster = clusters.get(name)
    if cluster is None or not cluster.running:
        raise UsageError(f"{magic} needs a running cluster of this kernel; no cluster named {name!r} runs here "
                         f"(running: {sorted(n for n, c in clusters.items() if c.running) or 'none'}; --cluster "
                         "NAME picks another)")
    return cluster


@magics_class
class TacoDebugMagics(Magics):
    """Registered with the other magics by ``%load_ext taco_notebook``."""

    @magic_arguments()
    @argument("--rank", type=int, default=None, metavar="R",
              help="the rank to debug (default: the first rank that failed)")
    @argument("-c", dest="commands", default=None, metavar="COMMANDS",
              help="pdb commands separated by ';' (\"p x; up; p y\"), run without a prompt")
    @argument("--cluster", default="default", metavar="NAME", help="the cluster (default: 'default')")
    @line_magic
    @usage_errors()
    def taco_debug(self, line: str) -> None:
        """pdb in the frames of the rank whose ``%%taco_run`` cell raised, as ``%debug`` does for the kernel's
        own: the prompt reads the kernel's stdin; ``-c`` runs commands without one. Each rank keeps its failed
        cell's frames until its next cell; the other ranks stay idle.

        Example: ``%taco_debug -c "p secret; up; p locals().keys()"``"""
        if wants_help(line):
            print(usage(self.taco_debug, "%taco_debug"))
            return
        from ..cluster.debug.postmortem import DebugError, failures, pick_rank, run_session, split_commands

        args = parse_argstring(self.taco_debug, line)
        cluster = _idle_cluster(args.cluster, "%taco_debug")
        commands = split_commands(_unquoted(args.commands)) if args.commands is not None else None
        if commands == []:
            raise UsageError("-c needs pdb commands, e.g. -c \"p x; up; p y\"")
        try:
            rank = pick_rank(failures(cluster), args.rank, args.cluster)
        except DebugError as exc:
            raise UsageError(str(exc)) from None
        run_session(cluster, rank, commands, input, lambda text: print(text, end="", flush=True))

    @magic_arguments()
    @argument("--cluster", default="default", metavar="NAME",
              help="the cluster: this kernel's, else a running one of the registry, by name or id (default: "
                   "'default')")
    @argument("--ranks", default=None, metavar="R", help="the ranks to ask ('0', '0,2', '1-3'; default: all)")
    @argument("--timeout", type=float, default=1.0, metavar="S",
              help="seconds each rank gets to evaluate the expression (at most 5; default 1)")
    @argument("expression", nargs="+", help="a Python expression, read in each rank's namespace")
    @line_magic
    @usage_errors()
    def taco_peek(self, line: str) -> Any:
        """Evaluate an expression on each rank while a cell runs there, without stopping it: from another
        notebook or a console (this kernel is busy running the cell), through each rank's listener thread.
        One line per distinct value, with its ranks. The expression sees the cell's variables and the locals of
        the function the rank is in.

        Example: ``%taco_peek --ranks 0-3 loss.item()``"""
        if wants_help(line):
            print(usage(self.taco_peek, "%taco_peek"))
            return None
        from ..model import PEEK_TIMEOUT_S
        args = parse_argstring(self.taco_peek, line)
        expression = " ".join(args.expression)
        if not 0 < args.timeout <= PEEK_TIMEOUT_S:
            raise UsageError(f"--timeout must be seconds in (0, {PEEK_TIMEOUT_S:g}], got {args.timeout:g}")
        print(_peek(args.cluster, expression, args.ranks, args.timeout)["text"])
        return None

    @magic_arguments()
    @argument("--cluster", default="default", metavar="NAME", help="the cluster (default: 'default')")
    @argument("expression", nargs="+", help="a Python expression, evaluated on every rank")
    @line_magic
    @usage_errors()
    def taco_diff(self, line: str) -> None:
        """Compare a value across ranks (tensors, arrays, numbers, modules, optimizers, containers of them; other
        objects by their pickle): the ranks on each side, and for a container the first key or index that
        differs. Only digests travel, not the values.

        Example: ``%taco_diff model`` names the first parameter that differs and the ranks that hold each."""
        if wants_help(line):
            print(usage(self.taco_diff, "%taco_diff"))
            return
        from ..cluster.debug.diff import DiffReport
        from ..engine.fingerprint import describe

        args = parse_argstring(self.taco_diff, line)
        cluster = _idle_cluster(args.cluster, "%taco_diff")
        expression = " ".join(args.expression)
        ranks = [info.rank for info in sorted(cluster.ranks, key=lambda r: r.rank)]
        trees = cluster.client[cluster.engine_ids(ranks)].apply_sync(describe, expression)
        print(DiffReport(expression, dict(zip(ranks, trees, strict=True))).text())


def _peek(name: str, expression: str, ranks: str | None, timeout: float) -> dict[str, Any]:
    """This kernel's cluster ``name`` when it runs, else the registry's running cluster of that name or id."""
    from ..cluster.cells.autopsy import launcher_of
    from ..cluster.debug.peek import peek
    from ..server.requests import parse_peek_request

    request = parse_peek_request({"expr": expression, "timeout": timeout})
    own = clusters.get(name)
    if own is not None and own.running:
        chosen = parse_targets(ranks, len(own.ranks), "--ranks")
        asked = [r for r in own.ranks if chosen is None or r.rank in chosen]
        return peek(asked, request["expr"], request["timeout"], launcher_of(own)).to_dict()
    with registry_cluster(name, "%taco_peek") as (manager, model):
        chosen = parse_targets(ranks, model["size"], "--ranks")
        answer: dict[str, Any] = manager.peek(model["id"], {**request, "ranks": chosen})
        return answer
