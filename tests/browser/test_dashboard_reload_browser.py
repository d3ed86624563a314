"""The dashboard survives a reload in the middle of a run (issue 25), in a real JupyterLab in a real chromium.

Save while ``%%taco_run`` trains, reload the page: the dashboard is there again (live while the kernel still runs
the cell), and once the cell ends its final picture is, in the page and in the notebook saved afterwards.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from .conftest import cell_output, code_cells, open_notebook, run_all_cells, wait_for_kernel_idle
from .test_dashboard_browser import STATIC, frame_sources, painted_canvases, static_frame

STEPS = 400
LONG_TRAIN = f"""%%taco_run -np 2
import time
model = torch.nn.Linear(64, 1)
opt = taco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                samples_per_step=32)
for step in taco.progress(range({STEPS})):
    x = torch.randn(32, 64)
    opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()
    time.sleep(0.05)
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


def _save_now(page, path: Path, timeout: float = 60.0) -> dict:
    before = path.stat().st_mtime_ns
    code_cells(page).nth(0).locator(".jp-InputArea-prompt").click()
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + timeout
    while path.stat().st_mtime_ns == before:
        if time.monotonic() > deadline:
            pytest.fail(f"{path.name} was not saved within {timeout:.0f} s")
        time.sleep(0.25)
    time.sleep(0.5)  # the contents manager writes, then renames
    return json.loads(path.read_text())


def test_a_notebook_saved_mid_run_and_reloaded_shows_the_dashboard_then_the_final_picture(lab, page):
    from playwright.sync_api import expect

    path = lab.write_notebook("midrun.ipynb", ["%load_ext taco_notebook", LONG_TRAIN])
    open_notebook(page, lab, "midrun.ipynb")
    run_all_cells(page)
    before = _wait_for_progress(page, 20, timeout=180)  # cluster start, then 20 steps

    saved = _save_now(page, path)  # the live view's output, mid-run
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in saved["cells"][1]["outputs"])
    page.reload()
    page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for(timeout=120_000)

    # live again: the progress moves on in the reloaded page while the kernel still runs the cell
    after = _wait_for_progress(page, before + 1, timeout=60)
    live = cell_output(page, 1).locator(".taco-dashboard")
    expect(live.first).to_be_visible(timeout=30_000)
    expect(live.first.locator(".taco-status")).to_contain_text("running")
    page.screenshot(path=str(Path(lab.root_dir) / "midrun-live.png"))

    wait_for_kernel_idle(page, timeout=240)  # the cell ended
    final = cell_output(page, 1).locator(STATIC).first
    expect(final).to_be_visible(timeout=60_000)
    expect(final.locator(".taco-progress-text")).to_contain_text(f"{STEPS}/{STEPS}")
    expect(final.locator(".taco-status")).to_contain_text("finished")
    frame = static_frame(page, 1)
    assert len(frame_sources(frame, ["taco-throughput"])["taco-throughput"]["time"]) >= 20
    painted_canvases(frame)
    assert "Loading widget" not in cell_output(page, 1).inner_text()

    resaved = _save_now(page, path)  # what the reloaded page keeps: the final picture
    html = [o for o in resaved["cells"][1]["outputs"] if "text/html" in o.get("data", {})]
    assert html and "taco-static-dashboard" in "".join(html[-1]["data"]["text/html"])
    print(f"mid-run reload: saved at step {before}, live again at {after}, then the final picture")
