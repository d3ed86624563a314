"""The dashboard survives a reload in the middle of a run (issue 25), in a real JupyterLab in a real chromium.

Save while ``%%taco_run`` trains, reload the page: once the cell ends the final picture is under it. The page
restores the saved live view's widget from the kernel, and the kernel answers a page's widget requests (shell
messages: ``comm_info_request``, ``request_state``) only between cells, so while the cell still runs the reloaded
page shows JupyterLab's "Loading widget..." placeholder; at the end it finds the live view's box holding the final
picture (``Dashboard.close_live_views``), not a closed model.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from .conftest import (
    cell_output,
    code_cells,
    open_notebook,
    run_all_cells,
    wait_for_cell_output,
    wait_for_kernel_idle,
)
from .test_dashboard_browser import DOCS, STATIC, _picture, frame_sources, painted_canvases, static_frame

STEPS = 300
LONG_TRAIN = f"""%%taco_run -np 2
import time
model = torch.nn.Linear(64, 1)
opt = taco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                samples_per_step=32)
for step in taco.progress(range({STEPS})):
    x = torch.randn(32, 64)
    opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()
    time.sleep(0.1)
"""


def _progress(page) -> int:
    """The step the dashboard's progress line shows under the training cell (0 before it shows)."""
    texts = cell_output(page, 1).locator(".taco-progress-text").all_inner_texts()
    found = [int(m.group(1)) for t in texts if (m := re.search(rf"(\d+)/{STEPS}", t))]
    return max(found, default=0)


def _wait_for_progress(page, at_least: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = _progress(page)
        if n >= at_least:
            return n
        time.sleep(0.5)
    text = cell_output(page, 1).inner_text(timeout=5_000)
    pytest.fail(f"the dashboard's progress did not reach {at_least}/{STEPS} within {timeout:.0f} s:\n{text[-3000:]}")


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


def test_a_notebook_saved_mid_run_and_reloaded_shows_the_dashboard_then_the_final_picture(lab, page):
    from playwright.sync_api import expect

    path = lab.write_notebook("midrun.ipynb", ["%load_ext taco_notebook", LONG_TRAIN])
    open_notebook(page, lab, "midrun.ipynb")
    run_all_cells(page)
    before = _wait_for_progress(page, 20, timeout=180)  # cluster start, then 20 steps

    _save_now(page, path, "application/vnd.jupyter.widget-view+json")  # the live view's output, mid-run
    page.reload()
    page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for(timeout=120_000)

    wait_for_cell_output(page, 1, "cluster 'default' ready", timeout=60)  # the reloaded page shows the saved output
    wait_for_kernel_idle(page, timeout=240)  # the cell ended
    final = cell_output(page, 1).locator(STATIC).first
    expect(final).to_be_visible(timeout=60_000)
    expect(final.locator(".taco-progress-text")).to_contain_text(f"{STEPS}/{STEPS}")
    expect(final.locator(".taco-status")).to_contain_text("finished")
    frame = static_frame(page, 1)
    assert len(frame_sources(frame, ["taco-throughput"])["taco-throughput"]["time"]) >= 20
    painted_canvases(frame)
    assert "Loading widget" not in cell_output(page, 1).inner_text()

    _picture(page, 1, DOCS / "dashboard-long-run.png")  # a 300-step run's final picture, for the docs
    print(f"mid-run reload: saved at step {before}; after the reload, the final picture at the cell's end")


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
    """Issue 25: such a loop got a full dashboard of empty plots and "step 0" beside "85/600"."""
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
