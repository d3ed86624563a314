"""Report a cell: tell the cluster registry (and so the JupyterLab sidebar) what runs on a cluster and how far it
got, word the one-line summaries of how it failed (which ranks, which error), and render a rank's traceback."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ...errors import CellTimeoutError, RankDiedError, RankFailedError
from .result import RESULT_NAME

if TYPE_CHECKING:
    from ...model import RunModel
    from ..session import TacoCluster

__all__ = ["RegistryRun", "cell_snippet", "ranks_phrase", "were", "error_line", "error_kinds", "stalled_ranks",
           "cell_outcome", "render_traceback"]

SNIPPET_CHARS = 120
WRITE_EVERY_S = 0.5  # the sidebar polls every 0.5 s while a cell runs: its step stays within a second of the cell's
_IMPORT = re.compile(r"(import|from)\s+[\w.]+")


def cell_snippet(code: str) -> str:
    r"""What the sidebar calls the running cell: a comment that opens it (``# train the model``), else its first
    line that is neither an import nor a comment nor a magic, else its first non-blank line; shortened.

    >>> cell_snippet("from torch import nn\nimport time\n\nmodel = nn.Linear(2, 1)")
    'model = nn.Linear(2, 1)'
    >>> cell_snippet("# warm-up run\nimport torch\nx = 1")
    'warm-up run'
    """
    lines = [line.strip() for line in code.splitlines() if line.strip() and not line.strip().startswith("%")]
    named = lines[0].lstrip("#").strip() if lines and lines[0].startswith("#") else ""
    line = named or next((line for line in lines if not line.startswith("#") and not _IMPORT.match(line)), "") or \
        next((line.strip() for line in code.splitlines() if line.strip()), "")
    return line if len(line) <= SNIPPET_CHARS else line[: SNIPPET_CHARS - 1] + "…"


class RegistryRun:
    """A cell monitor: writes ``run`` (cell, step, total, samples/s) into the cluster's registry entry at most
    once a second, and clears it when the cell ends. It reads what the ranks publish but does not ask them to
    publish: with ``--no-dashboard`` the sidebar shows the cell and its start time only."""

    wants_metrics = False

    def __init__(self, cluster: TacoCluster, code: str) -> None:
        self.cluster = cluster
        self.run: RunModel = {"cell": cell_snippet(code), "started_at": time.time(), "step": 0, "total": None,
                         "samples_per_s": None}  # fmt: skip
        self.written = time.monotonic()
        cluster.set_run(self.run)

    def update(self, payloads: Mapping[int, Mapping[str, Any]], running: Sequence[int]) -> None:
        now = time.monotonic()
        if now - self.written < WRITE_EVERY_S:
            return
        from ...model import cell_progress  # the dashboard's definition too: the slowest rank's step

        progress = cell_progress(payloads)
        self.run = {"cell": self.run["cell"], "started_at": self.run["started_at"], "step": progress["step"],
                    "total": progress["total"], "samples_per_s": progress["samples_per_s"]}  # fmt: skip
        self.written = now
        self.cluster.set_run(self.run)

    def finish(self, outcome: str) -> None:
        self.cluster.set_run(None)


# an error in a one-line failure summary: whole clauses up to this many characters (a StallError's "rank 3 is at
# allreduce #55 ('ddp-bucket', 2)" needs about 140), else cut at a word
SUMMARY_ERROR_CHARS = 160


def ranks_phrase(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0, 1, 3``: the subject of a summary's clause, with the right number.

    >>> ranks_phrase([3]), ranks_phrase([3, 0])
    ('rank 3', 'ranks 0, 3')
    """
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(rank) for rank in sorted(ranks))


def were(ranks: Sequence[int]) -> str:
    """The verb that goes with :func:`ranks_phrase`."""
    return "was" if len(ranks) == 1 else "were"


def error_line(error: Any) -> str:
    """``ValueError: bad shard``: a remote error's name and the first line of its message, shortened to a line:
    to its whole ``; ``-separated clauses that fit, else at a word; ``…`` marks what was left out."""
    name = getattr(error, "ename", None) or type(error).__name__
    lines = str(getattr(error, "evalue", "") or "").strip().splitlines()
    text = f"{name}: {lines[0].strip()}" if lines else name
    more = len(lines) > 1
    if len(text) > SUMMARY_ERROR_CHARS:
        text, more = shorten(text, SUMMARY_ERROR_CHARS - 1), True
    return text + "…" if more else text


def shorten(text: str, limit: int) -> str:
    """``text``'s longest run of whole ``; ``-separated clauses within ``limit`` characters; if the first clause
    is longer, its words that fit (cut inside a word only when the words that fit would not fill half the line).

    >>> shorten("allreduce #5 stalled 3 s: rank 3 has not arrived; rank 3 is at allreduce #4; the fix", 75)
    'allreduce #5 stalled 3 s: rank 3 has not arrived; rank 3 is at allreduce #4'
    >>> shorten("allreduce #5 stalled 3 s: rank 3 has not arrived", 29)
    'allreduce #5 stalled 3 s:'
    """
    clauses = text.split("; ")
    kept = clauses[0]
    for clause in clauses[1:]:
        if len(kept) + 2 + len(clause) > limit:
            break
        kept += "; " + clause
    if len(kept) <= limit:
        return kept
    words = kept[: limit + 1].rsplit(" ", 1)[0]
    return words if len(words) >= limit // 2 else kept[:limit]


def error_kinds(errors: Mapping[int, Any]) -> str:
    """The distinct errors of the other failed ranks, each once: ``RuntimeError: Connection closed by peer``;
    which ranks raised which when they differ."""
    by_text: dict[str, list[int]] = {}
    for rank, error in sorted(errors.items()):
        by_text.setdefault(error_line(error), []).append(rank)
    if len(by_text) == 1:
        return next(iter(by_text))
    return "; ".join(f"{ranks_phrase(ranks)}: {text}" for text, ranks in by_text.items())


def stalled_ranks(errors: Mapping[int, Any]) -> list[int]:
    """The ranks that the ranks' StallErrors name as never having entered the stalled collective: what a cell's
    summary says stalled (the message is cut to a line, and a rank names at most its own view)."""
    from ...errors import StallError

    named = {rank for error in errors.values() if getattr(error, "ename", None) == "StallError"
             for rank in StallError.missing_in(str(getattr(error, "evalue", "")))}
    return sorted(named)

def cell_outcome(error: BaseException | None) -> str:
    """How a cell ended, in a few words for the dashboard's status line."""
    if error is None:
        return "finished"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    if isinstance(error, CellTimeoutError):
        return "timed out"
    if isinstance(error, RankFailedError):
        return f"failed: rank {error.first_rank} raised"
    if isinstance(error, RankDiedError):
        return f"failed: rank {error.rank} died" if error.rank is not None else "failed: a rank died"
    return f"failed: {type(error).__name__}"


# the kernel's rewrite of a cell's last expression (result.capture_last_expression), as a traceback quotes it
_RESULT_LINE = re.compile(rf"{RESULT_NAME} = \((.*)\)((?:\x1b\[[0-9;]*m)*)$")


def render_traceback(error: Any, origin: str | None = None) -> str:
    """A rank's traceback as text, quoting the cell's last line as the user wrote it, from the user's first frame
    on: the first frame in file ``origin`` when given (a script), else the cell's first frame (``Cell In[n]``).
    The frames before it are the engine's machinery that ran the code (``runner.run_cell``, IPython's
    ``run_code``), which the user did not write."""
    try:
        text = "\n".join(error.render_traceback()[1:])
    except Exception:
        return f"{type(error).__name__}: {error}"
    lines = [_RESULT_LINE.sub(r"\1\2", line) for line in text.splitlines()]
    plain = [_ANSI.sub("", line) for line in lines]
    if origin:
        first = next((i for i, line in enumerate(plain) if i and "File" in line and origin in line), None)
    else:
        first = next((i for i, line in enumerate(plain) if i and line.lstrip().startswith("Cell In[")), None)
    if first is None:
        return "\n".join(lines)
    return "\n".join([lines[0], *([""] if not plain[first - 1].strip() else []), *lines[first:]])


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def rank_failure(errors: Mapping[int, Any], killed: Sequence[int], targets: Sequence[int],
                 host: Callable[[int], str], origin: str | None = None) -> RankFailedError:
    """The error of a cell in which ranks raised (``errors``, the first seen first) and ``killed`` hung after:
    the first rank and its host, the stalled, the others that failed, the killed and the ranks that finished;
    every failed rank's traceback, the first's first."""
    first = next(iter(errors))
    message = f"rank {first} (host {host(first)}) raised {error_line(errors[first])}"
    others = {r: e for r, e in errors.items() if r != first}
    stalled = stalled_ranks(errors)
    if stalled:
        message += f"; {ranks_phrase(stalled)} stalled (never entered the collective the others waited in)"
    if others:
        message += f"; {ranks_phrase(list(others))} also failed ({error_kinds(others)})"
    if killed:
        message += f"; {ranks_phrase(killed)} hung after it and {were(killed)} killed"
    ok = [r for r in targets if r not in errors and r not in killed]
    if ok:
        message += f"; {ranks_phrase(ok)} finished"
    tracebacks = {r: render_traceback(e, origin) for r, e in errors.items()}
    tracebacks = {first: tracebacks[first], **{r: t for r, t in tracebacks.items() if r != first}}
    return RankFailedError(message, tracebacks, first_rank=first)
