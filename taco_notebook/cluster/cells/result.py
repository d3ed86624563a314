"""The value of a cell's last expression, brought back from the ranks (kernel side).

Before sending a cell, the kernel rewrites its trailing expression into an assignment to
:data:`~.calls.RESULT_NAME` (:func:`capture_last_expression`); after the cell, ``calls.fetch_result`` reads
that name on each rank, and :func:`unwrap_result` turns what came back into what ``%%taco_run`` returns.
"""

from __future__ import annotations

import ast
from typing import Any

from ...engine.calls import RESULT_NAME, UNPICKLABLE

__all__ = ["RESULT_NAME", "capture_last_expression", "unwrap_result", "UnpicklableResult"]


def capture_last_expression(code: str) -> tuple[str, bool]:
    """Turn a trailing expression into an assignment to :data:`RESULT_NAME`, keeping line numbers.

    >>> capture_last_expression("x = 1\\nx + 1")
    ('x = 1\\n__taco_result__ = (x + 1)\\n', True)
    """
    from IPython.core.inputtransformer2 import TransformerManager

    python = TransformerManager().transform_cell(code)
    try:
        tree = ast.parse(python)
    except SyntaxError:
        return code, False  # the engine reports the syntax error with its own traceback
    if not tree.body or not isinstance(tree.body[-1], ast.Expr) or python.rstrip().endswith(";"):
        return python, False
    last = tree.body[-1]
    lines = python.splitlines(keepends=True)
    head = "".join(lines[: last.lineno - 1]) + lines[last.lineno - 1][: last.col_offset]
    expr = ast.get_source_segment(python, last)
    return f"{head}{RESULT_NAME} = ({expr})\n", True


class UnpicklableResult:
    """Stands for a rank's value that could not be sent back; shows its repr."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def unwrap_result(value: Any) -> Any:
    """What ``calls.fetch_result`` returned, with its unpicklable mark turned into an :class:`UnpicklableResult`."""
    if isinstance(value, tuple) and len(value) == 2 and value[0] == UNPICKLABLE:
        return UnpicklableResult(value[1])
    return value
