"""``taco-notebook launch -np 4 [options] train.py ARGS``: an existing script on every rank, from a shell.

horovodrun's shape on this project's clusters: the same options, checks, profiles (local, hosts, slurm, mpijob),
cluster start and wait loop as ``%taco_run -np 4 train.py ARGS`` in a notebook (:mod:`taco_notebook.plan.runplan`,
:func:`~taco_notebook.cluster.cells.run.run_script`), with every rank's output labelled ``[rank N]`` as it comes.
It starts a cluster of its own (named ``launch-PID`` unless ``--cluster`` names another; one started from the JupyterLab
sidebar under that name is used and left running) and stops what it started when the script ends, fails, is
interrupted (Ctrl-C, SIGTERM, SIGHUP) or cannot start.

Exit status: 0 when every rank finished; 1 when a rank raised, died or timed out (the first failing rank and its
traceback on stderr), or the cluster could not start; 2 for a usage mistake (before anything starts); 128 + the
signal after one (130 Ctrl-C, 143 SIGTERM). ``TacoMagics.*`` traits are the notebook's: here each option's
default comes from the environment (``LIGHT_TOPK_ALLREDUCE``, ``TACO_GPUS``…), as a plain ``mpiexec`` job's would.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["add_parser", "build_parser", "launch"]

USAGE_EXIT, FAILED_EXIT, INTERRUPTED_EXIT = 2, 1, 130
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the engines' tracebacks are coloured for a notebook


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """``launch [options] SCRIPT ARGS``."""
    parser = build_parser(subparsers.add_parser(
        "launch", help="run a Python script on every rank of a cluster (horovodrun's shape): launch -np 4 "
                       "train.py ARGS"))
    parser.set_defaults(run_command=lambda args: launch(args, parser))
    return parser


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``launch`` command's options: ``%%taco_run``'s, from the one option table (:mod:`..plan.options`)."""
    from ..plan.options import add_arguments

    parser.description = __doc__.split("\n\n")[0].replace("``", "")
    parser.epilog = ("Options go before SCRIPT; everything after it is the script's own (`launch -np 2 train.py "
                     "--lr 0.1 -np 3` gives train.py `--lr 0.1 -np 3`). Exit status: 0 every rank finished, 1 a "
                     "rank failed or the cluster did not start, 2 a usage mistake, 130 Ctrl-C (128 + the signal).")
    return add_arguments(parser, "run")


@contextmanager
def _signals_end_the_run() -> Iterator[None]:
    """SIGTERM and SIGHUP end the run as Ctrl-C does (the ranks are interrupted, then everything is stopped)."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def launch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``args.script`` on a cluster as the parsed ``args`` say; stop what was started; an exit status."""
    from ..cluster.cells.run import run_script
    from ..cluster.registry.attach import AttachedCluster
    from ..cluster.session import clusters
    from ..errors import OptionError, TacoError
    from ..plan.output import RankOutput
    from ..plan.runplan import plan_run, script_of
    from ..plan.settings import TacoSettings

    if args.cluster == "default":  # the magic's default name: a command of its own must not take a notebook's
        args.cluster = f"launch-{os.getpid()}"
    say = RankOutput(live=args.stream, quiet=args.quiet)
    there_before = clusters.get(args.cluster)
    try:
        with _signals_end_the_run():
            script = script_of(args, "launch")
            plan = plan_run(TacoSettings(), args, say)
            run_script(plan.cluster, script, plan.options, say)
        return 0
    except OptionError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return USAGE_EXIT
    except TacoError as exc:
        say.flush()
        text = "\n".join(exc._render_traceback_())
        print(text if sys.stderr.isatty() else ANSI.sub("", text), file=sys.stderr)
        return FAILED_EXIT
    except KeyboardInterrupt as exc:
        # what _signals_end_the_run raised for (a signal's name), else Ctrl-C (the run's CellInterrupted too)
        name = str(exc) if str(exc) in signal.Signals.__members__ else "SIGINT"
        say.warn(f"interrupted ({name}): stopping the cluster")
        return 128 + signal.Signals[name].value if name in signal.Signals.__members__ else INTERRUPTED_EXIT
    finally:
        started = clusters.get(args.cluster)  # a cluster that failed to start has stopped itself already
        if started is not None and started is not there_before and not isinstance(started, AttachedCluster):
            clusters.pop(args.cluster)
            started.stop()
