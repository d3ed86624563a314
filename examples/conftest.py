"""What a reader of the example notebooks is shown, checked cell by cell as nbval runs them.

nbval (``--nbval-lax``) fails a cell that raises; this adds what a reader would notice in the outputs of a cell
that ran: a NaN or inf anywhere, a traceback printed by our code or a rank, a ``[taco]`` warning or a Python
warning on stderr, and losses that do not fall (every number printed after the word "loss" in the cell, in
order: the last must be below the first).

A cell that shows a warning on purpose says which in its metadata, ``"taco": {"warns": "REGEX"}``: each warning
line must match REGEX, and at least one must be there.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

NON_FINITE = re.compile(r"(?<![\w.])[-+]?(?:nan|inf)(?![\w])", re.IGNORECASE)
LOSS = re.compile(r"\bloss\b\D{0,20}?([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)", re.IGNORECASE)
WARNING = re.compile(r"^(?:\[rank \d+\] )?(?:\[taco\]|.*\b\w*Warning\b)")


def _texts(outputs: list[Any]) -> Iterator[tuple[str, str]]:
    """(stream name or output type, text) for each output a reader sees as text."""
    for out in outputs:
        kind = out.get("output_type")
        if kind == "stream":
            yield out.get("name", "stdout"), str(out.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            text = data.get("text/plain") if "application/vnd.jupyter.widget-view+json" not in data else None
            if text is not None:
                yield kind, str(text) if not isinstance(text, list) else "".join(text)


def check_outputs(source: str, metadata: dict[str, Any], outputs: list[Any]) -> None:
    """Raise AssertionError naming what in ``outputs`` a reader should not be shown."""
    texts = list(_texts(outputs))
    shown = "\n".join(text for _, text in texts)
    head = source.splitlines()[0] if source else ""
    bad = NON_FINITE.findall(shown)
    assert not bad, f"cell `{head}` shows a non-finite number ({bad[0]}):\n{shown}"
    assert "Traceback (most recent call last)" not in shown, f"cell `{head}` prints a traceback:\n{shown}"
    expected = (metadata.get("taco") or {}).get("warns")
    warnings = [line for name, text in texts if name == "stderr" for line in text.splitlines() if WARNING.match(line)]
    if expected is None:
        assert not warnings, f"cell `{head}` warns:\n" + "\n".join(warnings)
    else:
        assert warnings, f"cell `{head}` should warn ({expected}) and did not:\n{shown}"
        stray = [line for line in warnings if not re.search(expected, line)]
        assert not stray, f"cell `{head}` warns other than {expected!r}:\n" + "\n".join(stray)
    losses = [float(value) for name, text in texts if name == "stdout" for value in LOSS.findall(text)]
    if len(losses) >= 2:
        assert losses[-1] < losses[0], f"cell `{head}`: the loss does not fall: {losses}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    result = yield
    cell = getattr(item, "cell", None)
    outputs = getattr(item, "test_outputs", None)
    if cell is not None and outputs is not None:
        check_outputs(cell.source, dict(cell.metadata), outputs)
    return result
