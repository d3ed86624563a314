"""The live training dashboard of ``%%taco_run``, in a real JupyterLab in a real chromium.

Contract under test: under a ``%%taco_run`` cell the kernel shows an ipywidgets dashboard, root class
``taco-dashboard``, with an ``IntProgress`` of class ``taco-progress``, an HTML label ``.taco-progress-text``
(``k/N`` and a percentage), a status line ``.taco-status`` naming the ``ranks``, and jupyter_bokeh plots whose data
sources are named ``taco-throughput`` and ``taco-compression``; all of it updates while the cell runs. When the cell
ends, the live view is replaced by ``.taco-static-dashboard``: the same ``.taco-status`` and ``.taco-progress-text``
lines over an ``iframe.taco-static-plots`` holding a standalone bokeh page with the same named sources. It shows
after a page reload and is what the saved notebook keeps.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import (
    REPO,
    cell_output,
    code_cells,
    open_notebook,
    run_all_cells,
    wait_for_cells_executed,
    wait_for_kernel_idle,
)

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
STATIC = ".taco-static-dashboard"
FRAME = "iframe.taco-static-plots"

STEPS = 60
TRAIN_CELL = f"""%%taco_run -np 2
import time
model = torch.nn.Linear(64, 1)
opt = taco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
for step in taco.progress(range({STEPS})):
    x = torch.randn(32, 64)
    opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()
    time.sleep(0.05)
"""

# Records every distinct text of `.taco-progress-text` (with whether cell 2 was still running then) from the moment
# it is installed, so updates between two polls cannot be missed.
WATCH_PROGRESS_JS = """
() => {
  window.__tacoProgress = [];
  const cellRunning = () => {
    const cells = document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell');
    const prompt = cells.length > 1 ? cells[1].querySelector('.jp-InputArea-prompt') : null;
    return prompt != null && prompt.textContent.includes('*');
  };
  const record = () => {
    const el = document.querySelector('.taco-progress-text');
    if (el == null) return;
    const text = el.textContent.trim();
    const seen = window.__tacoProgress;
    if (seen.length === 0 || seen[seen.length - 1].text !== text)
      seen.push({text, running: cellRunning(), t: performance.now()});
  };
  new MutationObserver(record).observe(document.body, {subtree: true, childList: true, characterData: true,
                                                        attributes: true});
  record();
}
"""

# Rows of the named bokeh data sources: over window.Bokeh.documents (every BokehJS Document registers itself
# there on construction, jupyter_bokeh's included), falling back to the documents of the root views in Bokeh.index.
SOURCE_ROWS_JS = """
(names) => {
  const B = window.Bokeh;
  if (B == null) return {error: 'window.Bokeh is undefined: BokehJS never loaded'};
  const docs = new Set(B.documents || []);
  const from_documents = docs.size;
  try { for (const view of (B.index || [])) if (view.model && view.model.document) docs.add(view.model.document); }
  catch (e) { /* no view index in this BokehJS */ }
  const rows = {};
  for (const name of names) {
    for (const doc of docs) {
      let model = null;
      try { model = doc.get_model_by_name(name); } catch (e) { rows[name] = 'error: ' + e; continue; }
      if (model == null) continue;
      let n;
      if (typeof model.get_length === 'function') n = model.get_length();
      if (n == null) {
        const data = model.data;
        const columns = data instanceof Map ? [...data.values()] : Object.values(data || {});
        n = columns.length ? columns[0].length : 0;
      }
      rows[name] = Math.max(typeof rows[name] === 'number' ? rows[name] : 0, n ?? 0);
    }
  }
  return {rows, documents: docs.size, from_documents, version: B.version};
}
"""

# Canvases under the dashboard (BokehJS 3 draws inside open shadow roots) and how many distinct colours each holds.
CANVAS_COLOURS_JS = """
(root) => {
  const canvases = [];
  const walk = (node) => {
    if (node.tagName === 'CANVAS') canvases.push(node);
    if (node.shadowRoot) walk(node.shadowRoot);
    for (const child of node.children || []) walk(child);
  };
  walk(root);
  return canvases.map((canvas) => {
    const out = {width: canvas.width, height: canvas.height, colours: 0};
    if (!canvas.width || !canvas.height) return out;
    const ctx = canvas.getContext('2d');
    if (ctx == null) { out.colours = -1; return out; }  // a WebGL canvas: not read here
    const pixels = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
    const colours = new Set();
    const stride = 4 * Math.max(1, Math.floor(pixels.length / 4 / 200000));
    for (let i = 0; i < pixels.length && colours.size < 64; i += stride)
      colours.add((pixels[i] << 24) ^ (pixels[i + 1] << 16) ^ (pixels[i + 2] << 8) ^ pixels[i + 3]);
    out.colours = colours.size;
    return out;
  });
}
"""


# The named sources' columns (as plain arrays) in this frame's BokehJS documents.
SOURCE_DATA_JS = """
(names) => {
  const B = window.Bokeh;
  if (B == null) return null;
  const out = {};
  for (const doc of (B.documents || [])) {
    for (const name of names) {
      const model = doc.get_model_by_name(name);
      if (model == null) continue;
      const data = model.data;
      const entries = data instanceof Map ? [...data.entries()] : Object.entries(data || {});
      const plain = (column) => Array.from(column, (x) => (typeof x === 'number' ? x : null));
      out[name] = Object.fromEntries(entries.map(([k, v]) => [k, plain(v)]));
    }
  }
  return Object.keys(out).length === names.length ? out : null;
}
"""

# Text anywhere in the page (outputs included) that says a widget view could not be made, recorded as it appears.
WATCH_ERRORS_JS = """
() => {
  window.__tacoErrors = [];
  const check = () => {
    const text = document.body.innerText || '';
    for (const needle of ['Failed to create view', "reading 'require'", 'Error displaying widget'])
      if (text.includes(needle) && !window.__tacoErrors.includes(needle)) window.__tacoErrors.push(needle);
  };
  new MutationObserver(check).observe(document.body, {subtree: true, childList: true, characterData: true});
  check();
}
"""


def static_frame(page, index: int, timeout: float = 60.0) -> Any:
    """The frame of the final picture under the ``index``-th code cell, once its BokehJS has embedded the plots."""
    frame_element = cell_output(page, index).locator(FRAME).first
    frame_element.wait_for(state="attached", timeout=timeout * 1000)
    frame_element.scroll_into_view_if_needed()
    frame = frame_element.element_handle().content_frame()
    assert frame is not None, "the final picture's iframe has no document"
    return frame


def frame_sources(frame, names: list[str], timeout: float = 60.0) -> dict[str, dict[str, list[Any]]]:
    """Columns of the named bokeh sources inside a final picture's frame (polls until BokehJS built them)."""
    deadline = time.monotonic() + timeout
    while True:
        found = frame.evaluate(SOURCE_DATA_JS, names)
        if found is not None:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"no bokeh sources {names} in the final picture's frame within {timeout:.0f} s")
        time.sleep(0.5)


def painted_canvases(frame, timeout: float = 30.0) -> list[dict[str, int]]:
    """The frame's canvases, once at least one holds two colours or more (BokehJS paints on an animation frame)."""
    deadline = time.monotonic() + timeout
    canvases: list[dict[str, int]] = []
    while time.monotonic() < deadline:
        canvases = frame.evaluate(CANVAS_COLOURS_JS, frame.locator("body").element_handle())
        if any(c["colours"] >= 2 for c in canvases):
            return canvases
        time.sleep(0.5)
    pytest.fail(f"the final picture's bokeh canvases stayed blank: {canvases}")


def strictly_increasing(values: list[Any]) -> bool:
    return all(a < b for a, b in zip(values, values[1:], strict=False))


def _fail_with_output(page, what: str) -> None:
    try:
        text = cell_output(page, 1).inner_text(timeout=5_000)
    except Exception as exc:  # noqa: BLE001 - the page may be gone
        text = f"<could not read the cell's output: {exc!r}>"
    pytest.fail(f"{what}\n--- output of the %%taco_run cell ---\n{text[-4000:]}")


def _wait_for_dashboard(page, timeout: float) -> None:
    """Until ``.taco-dashboard`` (or, the cell over already, its final picture) shows under the cell; fail at once
    if the cell ends without one."""
    dashboard = cell_output(page, 1).locator(f".taco-dashboard, {STATIC}")
    prompt = code_cells(page).nth(1).locator(".jp-InputArea-prompt")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dashboard.count() and dashboard.first.is_visible():
            return
        if re.fullmatch(r"\[\d+\]:?", prompt.inner_text().strip()):
            # the execute reply may overtake the cell's last comm messages: the kernel's idle status comes after
            # all of them on iopub, and then the widget manager renders what they opened
            wait_for_kernel_idle(page, timeout=60)
            try:
                dashboard.first.wait_for(state="visible", timeout=30_000)
            except Exception:  # noqa: BLE001 - Playwright's TimeoutError: said below, with the cell's output
                _fail_with_output(page, "the %%taco_run cell finished without a .taco-dashboard widget under it")
            return
        time.sleep(0.25)
    _fail_with_output(page, f"no .taco-dashboard under the %%taco_run cell within {timeout:.0f} s")


def test_dashboard_updates_live(lab, page):
    """JupyterLab is a widget frontend: the dashboard must pick the widget view by itself (no TACO_DASHBOARD)."""
    from playwright.sync_api import expect

    lab.write_notebook("dashboard.ipynb", ["%load_ext taco_notebook", TRAIN_CELL])
    open_notebook(page, lab, "dashboard.ipynb")
    page.evaluate(WATCH_PROGRESS_JS)
    started = time.monotonic()
    run_all_cells(page)

    _wait_for_dashboard(page, timeout=150)  # cluster start: ~10 s, on a loaded 2-core box up to 60 s

    prompt = code_cells(page).nth(1).locator(".jp-InputArea-prompt")
    try:
        expect(prompt).to_have_text(re.compile(r"^\[\d+\]:?$"), timeout=240_000)
    except AssertionError:
        _fail_with_output(page, "the %%taco_run cell did not finish within 240 s")
    wait_for_kernel_idle(page, timeout=60)
    elapsed = time.monotonic() - started

    final = cell_output(page, 1).locator(STATIC).first  # the live view, replaced at the cell's end
    try:
        expect(final.locator(".taco-progress-text")).to_contain_text(f"{STEPS}/{STEPS}", timeout=30_000)
        expect(final.locator(".taco-progress-text")).to_contain_text("100%", timeout=30_000)
    except AssertionError:
        _fail_with_output(page, "the final picture's progress line did not end at 60/60, 100%")

    seen = page.evaluate("() => window.__tacoProgress")
    partial = [
        s for s in seen
        if s["running"] and (m := re.search(rf"(\d+)\s*/\s*{STEPS}", s["text"])) and 0 < int(m.group(1)) < STEPS
    ]  # fmt: skip
    assert len(seen) >= 3 and len(partial) >= 2, (
        f"the progress label did not update live (>= 2 changes to partial progress while the cell ran); "
        f"saw {seen} in {elapsed:.1f} s"
    )
    expect(final.locator(".taco-status")).to_contain_text("finished", timeout=10_000)
    expect(final.locator(".taco-status")).to_contain_text("ranks", timeout=10_000)

    frame = static_frame(page, 1)
    sources = frame_sources(frame, ["taco-throughput", "taco-compression"])
    for name in ("taco-throughput", "taco-compression"):
        assert len(sources[name]["time"]) >= 2, f"bokeh source {name!r} in the final picture: {sources}"
    canvases = painted_canvases(frame)
    print(f"dashboard: cell ran in {elapsed:.1f} s; progress texts {[s['text'] for s in seen]}; canvases {canvases}")


CHECK_CELL = """\
import json
_taco_checks = globals().get("_taco_checks", 0) + 1
_plots = taco.dashboard().stream.plots
print(f"TACO-CHECK {_taco_checks} " + json.dumps({
    "throughput": list(_plots.throughput.sources["throughput"].data["time"]),
    "compression": list(_plots.compression.sources["compression"].data["time"]),
    "summary": taco.dashboard().summary(),
}))
"""

DOCS = REPO / "docs" / "images"


COUNT_SENDS_JS = """
() => {
  if (window.__tacoSends !== undefined) return;
  window.__tacoSends = 0;
  const send = WebSocket.prototype.send;
  WebSocket.prototype.send = function (...args) { window.__tacoSends += 1; return send.apply(this, args); };
}
"""


def _check_after_the_pages_last_message(page, tries: int = 5) -> dict[str, list[float]]:
    """Run the notebook's last cell (CHECK_CELL) again until the page sent nothing over its websockets while it
    ran but the run itself: the kernel (which reads its shell messages in order) has then read every message the
    page sent it, echoed patches included. Returns the kernel's series of the run that proved it."""
    from playwright.sync_api import expect

    last = code_cells(page).count() - 1
    for check in range(2, 2 + tries):
        sends = page.evaluate("() => window.__tacoSends")
        code_cells(page).nth(last).locator(".jp-InputArea-prompt").click()
        page.keyboard.press("Shift+Enter")
        expect(cell_output(page, last)).to_contain_text(f"TACO-CHECK {check} ", timeout=120_000)
        wait_for_kernel_idle(page, timeout=60)
        text = cell_output(page, last).inner_text()
        if page.evaluate("() => window.__tacoSends") - sends <= 1:  # the execute request only
            return json.loads(re.search(rf"TACO-CHECK {check} (\{{.*\}})", text).group(1))
    pytest.fail(f"the page kept sending messages to the kernel over {tries} runs of the check cell")


def test_run_all_on_the_example_draws_each_series_once(lab, page):
    """A fresh kernel, Run All on examples/02. No time series may return to its first point
    ("bytes saved" drawn once), in the pictures on the page nor in the kernel's sources once the kernel has read
    every message the page sent back (the check cell runs again after Run All for that)."""
    import nbformat

    nb = nbformat.read(REPO / "examples" / "02-train-with-dashboard.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(CHECK_CELL))
    nbformat.write(nb, lab.root_dir / "runall.ipynb")
    open_notebook(page, lab, "runall.ipynb")
    page.evaluate(WATCH_ERRORS_JS)
    page.evaluate(COUNT_SENDS_JS)
    run_all_cells(page)
    wait_for_cells_executed(page, timeout=420)
    wait_for_kernel_idle(page, timeout=120)

    pictures = {}
    for index in (1, 2):  # the training cell's final picture, and taco.dashboard()'s
        frame = static_frame(page, index)
        sources = pictures[index] = frame_sources(frame, ["taco-throughput", "taco-compression"])
        for name, columns in sources.items():
            # what a person sees: a line of points (one point per series would draw no line at all), in order
            assert len(columns["time"]) >= 20 and strictly_increasing(columns["time"]), (
                f"cell {index}: {name} has too few points or goes back in time: {columns['time']}")
        ratios = [r for r in sources["taco-compression"]["ratio"] if r is not None and r == r]
        assert len(ratios) >= 20 and ratios[-1] > 1.8, f"cell {index}: compression ratios {ratios}"  # fp16
        assert all(v is not None and v == v for v in sources["taco-throughput"]["total"]), "a gap in the line"
        painted_canvases(frame)
    _picture(page, 1, DOCS / "dashboard-example-02.png")

    kernel = _check_after_the_pages_last_message(page)
    for name in ("throughput", "compression"):
        assert kernel[name] and strictly_increasing(kernel[name]), f"kernel-side {name} times repeat: {kernel[name]}"
    # the summary under the picture quotes the picture's last values
    last = {name: columns[-1] for name, columns in pictures[1]["taco-throughput"].items()}
    compression = {name: columns[-1] for name, columns in pictures[1]["taco-compression"].items()}
    summary = kernel["summary"]
    assert f"{last['average']:,.1f} samples/s total since training began, {last['total']:,.1f} over the last" in summary
    assert f"compression: {compression['ratio']:.2f}x over the last" in summary
    final_text = cell_output(page, 1).locator(f"{STATIC} .taco-status").first.text_content() or ""
    assert summary.splitlines()[0].removeprefix("taco dashboard: ") in final_text  # status line, as shown
    assert page.evaluate("() => window.__tacoErrors") == []
    print(f"run all: {len(kernel['throughput'])} throughput points, each once; summary: {summary}")


# Each visible figure's box and, for its legend (in the figure's shadow DOM), its box and the labels it shows.
LEGENDS_JS = """
() => {
  const box = (el) => { const r = el.getBoundingClientRect(); return {left: r.left, right: r.right, top: r.top,
                                                                        bottom: r.bottom}; };
  const find = (root, cls, out) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.classList && el.classList.contains(cls)) out.push(el);
      if (el.shadowRoot) find(el.shadowRoot, cls, out);
    }
    return out;
  };
  return find(document, 'bk-Figure', []).filter((fig) => box(fig).right > box(fig).left).flatMap((fig) =>
    find(fig.shadowRoot || fig, 'bk-Legend', []).map((legend) => ({
      figure: box(fig), legend: box(legend),
      labels: [...legend.shadowRoot.querySelectorAll('.bk-item:not(.bk-hidden) .bk-label')].map((l) => l.textContent),
    })));
}
"""


def shown_legends(frame) -> list[dict[str, Any]]:
    """The legends a person sees in ``frame``: each one's box, its figure's box and the labels it lists."""
    return frame.evaluate(LEGENDS_JS)


def _picture(page, index: int, path: Path) -> None:
    """Screenshot of the ``index``-th cell's final picture (status, progress and plots) for the docs: its HTML on a
    page of its own, 1200 px wide, so the whole picture is in one image. Every legend in it must lie within its
    figure and list no tokens series (these runs report none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    markup = cell_output(page, index).locator(STATIC).first.evaluate("(e) => e.outerHTML")
    alone = page.context.new_page()
    try:
        alone.set_viewport_size({"width": 1200, "height": 200})  # full_page: as tall as the picture
        alone.set_content(f'<html><body style="margin:8px">{markup}</body></html>')
        frame = alone.locator(FRAME).first.element_handle().content_frame()
        assert frame is not None
        frame_sources(frame, ["taco-throughput"])
        painted_canvases(frame)
        time.sleep(1.0)  # the last animation frame
        alone.screenshot(path=str(path), full_page=True)
        legends = shown_legends(frame)
        assert legends, "no legend in the picture"
        for shown in legends:
            fig, legend = shown["figure"], shown["legend"]
            assert fig["left"] <= legend["left"] and legend["right"] <= fig["right"], f"legend clipped: {shown}"
            assert fig["top"] <= legend["top"] and legend["bottom"] <= fig["bottom"], f"legend clipped: {shown}"
            assert shown["labels"] and "tokens/s (total)" not in shown["labels"], shown
        print(f"{path.name}: legends {[s['labels'] for s in legends]}")
    finally:
        alone.close()


def _save(page, lab, name: str, timeout: float = 60.0) -> dict[str, Any]:
    """Save the visible notebook (Ctrl+S) and return the file as written once it holds the final picture."""
    code_cells(page).nth(0).locator(".jp-InputArea-prompt").click()
    page.keyboard.press("Control+s")
    path = Path(lab.root_dir) / name
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text()
        if "taco-static-dashboard" in text:
            return json.loads(text)
        if time.monotonic() > deadline:
            pytest.fail(f"{name} was not saved with the final picture within {timeout:.0f} s")
        time.sleep(0.5)


def test_reload_and_saved_notebook_keep_the_final_picture(lab, page):
    """(b) reload after the training cell ended, kernel alive: the final picture is painted, no widget error, and
    running the cell again in the reloaded page shows a live dashboard again; (c) the saved notebook holds the
    static picture and no live placeholder."""
    from playwright.sync_api import expect

    lab.write_notebook("reload.ipynb", ["%load_ext taco_notebook", TRAIN_CELL])
    open_notebook(page, lab, "reload.ipynb")
    run_all_cells(page)
    wait_for_cells_executed(page, timeout=300)
    wait_for_kernel_idle(page, timeout=60)
    painted_canvases(static_frame(page, 1))

    saved = _save(page, lab, "reload.ipynb")  # (c)
    outputs = saved["cells"][1]["outputs"]
    html_outputs = [o for o in outputs if "text/html" in o.get("data", {})]
    assert len(html_outputs) == 1 and "iframe" in "".join(html_outputs[0]["data"]["text/html"])
    everything = json.dumps(outputs)
    # (ipyparallel's engine-start bar is a widget too, not the dashboard's: only the dashboard's are checked)
    dashboard_widgets = [o for o in outputs if WIDGET_MIME in o.get("data", {}) and "taco" in json.dumps(o)]
    assert not dashboard_widgets and "VBox(" not in everything, f"a live placeholder was saved: {dashboard_widgets}"
    assert "application/javascript" not in everything, "the BokehJS loader was saved besides the final picture"
    size = (Path(lab.root_dir) / "reload.ipynb").stat().st_size
    print(f"saved notebook: {size / 1e6:.2f} MB")

    page.reload()  # (b)
    page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for(timeout=120_000)
    wait_for_kernel_idle(page, timeout=120)
    page.evaluate(WATCH_ERRORS_JS)
    frame = static_frame(page, 1)
    assert len(frame_sources(frame, ["taco-throughput"])["taco-throughput"]["time"]) >= 2
    canvases = painted_canvases(frame)
    expect(cell_output(page, 1).locator(f"{STATIC} .taco-status")).to_contain_text("finished")

    code_cells(page).nth(1).locator(".jp-InputArea-prompt").click()  # the same cell again, in the reloaded page
    page.keyboard.press("Shift+Enter")
    _wait_for_dashboard(page, timeout=150)
    expect(code_cells(page).nth(1).locator(".jp-InputArea-prompt")).to_have_text(re.compile(r"^\[\d+\]:?$"),
                                                                                 timeout=240_000)  # fmt: skip
    wait_for_kernel_idle(page, timeout=60)
    painted_canvases(static_frame(page, 1))
    assert page.evaluate("() => window.__tacoErrors") == [], cell_output(page, 1).inner_text()
    print(f"after reload: final picture painted ({canvases}); re-run without widget errors")
