"""The command line: ``taco-notebook run|launch|doctor|emulate`` (also ``python -m taco_notebook …``).

One module per subcommand, each with ``add_parser(subparsers)`` (its options, and the function that runs it). The
commands go through the run-plan layer (:mod:`taco_notebook.plan`), never through the magics: a usage mistake
exits 2 with argparse's message.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from . import doctor, emulate, launch, run

__all__ = ["main", "build_parser", "PROG"]

PROG = "taco-notebook"
COMMANDS = (run, launch, doctor, emulate)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The top-level parser, one subcommand per module of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(prog=prog, description="taco_notebook from a shell: run a notebook headless, "
                                     "a script on every rank, the node report, or emulated nodes")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Run the command line; returns the exit status (2 for a usage mistake, as argparse's own)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    return int(args.run_command(args))
