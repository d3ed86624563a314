"""The compression advisor: ``taco.tune(step, state)`` runs your own training step under each compression and
says which one, if any, pays on this cluster's links.

Each candidate (none, fp16, bf16, topk at two densities, powersgd at two ranks by default) trains ``steps``
steps after ``warmup`` untimed ones, each from the ``taco.elastic.State``'s last commit (restored once more at
the end, so tuning leaves model, optimizer and counters as committed), and is judged by its step time (the
slowest rank's median), wire bytes per step, cross-node rate (:mod:`.metrics`) and loss slope::

    state = taco.elastic.State(model=model, optimizer=opt, step=0)
    def step():                          # batches picked by a State counter: every trial sees the same ones
        x, y = batches[state.step % len(batches)]; state.step += 1
        opt.zero_grad(); loss = loss_fn(model(x), y); loss.backward(); opt.step()
        return loss
    result = taco.tune(step, state)      # the table; result.best is the recommended spec
    # later cells: %%taco_run --compression auto uses result.best (auto_choice() says so on the ranks)

A candidate *pays* when it is at least :data:`PAYS` times faster than none, sends at most :data:`SAVES` of its
bytes and its loss falls at least :data:`SLOPE_KEPT` as fast; the fastest that pays is recommended, else none,
with why. When none's own loss is not finite the step itself diverges: nothing is recommended or remembered.
Decisions use numbers reduced over the ranks, so every rank decides alike. The compression is switched where the
step takes it (:class:`_Switch`) and put back afterwards. Importable without IPython; the notebook
draws :class:`TuneResult` as an HTML table (:mod:`taco_notebook.widgets.tune`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..compression.spec import CompressionSpec

__all__ = ["tune", "Trial", "TuneResult", "advise", "remembered", "forget", "auto_choice",
           "DEFAULT_CANDIDATES", "PAYS", "SAVES", "SLOPE_KEPT", "AUTO"]

AUTO = "auto"  # %%taco_run --compression auto: the remembered choice (engine/calls.py asks auto_choice)
# PowerSGD without its warm-up: a trial of a few steps would otherwise never compress (it reduces uncompressed
# for `warmup` steps per tensor), and the spec recommended is the one measured.
DEFAULT_CANDIDATES = ("none", "fp16", "bf16", "topk:0.01", "topk:0.001", "powersgd:1:warmup=0",
                      "powersgd:4:warmup=0")
# A candidate must save at least 10% of the step: below that, run-to-run noise (and a shared host's) decides.
PAYS = 1.10
# ... and send at most 90% of none's bytes: one that sends as many (TopK and PowerSGD leave tensors under their
# size thresholds dense) cannot be faster but by noise ...
SAVES = 0.9
# ... and keep at least 80% of the uncompressed loss slope over the same steps from the same weights.
SLOPE_KEPT = 0.8
_remembered: dict[str, TuneResult] = {}


@dataclass(frozen=True)
class Trial:
    """One candidate's measurements, reduced over the ranks, and its verdict against none."""

    candidate: str
    step_seconds: float  # the slowest rank's median step time
    wire_bytes_per_step: float  # bytes that left a rank per step, averaged over the ranks
    link_bytes_per_s: float | None  # bytes per second of communication a rank sent to other nodes (max); None: one node
    losses: tuple[float, ...]  # the loss at each timed step, averaged over the ranks
    slope: float  # least-squares slope of ``losses`` per step
    speedup: float = 1.0  # none's step time / this one's
    relative_slope: float | None = None  # slope / none's slope; None when none's loss did not fall
    verdict: str = ""
    pays: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class TuneResult:
    """The advisor's table and its recommendation ``best`` (a compression spec's text; ``none`` when nothing
    pays, ``reason`` says why). ``str()``/``repr()`` is the text table; a notebook draws it as HTML."""

    trials: tuple[Trial, ...]
    best: str
    reason: str
    steps: int
    warmup: int
    ranks: int = 1
    nodes: int = 1
    made: float = field(default_factory=time.time)

    @property
    def baseline(self) -> Trial:
        return self.trials[0]

    @property
    def diverged(self) -> bool:
        """Whether the step diverged without compression (none's loss not finite): nothing is recommended."""
        return not all(math.isfinite(v) for v in self.baseline.losses)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per candidate (what the tables show), none first."""
        return [trial.as_dict() for trial in self.trials]

    def table(self) -> str:
        chosen = None if self.diverged else self.best
        header = ("candidate", "step time", "speed-up", "bytes/step", "link rate", "loss slope vs none", "verdict")
        rows = [header] + [(t.candidate, f"{t.step_seconds * 1e3:,.1f} ms", f"{t.speedup:.2f}x",
                            format_bytes(t.wire_bytes_per_step),
                            "-" if t.link_bytes_per_s is None else f"{format_bytes(t.link_bytes_per_s)}/s",
                            "-" if t.relative_slope is None else f"{t.relative_slope:.2f}",
                            ("* " if t.candidate == chosen else "") + t.verdict) for t in self.trials]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def summary(self) -> str:
        ranks, nodes = (f"{n} {w}{'s' if n != 1 else ''}" for n, w in ((self.ranks, "rank"), (self.nodes, "node")))
        verdict = "recommends nothing" if self.diverged else f"recommends {self.best}"
        return (f"taco.tune: {self.steps} timed steps (after {self.warmup} untimed) per candidate on {ranks}, "
                f"{nodes}; {verdict}: {self.reason}")

    def footer(self) -> str:
        """What ``--compression auto`` does after this result."""
        if self.diverged:
            return "--compression auto is unchanged: fix the step, then tune again."
        return f"--compression auto uses {self.best} on this cluster."

    def __str__(self) -> str:
        return f"{self.summary()}\n\n{self.table()}\n\n{self.footer()}"

    __repr__ = __str__

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython's text/plain: the table, not a repr
        printer.text(str(self))


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def slope(values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` against 0, 1, 2, … (0.0 for fewer than two)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(values)
    return sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values)) / sum((i - mean_x) ** 2 for i in range(n))


def advise(trials: Sequence[Trial], ranks: int = 1, nodes: int = 1, steps: int = 1,
           warmup: int = 0) -> TuneResult:
    """Verdicts and the recommendation from measured trials (none first): pure, so every rank decides alike."""
    base = trials[0]
    falling = base.slope < 0 and all(math.isfinite(v) for v in base.losses)
    judged = [_judge(t, base, falling) for t in trials]
    if not all(math.isfinite(v) for v in base.losses):
        return TuneResult(tuple(judged), "none", _why_diverged(judged), steps, warmup, ranks, nodes)
    paying = [t for t in judged[1:] if t.pays]
    if paying:
        best = max(paying, key=lambda t: t.speedup)
        reason = f"{best.speedup:.2f}x faster than none, {format_bytes(best.wire_bytes_per_step)} a step " \
                 f"instead of {format_bytes(base.wire_bytes_per_step)}"
        return TuneResult(tuple(judged), best.candidate, reason, steps, warmup, ranks, nodes)
    return TuneResult(tuple(judged), "none", _why_none(judged, base, nodes), steps, warmup, ranks, nodes)


def _judge(trial: Trial, base: Trial, falling: bool) -> Trial:
    speedup = base.step_seconds / trial.step_seconds if trial.step_seconds > 0 else 1.0
    relative = trial.slope / base.slope if falling else None
    if trial is base:
        finite = all(math.isfinite(v) for v in trial.losses)
        return _with(trial, 1.0, 1.0 if falling else None, "baseline" if finite else "loss not finite", False)
    if not all(math.isfinite(v) for v in trial.losses):
        return _with(trial, speedup, relative, "loss not finite", False)
    if relative is not None and relative < SLOPE_KEPT:
        return _with(trial, speedup, relative, f"loss falls slower ({relative:.2f} of none's)", False)
    if base.wire_bytes_per_step == 0:
        return _with(trial, speedup, relative, "nothing crosses the network", False)
    if trial.wire_bytes_per_step >= SAVES * base.wire_bytes_per_step:
        dense = " (tensors under its threshold go dense)" if trial.candidate.startswith(("topk", "powersgd")) else ""
        return _with(trial, speedup, relative, f"sends as much as none{dense}", False)
    if speedup < PAYS:
        return _with(trial, speedup, relative, "no faster" if speedup >= 1 / PAYS else "slower", False)
    return _with(trial, speedup, relative, "pays" if falling else "pays (loss not judged)", True)


def _with(trial: Trial, speedup: float, relative: float | None, verdict: str, pays: bool) -> Trial:
    return replace(trial, speedup=speedup, relative_slope=relative, verdict=verdict, pays=pays)


def _why_diverged(judged: Sequence[Trial]) -> str:
    finite = [t.candidate for t in judged[1:] if all(math.isfinite(v) for v in t.losses)]
    kept = "no candidate, none included, kept a finite loss" if not finite else \
        f"none's loss is not finite (only {', '.join(finite)} kept a finite one)"
    return (f"the step itself diverges: {kept}; a lower learning rate, gradient clipping or a loss that is "
            f"bounded below comes before choosing a compression")


def _why_none(judged: Sequence[Trial], base: Trial, nodes: int) -> str:
    fastest = max(judged[1:], key=lambda t: t.speedup, default=None)
    if fastest is None:
        return "no compressed candidate was tried"
    link = "" if base.link_bytes_per_s is None else f" (links moved {format_bytes(base.link_bytes_per_s)}/s)"
    if base.wire_bytes_per_step == 0:
        where = "nothing was sent (one rank: its gradients are the average)"
    elif nodes == 1:
        where = "all ranks share one node: gradients never cross a network link"
    elif fastest.speedup < PAYS:
        where = (f"communication is not the bottleneck{link}: fast links or a small model, so the bytes saved "
                 f"do not buy time")
    else:
        where = "the faster candidates slow the loss down"
    return f"compression does not pay here: {where}; the fastest, {fastest.candidate}, ran at " \
           f"{fastest.speedup:.2f}x ({fastest.verdict})"


# ------------------------------------------------------------ the rank side
def _check(step: Any, state: Any, steps: Any, warmup: Any) -> None:
    from .elastic import State

    if not isinstance(state, State):
        raise TypeError(f"taco.tune needs a taco.elastic.State holding the model and optimizer (trials restart "
                        f"from its last commit), got {type(state).__name__}: state = "
                        f"taco.elastic.State(model=model, optimizer=opt)")
    if state.model is None:
        raise ValueError("taco.tune's State has no model: make it taco.elastic.State(model=model, optimizer=opt)")
    if not callable(step):
        raise TypeError(f"taco.tune's step must be a function that trains one step and returns the loss, got "
                        f"{type(step).__name__}")
    for name, value, low in (("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"taco.tune's {name} must be an integer >= {low}, got {value!r}")


def _candidates(candidates: Iterable[CompressionSpec | str] | None) -> list[CompressionSpec]:
    """Parsed (a bad one fails naming itself), duplicates dropped, none first (the baseline)."""
    given = DEFAULT_CANDIDATES if candidates is None else candidates
    if isinstance(given, str | CompressionSpec):
        given = [given]
    specs: list[CompressionSpec] = [CompressionSpec()]
    for candidate in given:
        try:
            spec = CompressionSpec.parse(candidate)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"taco.tune: bad candidate {candidate!r}: {exc}") from None
        if spec not in specs:
            specs.append(spec)
    return specs


class _Switch:
    """Where a trial's compression is set: the DistributedOptimizer, a DDP hook's state, or the rank default."""

    def __init__(self, state: Any, hook_state: Any) -> None:
        from ..config import settings
        from .optimizer import DistributedOptimizer

        self.optimizer = state.optimizer if isinstance(state.optimizer, DistributedOptimizer) else None
        self.hook_state = hook_state
        if self.optimizer is not None:
            self.before: Any = self.optimizer.compression
        elif hook_state is not None:
            self.before = hook_state.compression
        else:
            self.before = settings().compression

    def set(self, spec: CompressionSpec | None) -> None:
        from ..config import configure

        if self.optimizer is not None:
            self.optimizer.set_compression(spec)
        elif self.hook_state is not None:
            self.hook_state.compression = spec
        else:
            configure(compression=spec or CompressionSpec())

    def put_back(self) -> None:
        self.set(self.before)


def _loss(value: Any) -> float:
    try:
        return float(value.detach()) if hasattr(value, "detach") else float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"taco.tune's step must return the loss (a number or a one-element tensor), got "
                        f"{type(value).__name__}") from None


def _cross_node(snapshot: dict[str, Any]) -> int:
    node = snapshot.get("node")
    return sum(n for dst, n in snapshot.get("sent_by_node", {}).items() if dst != node)


def _trial(step: Callable[[], Any], steps: int, warmup: int) -> tuple[list[float], list[float], dict[str, float]]:
    """Run one candidate: the timed steps' seconds and losses, and this rank's byte counts over them."""
    from ..diagnostics import metrics

    for _ in range(warmup):
        _loss(step())
    before = metrics.snapshot()
    seconds, losses = [], []
    for _ in range(steps):
        began = time.perf_counter()
        loss = _loss(step())  # a tensor's float() waits for the device: the step is done
        seconds.append(time.perf_counter() - began)
        losses.append(loss)
    after = metrics.snapshot()
    counts = {"wire": (after["wire_bytes"] - before["wire_bytes"]) / steps,
              "cross": float(_cross_node(after) - _cross_node(before)),
              "comm": after["comm_seconds"] - before["comm_seconds"]}
    return seconds, losses, counts


def _reduced(seconds: list[float], losses: list[float], counts: dict[str, float]) -> tuple[float, float, float,
                                                                                             list[float]]:
    """(slowest median step, mean wire bytes/step, fastest cross-node rate or nan, mean losses) over the ranks."""
    import torch

    from .. import size
    from ..collectives.ops import allreduce

    rate = counts["cross"] / counts["comm"] if counts["comm"] > 0 and counts["cross"] > 0 else 0.0
    peak = torch.tensor([statistics.median(seconds), rate], dtype=torch.float64)
    mean = torch.tensor([counts["wire"], *losses], dtype=torch.float64)
    if size() > 1:
        allreduce(peak, op="max")
        allreduce(mean, op="avg")
    values = mean.tolist()
    return float(peak[0]), values[0], float(peak[1]), values[1:]


def tune(step: Callable[[], Any], state: Any, candidates: Iterable[CompressionSpec | str] | None = None,
         steps: int = 5, warmup: int = 1, hook_state: Any = None, remember: bool = True) -> TuneResult:
    """Run ``step()`` (one training step, returning its loss) ``warmup + steps`` times under each candidate, from
    ``state``'s last commit each time, and recommend the compression that pays (collective: every rank calls it).

    ``candidates``: compression specs (text or :class:`CompressionSpec`; default :data:`DEFAULT_CANDIDATES`),
    none always measured first. Afterwards ``state`` is restored to its commit and the compression in force
    before is back; with ``remember`` the result is what ``--compression auto`` uses on this cluster.
    """
    _check(step, state, steps, warmup)
    specs = _candidates(candidates)
    from .. import topology

    switch = _Switch(state, hook_state)
    trials = []
    try:
        # none is timed again last, and its faster run kept: the first trial also pays the process's own
        # warm-up (allocator, threads, first collectives), which would flatter every candidate after it
        for spec in [*specs, *specs[:1]] if len(specs) > 1 else specs:
            state.restore()
            switch.set(spec)
            seconds, losses, counts = _trial(step, steps, warmup)
            median, wire, rate, mean_losses = _reduced(seconds, losses, counts)
            trials.append(Trial(spec.name, median, wire, rate if rate > 0 else None, tuple(mean_losses),
                                slope(mean_losses)))
    finally:
        state.restore()
        switch.put_back()
    if len(trials) > len(specs):
        again = trials.pop()
        trials[0] = replace(trials[0], step_seconds=min(trials[0].step_seconds, again.step_seconds))
    topo = topology()
    result = advise(trials, topo.size, topo.num_nodes, steps, warmup)
    if remember and not result.diverged:
        _remembered["result"] = result
    return result


def remembered() -> TuneResult | None:
    """The last :func:`tune` result this rank remembers (the cluster's, under ``%%taco_run``), or None."""
    return _remembered.get("result")


def forget() -> None:
    """Forget the remembered result (``--compression auto`` then runs uncompressed until the next tune)."""
    _remembered.pop("result", None)


def auto_choice() -> tuple[CompressionSpec, str]:
    """What ``auto`` means now: the remembered recommendation, else none; and a line saying which and why."""
    result = remembered()
    if result is None:
        chosen, why = CompressionSpec(), ("no taco.tune result on this cluster yet, so this runs uncompressed; "
                                          "call taco.tune(step, state) in a cell to measure every compression "
                                          "on your own step (auto then uses its choice)")
    else:
        chosen, why = CompressionSpec.parse(result.best), f"taco.tune's choice: {result.reason}"
    return chosen, f"--compression auto: {chosen.name} ({why})"
