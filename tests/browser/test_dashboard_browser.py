"""The live training dashboard of ``%%taco_run``, in a real JupyterLab in a real chromium.

Contract under test: under a ``%%taco_run`` cell the kernel shows an ipywidgets dashboard, root class
``taco-dashboard``, with an ``IntProgress`` of class ``taco-progress``, an HTML label ``.taco-progress-text``
(``k/N`` and a percentage), a status line ``.taco-status`` naming the ``ranks``, and jupyter_bokeh plots whose data
sources are named ``taco-throughput`` and ``taco-compression``; all of it updates while the cell runs.
"""

from __future__ import annotations

import re
import time

import pytest

from .conftest import cell_output, code_cells, open_notebook, run_all_cells, wait_for_kernel_idle

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


def _fail_with_output(page, what: str) -> None:
    try:
        text = cell_output(page, 1).inner_text(timeout=5_000)
    except Exception as exc:  # noqa: BLE001 - the page may be gone
        text = f"<could not read the cell's output: {exc!r}>"
    pytest.fail(f"{what}\n--- output of the %%taco_run cell ---\n{text[-4000:]}")


def _wait_for_dashboard(page, timeout: float) -> None:
    """Until ``.taco-dashboard`` shows under the cell; fail at once if the cell ends without one."""
    dashboard = cell_output(page, 1).locator(".taco-dashboard")
    prompt = code_cells(page).nth(1).locator(".jp-InputArea-prompt")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dashboard.count() and dashboard.first.is_visible():
            return
        if re.fullmatch(r"\[\d+\]:?", prompt.inner_text().strip()):
            time.sleep(1)  # the last comm messages may trail the execute reply
            if dashboard.count() and dashboard.first.is_visible():
                return
            _fail_with_output(page, "the %%taco_run cell finished without a .taco-dashboard widget under it")
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
    dashboard = cell_output(page, 1).locator(".taco-dashboard").first

    prompt = code_cells(page).nth(1).locator(".jp-InputArea-prompt")
    try:
        expect(prompt).to_have_text(re.compile(r"^\[\d+\]:?$"), timeout=240_000)
    except AssertionError:
        _fail_with_output(page, "the %%taco_run cell did not finish within 240 s")
    wait_for_kernel_idle(page, timeout=60)
    elapsed = time.monotonic() - started

    text = dashboard.locator(".taco-progress-text").first
    try:
        expect(text).to_contain_text(f"{STEPS}/{STEPS}", timeout=30_000)
        expect(text).to_contain_text("100%", timeout=30_000)
    except AssertionError:
        _fail_with_output(page, "the progress label did not end at 60/60, 100%")

    seen = page.evaluate("() => window.__tacoProgress")
    partial = [
        s for s in seen
        if s["running"] and (m := re.search(rf"(\d+)\s*/\s*{STEPS}", s["text"])) and 0 < int(m.group(1)) < STEPS
    ]  # fmt: skip
    assert len(seen) >= 3 and len(partial) >= 2, (
        f"the progress label did not update live (>= 2 changes to partial progress while the cell ran); "
        f"saw {seen} in {elapsed:.1f} s"
    )

    bar = dashboard.locator(".taco-progress .progress-bar").first
    expect(bar).to_have_attribute("style", re.compile(r"width:\s*100%"), timeout=10_000)
    expect(dashboard.locator(".taco-status").first).to_contain_text("ranks", timeout=10_000)

    dashboard.scroll_into_view_if_needed()
    sources = page.evaluate(SOURCE_ROWS_JS, ["taco-throughput", "taco-compression"])
    assert "error" not in sources, sources
    for name in ("taco-throughput", "taco-compression"):
        rows = sources["rows"].get(name)
        assert isinstance(rows, int) and rows >= 2, f"bokeh source {name!r}: {rows!r} rows; {sources}"

    handle = dashboard.element_handle()
    canvases = []
    deadline = time.monotonic() + 30  # BokehJS paints on the next animation frame after the last patch
    while time.monotonic() < deadline:
        canvases = page.evaluate(CANVAS_COLOURS_JS, handle)
        if any(c["colours"] >= 2 for c in canvases):
            break
        time.sleep(0.5)
    assert canvases, "no <canvas> under .taco-dashboard: the bokeh plots did not render"
    assert any(c["colours"] >= 2 for c in canvases), f"every bokeh canvas is blank: {canvases}"
    print(f"dashboard: cell ran in {elapsed:.1f} s; progress texts {[s['text'] for s in seen]}; sources {sources}")
