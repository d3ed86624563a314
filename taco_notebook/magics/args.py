"""Argument stacks shared by the magics (made from the option table, :mod:`taco_notebook.plan.options`), their
help, and the boundary that shows the plan layer's :class:`~taco_notebook.errors.OptionError` as a ``UsageError``.

The options are checked and resolved (option, else trait, else environment) by :mod:`taco_notebook.plan.resolve`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

from ..errors import OptionError
from ..plan.options import flags_of

__all__ = ["cluster_args", "run_args", "usage_errors", "wants_help", "usage", "run_wants_help"]


def _stack(*decorators: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def apply(func: Any) -> Any:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


def _arguments(command: str) -> Callable[[Any], Any]:
    """The magic_arguments stack of ``command``'s flags, made from the option table
    (:func:`taco_notebook.plan.options.flags_of`)."""
    return _stack(*(argument(*flag.spellings, **flag.keywords(dest)) for dest, flag in flags_of(command)))


cluster_args = _arguments("cluster")  # where %taco_cluster start/restart runs: also %%taco_run's
run_args = _arguments("run")


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
    """The plan layer's :class:`~taco_notebook.errors.OptionError` as IPython's ``UsageError``: the same message,
    shown without a traceback."""
    try:
        yield
    except OptionError as exc:
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
