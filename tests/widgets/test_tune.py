"""The advisor's table drawn as HTML (what a notebook shows for ``taco.tune``'s result)."""

from __future__ import annotations

from taco_notebook.comm.training.advisor import Trial, advise, slope
from taco_notebook.widgets.tune import tune_html


def test_the_table_has_every_candidate_and_highlights_the_recommendation() -> None:
    losses = (2.0, 1.8, 1.6)
    trials = [Trial(name, seconds, wire, 1.2e8, losses, slope(losses))
              for name, seconds, wire in (("none", 1.0, 1e8), ("fp16", 0.6, 5e7), ("bf16", 0.98, 5e7))]
    result = advise(trials, ranks=4, nodes=2, steps=3)
    html = tune_html(result)
    assert html.count("<tr") == 4 and "speed-up" in html and "loss slope vs none" in html
    assert "<b>fp16</b>" in html and "1.67x" in html and "50.0 MB" in html and "120.0 MB/s" in html
    assert "<code>--compression auto</code> uses <b>fp16</b>" in html
    assert "no faster" in html and "#fbeaea" in html  # bf16's row, refused


def test_a_diverged_step_highlights_nothing_and_leaves_auto_unchanged() -> None:
    losses = (1.0, float("nan"), float("nan"))
    trials = [Trial(name, 1.0, 1e8, 1.2e8, losses, slope(losses)) for name in ("none", "fp16")]
    html = tune_html(advise(trials, ranks=4, nodes=2, steps=3))
    assert "recommends nothing" in html and "<b>" not in html.split("</table>")[0]
    assert "<code>--compression auto</code> is unchanged: fix the step, then tune again." in html
