"""The dashboard survives a reload in the middle of a run, in a real JupyterLab in a real chromium.

Save while ``%%taco_run`` trains, reload the page: while the cell still runs the live dashboard is back under it and
keeps moving (the wait loop answers the page's widget requests: ``ipp/comm_pump.py``), and once the cell ends
the final picture is under it (the live view's box holds it: ``Dashboard.close_live_views``).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from .conftest import (
    ARTIFACTS,
    cell_output,
    code_cells,
    open_notebook,
    run_all_cells,
    wait_for_cell_output,
    wait_for_kernel_idle,
)
from .test_dashboard_browser import (
    CANVAS_COLOURS_JS,
    DOCS,
    STATIC,
    _picture,
    frame_sources,
    painted_canvases,
    static_frame,
)

# a minute of training: the reload lands well before the cell's last half minute, where a reload still loses
# the live view (a known defect, not what this test is about)
STEPS = 600


def train_cell(steps: int) -> str:
    """A cell that trains ``steps`` steps of 0.1 s on 2 ranks, under the dashboard."""
    return f"""%%taco_run -np 2
import time
model = torch.nn.Linear(64, 1)
opt = taco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                samples_per_step=32)
for step in taco.progress(range({steps})):
    x = torch.randn(32, 64)
    opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()
    time.sleep(0.1)
"""


LONG_TRAIN = train_cell(STEPS)


def _progress(page, total: int = STEPS) -> int:
    """The step the dashboard's progress line shows under the training cell (0 before it shows)."""
    texts = cell_output(page, 1).locator(".taco-progress-text").all_inner_texts()
    found = [int(m.group(1)) for t in texts if (m := re.search(rf"(\d+)/{total}", t))]
    return max(found, default=0)


def _live_progress(page) -> int:
    """The step the live view's progress label shows (0 while no live view renders)."""
    texts = cell_output(page, 1).locator(".taco-dashboard .taco-progress-text").all_inner_texts()
    found = [int(m.group(1)) for t in texts if (m := re.search(rf"(\d+)/{STEPS}", t))]
    return max(found, default=0)


def _wait_for_live_progress(page, above: int, timeout: float) -> int:
    """Until the live view (not the final picture) shows a step above ``above``; fail if the cell ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cell_output(page, 1).locator(STATIC).count():
            text = cell_output(page, 1).inner_text(timeout=5_000)
            pytest.fail(f"the cell ended before the reloaded page showed the live dashboard past step {above}:\n"
                        f"{text[-3000:]}")
        n = _live_progress(page)
        if n > above:
            return n
        time.sleep(0.25)
    text = cell_output(page, 1).inner_text(timeout=5_000)
    pytest.fail(f"the reloaded page's live dashboard did not pass step {above} within {timeout:.0f} s:\n{text[-3000:]}")


def _live_canvases(page, timeout: float = 30.0) -> list[dict[str, int]]:
    """The live view's bokeh canvases, once one of them holds two colours or more."""
    live = cell_output(page, 1).locator(".taco-dashboard").first
    deadline = time.monotonic() + timeout
    canvases: list[dict[str, int]] = []
    while time.monotonic() < deadline:
        canvases = page.evaluate(CANVAS_COLOURS_JS, live.element_handle())
        if any(c["colours"] >= 2 for c in canvases):
            return canvases
        time.sleep(0.5)
    pytest.fail(f"the reloaded page's live bokeh canvases stayed blank: {canvases}")


def _wait_for_progress(page, at_least: int, timeout: float, total: int = STEPS) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = _progress(page, total)
        if n >= at_least:
            return n
        time.sleep(0.25)
    text = cell_output(page, 1).inner_text(timeout=5_000)
    pytest.fail(f"the dashboard's progress did not reach {at_least}/{total} within {timeout:.0f} s:\n{text[-3000:]}")


def _save_now(page, path: Path, holds: str, timeout: float = 60.0) -> dict:
    """Save the notebook (Ctrl+S, again every 3 s: a busy page may drop the shortcut) and return it as written once
    the training cell's outputs hold ``holds``."""
    deadline = time.monotonic() + timeout
    pressed = 0.0
    while True:
        if time.monotonic() - pressed > 3:
            code_cells(page).nth(0).locator(".jp-InputArea-prompt").click()
            page.keyboard.press("Control+s")
            pressed = time.monotonic()
        try:
            saved = json.loads(path.read_text())
        except ValueError:  # caught between the write and the rename
            saved = None
        if saved is not None and holds in json.dumps(saved["cells"][1]["outputs"]):
            return saved
        if time.monotonic() > deadline:
            pytest.fail(f"{path.name} was not saved with {holds!r} in the training cell within {timeout:.0f} s")
        time.sleep(0.5)


@pytest.mark.xfail(strict=False, reason="known defect: after the example-02 test in the same server, the reloaded "
                   "page's widget restore (ipywidgets' control comm, answered mid-cell by ipp/comm_pump.py) falls "
                   "back after ~1 s and never completes ('Loading widget...'); 40d71e0 and 8f065e6 fail alike, "
                   "the test passes alone")
def test_a_notebook_saved_mid_run_and_reloaded_shows_the_live_dashboard_then_the_final_picture(lab, page):
    from playwright.sync_api import expect

    path = lab.write_notebook("midrun.ipynb", ["%load_ext taco_notebook", LONG_TRAIN])
    open_notebook(page, lab, "midrun.ipynb")
    run_all_cells(page)
    before = _wait_for_progress(page, 20, timeout=180)  # cluster start, then 20 steps

    _save_now(page, path, "application/vnd.jupyter.widget-view+json")  # the live view's output, mid-run
    saved_at = _progress(page)
    page.reload()
    reloaded = time.monotonic()
    page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for(timeout=120_000)

    wait_for_cell_output(page, 1, "cluster 'default' ready", timeout=60)  # the reloaded page shows the saved output
    # While the cell still runs: the live view is back (not "Loading widget..."), painted, and it moves.
    first = _wait_for_live_progress(page, saved_at, timeout=90)
    shown_after = time.monotonic() - reloaded
    expect(cell_output(page, 1).locator(".taco-dashboard").first).to_be_visible()
    assert "Loading widget" not in cell_output(page, 1).inner_text()
    _live_canvases(page)
    live_times = frame_sources(page.main_frame, ["taco-throughput"])["taco-throughput"]["time"]
    later = _wait_for_live_progress(page, first, timeout=60)
    assert later < STEPS and not cell_output(page, 1).locator(STATIC).count()
    ARTIFACTS.mkdir(exist_ok=True)
    code_cells(page).nth(1).screenshot(path=str(ARTIFACTS / "dashboard-live-after-reload.png"))

    wait_for_kernel_idle(page, timeout=240)  # the cell ended
    final = cell_output(page, 1).locator(STATIC).first
    expect(final).to_be_visible(timeout=60_000)
    expect(final.locator(".taco-progress-text")).to_contain_text(f"{STEPS}/{STEPS}")
    expect(final.locator(".taco-status")).to_contain_text("finished")
    frame = static_frame(page, 1)
    final_times = frame_sources(frame, ["taco-throughput"])["taco-throughput"]["time"]
    assert len(final_times) >= 20
    assert live_times and live_times[0] < final_times[0] + 1, (
        f"the reloaded live plot starts at {live_times[:1]} s, the run at {final_times[0]} s: it lost the points "
        "streamed before the reload")
    painted_canvases(frame)
    assert "Loading widget" not in cell_output(page, 1).inner_text()

    _picture(page, 1, DOCS / "dashboard-long-run.png")  # a long run's final picture, for the docs
    print(f"mid-run reload: saved at step {saved_at} (first seen {before}); after the reload the live view showed "
          f"step {first} {shown_after:.1f} s later, then {later}, its plot from {live_times[0]:.2f} s "
          f"({len(live_times)} points); the final picture at the end")


VISIBLE_FIGURES_JS = """
() => {
  const out = [];
  for (const doc of (window.Bokeh?.documents || []))
    for (const model of doc.all_models)
      if (model.type === 'Figure' && model.visible) out.push(model.title?.text ?? '');
  return out;
}
"""


def test_a_loop_that_sends_nothing_shows_its_progress_and_step_rate_only(lab, page):
    """The final picture holds progress and step rate only: no dashboard of empty plots, no "step 0" beside "85/600"."""
    from playwright.sync_api import expect

    loop = "%%taco_run -np 2\nimport time\nfor i in taco.progress(range(300)):\n    time.sleep(0.01)\n"
    lab.write_notebook("quiet.ipynb", ["%load_ext taco_notebook", loop])
    open_notebook(page, lab, "quiet.ipynb")
    run_all_cells(page)
    final = cell_output(page, 1).locator(STATIC).first
    expect(final).to_be_visible(timeout=240_000)
    wait_for_kernel_idle(page, timeout=60)
    expect(final.locator(".taco-status")).to_contain_text(" · step 300 · ")  # the progress line's step
    expect(final.locator(".taco-progress-text")).to_contain_text("300/300")
    frame = static_frame(page, 1)
    points = frame_sources(frame, ["taco-throughput"])["taco-throughput"]["total"]
    assert len(points) >= 20 and points[-1] > 0, points
    painted_canvases(frame)
    shown = frame.evaluate(VISIBLE_FIGURES_JS)
    assert len(shown) == 1 and shown[0].startswith("Step rate (steps/s"), f"figures shown: {shown}"
    _picture(page, 1, DOCS / "dashboard-no-communication.png")


LATE_STEPS = 150
LATE_TRAIN = train_cell(LATE_STEPS)


@pytest.mark.xfail(strict=False, reason="known defect: the reloaded page restores its widgets through ipywidgets' "
                   "control comm (4 s to answer, 1.7 MB of bokeh state here); when that fails around the cell's end "
                   "the page gives up ('model not found'), 1 of 3 runs on 2 loaded cores")
def test_a_reload_in_the_last_seconds_of_a_cell_shows_the_final_picture(lab, page):
    """Saved mid-run (as autosave does), reloaded with about 3 s of the cell left: the cell ends while the page is
    away or fetching its widgets, and the reloaded page shows the final picture, not "Loading widget..."."""
    from playwright.sync_api import expect

    path = lab.write_notebook("late.ipynb", ["%load_ext taco_notebook", LATE_TRAIN])
    open_notebook(page, lab, "late.ipynb")
    run_all_cells(page)
    _wait_for_progress(page, 20, timeout=180, total=LATE_STEPS)
    _save_now(page, path, "application/vnd.jupyter.widget-view+json")
    reloaded_at = _wait_for_progress(page, LATE_STEPS - 30, timeout=120, total=LATE_STEPS)  # ~3 s left
    assert reloaded_at < LATE_STEPS, "the page saw the cell's end before the reload: not the case under test"
    page.reload()
    page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for(timeout=120_000)
    wait_for_kernel_idle(page, timeout=240)
    final = cell_output(page, 1).locator(STATIC).first
    expect(final).to_be_visible(timeout=90_000)
    expect(final.locator(".taco-progress-text")).to_contain_text(f"{LATE_STEPS}/{LATE_STEPS}")
    expect(final.locator(".taco-status")).to_contain_text("finished")
    assert "Loading widget" not in cell_output(page, 1).inner_text()
    ARTIFACTS.mkdir(exist_ok=True)
    code_cells(page).nth(1).screenshot(path=str(ARTIFACTS / "dashboard-reloaded-at-the-end.png"))
    print(f"reloaded at step {reloaded_at}/{LATE_STEPS}; the final picture shows after the reload")
