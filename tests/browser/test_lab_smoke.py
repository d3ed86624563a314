"""Smoke tests of the browser harness: Lab opens, a kernel runs code, the ipywidgets manager renders widgets."""

from __future__ import annotations

import re

from .conftest import (
    cell_output,
    open_notebook,
    run_all_cells,
    wait_for_cell_output,
    wait_for_cells_executed,
    wait_for_kernel_idle,
)


def test_lab_runs_a_cell(lab, page):
    lab.write_notebook("smoke.ipynb", ["print(6*7)"])
    open_notebook(page, lab, "smoke.ipynb")
    run_all_cells(page)
    wait_for_cell_output(page, 0, "42", timeout=60)
    wait_for_cells_executed(page, timeout=30)
    wait_for_kernel_idle(page, timeout=30)


def test_ipywidgets_slider_renders(lab, page):
    lab.write_notebook(
        "widgets.ipynb",
        [
            # First cell after the kernel is idle: has the frontend's widget manager opened its control comm?
            "from ipywidgets import Widget\nprint('control comm:', Widget._control_comm is not None)",
            "import ipywidgets as w\nw.IntSlider(value=7, min=0, max=10, description='taco')",
        ],
    )
    open_notebook(page, lab, "widgets.ipynb")
    run_all_cells(page)
    wait_for_cell_output(page, 0, re.compile(r"control comm: (True|False)"), timeout=60)
    print(cell_output(page, 0).inner_text().strip())
    slider = cell_output(page, 1).locator(".widget-slider")
    slider.wait_for(state="visible", timeout=60_000)
    assert "taco" in slider.inner_text()
    assert cell_output(page, 1).locator(".widget-readout").inner_text().strip() == "7"
    # A live widget: its handle is a real, visible slider element, not the "Loading widget..." placeholder.
    assert slider.locator(".noUi-handle, .slider-handle, input[type=range]").count() > 0
