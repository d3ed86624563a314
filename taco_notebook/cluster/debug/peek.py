"""``%taco_peek``: an expression evaluated on each rank while a cell runs there, one line per value.

Each rank's listener thread (the hang autopsy's, :mod:`taco_notebook.comm.diagnostics.listener`) evaluates it
(:mod:`taco_notebook.comm.diagnostics.peek`), so neither the ranks' main threads nor the notebook kernel that
runs the cell are needed: a second notebook, a console or the sidebar's server asks. The ranks are reached as
the autopsy reaches them (this host's sockets, one ssh per other host), all at once.

    >>> print(peek(cluster.ranks, "step").text())  # doctest: +SKIP
    step on 4 ranks, read in 0.01 s
    ranks 0-2: 1041
    rank 3: 1040
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..cells.autopsy import ask_ranks, rank_span

__all__ = ["LISTENER_SLACK_S", "PeekReport", "peek"]

LISTENER_SLACK_S = 1.0  # on top of the expression's own timeout: the listener's reply and the socket


@dataclass
class PeekReport:
    """Each asked rank's answer to ``expression``: ``("value", repr)``, ``("error", why)`` or ``("missing", why)``."""

    expression: str
    answers: dict[int, tuple[str, str]]
    seconds: float

    def text(self) -> str:
        """The expression and how long reading took, then one line per distinct answer, with its ranks."""
        lines = [f"{self.expression} on {len(self.answers)} rank{'s' if len(self.answers) != 1 else ''}, read in "
                 f"{self.seconds:.2f} s"]
        grouped: dict[tuple[str, str], list[int]] = {}
        for rank, answer in sorted(self.answers.items()):
            grouped.setdefault(answer, []).append(rank)
        for (kind, said), ranks in grouped.items():
            prefix = "no answer: " if kind == "missing" else ""  # an error says itself what happened
            lines.append(f"{rank_span(ranks)}: {prefix}{said}")
        return "\n".join(lines)

    def values(self) -> dict[int, str]:
        """The ranks that answered with a value, and its repr."""
        return {rank: said for rank, (kind, said) in self.answers.items() if kind == "value"}

    def to_dict(self) -> dict[str, Any]:
        return {"expression": self.expression, "seconds": round(self.seconds, 4), "text": self.text(),
                "ranks": [{"rank": rank, kind: said} for rank, (kind, said) in sorted(self.answers.items())]}

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text())

    def __str__(self) -> str:
        return self.text()


def _answer(found: dict[str, Any]) -> tuple[str, str]:
    reply = found.get("reply")
    if not isinstance(reply, dict) or not isinstance(reply.get("peek"), dict):
        return "missing", str(found.get("missing") or "the listener sent no peek answer (an older taco_notebook?)")
    said = reply["peek"]
    return ("value", str(said["value"])) if "value" in said else ("error", str(said.get("error")))


def peek(ranks: Sequence[Any], expression: str, timeout: float = 1.0,
         launcher_exec: str | None = None) -> PeekReport:
    """Evaluate ``expression`` on ``ranks`` (objects with ``rank``, ``pid``, ``host``), waiting at most
    ``timeout`` s for it on each (plus the listener's reply); never stops or waits for a cell."""
    from ...remote.autopsy_reader import peek_request

    began = time.monotonic()
    found = ask_ranks(sorted(ranks, key=lambda r: r.rank), timeout + LISTENER_SLACK_S, launcher_exec,
                      peek_request(expression, timeout))
    return PeekReport(expression, {rank: _answer(answer) for rank, answer in found.items()},
                      time.monotonic() - began)
