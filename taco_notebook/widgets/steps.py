"""A rank's step time as its bar shows it, and the straggler, from the steps themselves.

Each snapshot carries the rank's latest steps (``recent_steps``: wall seconds from the previous step's end, of
which inside collectives, and blocked on them; :mod:`taco_notebook.comm.diagnostics.metrics`). The bar is their
median: the step after an evaluation, which also timed the evaluation, is one of 32 and moves it not; the time
after the last step belongs to no step at all.

Example::

    split = step_split(snapshot["recent_steps"])      # (compute alone, overlapped communication, wait) or None
    slowest = straggler({r: sum(s) for r, s in splits.items()}, {r: s[0] for r, s in splits.items()})
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

__all__ = ["step_split", "straggler"]


def _parts(seconds: float, comm: float, wait: float) -> tuple[float, float]:
    """(overlapped communication, wait) of one step: communication beyond the wait ran while the rank computed."""
    busy = max(seconds - wait, 0.0)
    return min(max(comm - wait, 0.0), busy), wait


def step_split(recent: Sequence[Sequence[float]] | None) -> tuple[float, float, float] | None:
    """(compute alone, overlapped communication, wait) of a typical recent step, summing to the median step's
    seconds: the median wait, the median overlap, compute the rest; None without a timed step.

    >>> step_split([[0.1, 0.02, 0.01], [0.1, 0.02, 0.01], [2.5, 0.02, 0.01]])  # the last one timed an evaluation
    (0.08, 0.01, 0.01)
    """
    steps = [(float(s[0]), *_parts(float(s[0]), float(s[1]), float(s[2]))) for s in recent or () if len(s) >= 3]
    if not steps:
        return None
    seconds = statistics.median(s[0] for s in steps)
    overlapped = statistics.median(s[1] for s in steps)
    wait = statistics.median(s[2] for s in steps)
    compute = max(seconds - overlapped - wait, 0.0)
    return round(compute, 9), round(overlapped, 9), round(wait, 9)


def straggler(seconds: Mapping[int, float], compute: Mapping[int, float] | None = None) -> int | None:
    """THE straggler, for the bars' outline, their "slowest" label and the text summary alike: the rank with the
    tallest bar (the most ``seconds`` per step); among bars of one height (synchronous training evens them out)
    the one with the most ``compute``, which its peers wait for; then the lowest rank. None before any step."""
    timed = {rank: s for rank, s in seconds.items() if s > 0}
    busy = compute or {}
    return min(timed, key=lambda r: (-round(timed[r], 9), -busy.get(r, 0.0), r)) if timed else None
