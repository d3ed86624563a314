"""The dashboard of 16 and 64 ranks in a real JupyterLab in a real chromium, from replayed snapshots.

No ranks run: a notebook cell builds the dashboard (``CellDashboard`` in widget mode, as ``%%taco_run`` does) and
feeds it a synthetic Horovod-style run's payloads (``tests/widgets/synthetic.py``) through ``update``, the path
live payloads take; a second cell ends it (``finish``), which puts the final picture in the live view's place.
Both are measured where BokehJS laid them out: every shown plot keeps a frame of at least :data:`MIN_FRAME_PX`
each way (no neighbour squeezes it), no legend is taller than its plot's frame, no heatmap prints text on a
silent link, and heatmap text shows only where the widest label fits a cell. Screenshots of both go to
``test-artifacts/dashboard-scale-<ranks>-live.png`` and ``...-final.png``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from ..widgets.synthetic import SyntheticRun
from .conftest import ARTIFACTS, cell_output, code_cells, open_notebook, wait_for_kernel_idle
from .test_dashboard_browser import FRAME, STATIC, frame_sources, painted_canvases, static_frame

pytestmark = pytest.mark.browser

MIN_FRAME_PX = 120  # a squeezed plot kept ~20 px; an unsqueezed one keeps ~155 of its 290
RUNS = {
    16: SyntheticRun(ranks=16, ranks_per_node=8, uneven=0.25),  # smaller batches on higher ranks: a wide band
    64: SyntheticRun(ranks=64, ranks_per_node=8, send_s=0.5),
}
SHOWN = {"throughput", "compression", "node-links", "rank-links-across", "rank-links", "step_time"}

REPLAY_CELL = """\
import json
from taco_notebook.widgets.dashboard import CellDashboard
with open({path!r}) as f:
    replay = json.load(f)
cell = CellDashboard({{int(r): n for r, n in replay["node_of_rank"].items()}}, "widget", title={title!r})
for payloads in replay["payloads"]:
    cell.update({{int(r): p for r, p in payloads.items()}}, running=sorted(replay["node_of_rank"]))
print("REPLAYED", len(replay["payloads"]))
"""
FINISH_CELL = 'cell.finish("finished")\nprint("FINISHED")'

# Every shown figure's frame, its legends' boxes and its heatmap labels, from the views BokehJS laid out.
LAYOUT_JS = """
() => {
  const B = window.Bokeh;
  if (B == null || B.index == null) return null;
  const views = [...B.index.all_views()];
  const column = (source, name) => {
    const data = source.data;
    return Array.from((data instanceof Map ? data.get(name) : data[name]) || []);
  };
  const ctx = document.createElement('canvas').getContext('2d');
  return views.filter((v) => v.model.type === 'Figure' && v.model.visible).map((v) => {
    const m = v.model;
    const children = views.filter((w) => w.parent === v);
    const legends = children.filter((w) => w.model.type === 'Legend' && w.model.visible).map((w) => {
      const r = w.el.getBoundingClientRect();
      return {width: r.width, height: r.height};
    });
    const labels = children.filter((w) => w.model.name === 'labels').map((w) => {
      const source = w.model.data_source;
      const texts = column(source, 'text'), bps = column(source, 'bps');
      ctx.font = '9pt helvetica, arial, sans-serif';  // heatmaps.LABEL_FONT
      const shown = texts.filter((t) => t);
      return {visible: w.model.visible, texts: shown.length, on_zero: texts.filter((t, i) => t && bps[i] === 0).length,
              widest: Math.max(0, ...shown.map((t) => ctx.measureText(t).width))};
    });
    const legend_labels = children.filter((w) => w.model.type === 'Legend').flatMap((w) =>
      w.model.items.filter((i) => i.visible).map((i) => i.label.value ?? String(i.label)));
    return {name: m.name || 'throughput', frame: {width: v.frame.bbox.width, height: v.frame.bbox.height},
            cells: m.x_range.end - m.x_range.start, legends, labels, legend_labels};
  });
}
"""


def _write_replay(lab: Any, run: SyntheticRun) -> str:
    """The run's payloads (``{rank: {"metrics": snapshot, "progress": state}}`` per poll) as JSON in Lab's root."""
    total = len(run.step_ends)
    payloads = []
    for t in run.times():
        batch = run.batch(t)
        payloads.append({rank: {"metrics": snap, "progress": {"n": snap["steps"], "total": total, "desc": "train",
                                                             "elapsed_seconds": t}}
                         for rank, snap in batch.items()})  # fmt: skip
    name = f"replay{run.ranks}.json"
    (Path(lab.root_dir) / name).write_text(json.dumps({"node_of_rank": run.node_of_rank, "payloads": payloads}))
    return name


def _run_cell(page: Any, index: int, marker: str, timeout: float) -> None:
    from playwright.sync_api import expect

    code_cells(page).nth(index).locator(".jp-InputArea-prompt").click()
    page.keyboard.press("Shift+Enter")
    expect(cell_output(page, index)).to_contain_text(marker, timeout=timeout * 1000)
    wait_for_kernel_idle(page, timeout=60)


def _laid_out(target: Any, timeout: float = 60.0) -> list[dict[str, Any]]:
    """The shown figures as BokehJS laid them out, once every expected one has a frame."""
    deadline = time.monotonic() + timeout
    plots: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        plots = target.evaluate(LAYOUT_JS) or []
        if SHOWN <= {p["name"] for p in plots} and all(p["frame"]["height"] > 0 for p in plots):
            time.sleep(1.0)  # the last resize
            return target.evaluate(LAYOUT_JS)
        time.sleep(0.5)
    pytest.fail(f"the dashboard's figures were not laid out within {timeout:.0f} s: {plots}")


def _check_layout(plots: list[dict[str, Any]], ranks: int, where: str) -> None:
    assert SHOWN <= {p["name"] for p in plots}, f"{where}: shown {[p['name'] for p in plots]}"
    for plot in plots:
        frame = plot["frame"]
        assert frame["height"] >= MIN_FRAME_PX and frame["width"] >= MIN_FRAME_PX, f"{where}: squeezed: {plot}"
        for legend in plot["legends"]:
            assert legend["height"] <= frame["height"], f"{where}: legend taller than its plot: {plot}"
        for labels in plot["labels"]:
            assert labels["on_zero"] == 0, f"{where}: heatmap text on a silent link: {plot}"
            cell = frame["width"] / plot["cells"]
            assert not labels["visible"] or labels["widest"] + 6 <= cell, f"{where}: labels overflow cells: {plot}"
    heatmaps = [p for p in plots if p["name"].startswith("rank-links")]
    assert all(not p["labels"] for p in heatmaps) == (ranks > 16), f"{where}: {heatmaps}"
    throughput = next(p for p in plots if p["name"] == "throughput")
    assert f"{ranks} ranks: median, min-max" in throughput["legend_labels"], throughput
    print(f"{where}: " + "; ".join(f"{p['name']} frame {p['frame']['width']:.0f}x{p['frame']['height']:.0f} "
                                   f"legends {[round(g['height']) for g in p['legends']]}" for p in plots))


def _final_picture_alone(page: Any, path: Path) -> list[dict[str, Any]]:
    """The final picture's HTML on a page of its own, 1200 px wide: its layout, and a screenshot at ``path``."""
    markup = cell_output(page, 0).locator(STATIC).first.evaluate("(e) => e.outerHTML")
    alone = page.context.new_page()
    try:
        alone.set_viewport_size({"width": 1200, "height": 200})
        alone.set_content(f'<html><body style="margin:8px">{markup}</body></html>')
        frame = alone.locator(FRAME).first.element_handle().content_frame()
        assert frame is not None
        frame_sources(frame, ["taco-throughput"])
        painted_canvases(frame)
        plots = _laid_out(frame)
        alone.screenshot(path=str(path), full_page=True)
        return plots
    finally:
        alone.close()


@pytest.mark.timeout(600)  # JupyterLab's start and 64 ranks' replay on a loaded two-core box
@pytest.mark.parametrize("ranks", sorted(RUNS))
def test_a_replayed_run_of_many_ranks_lays_out_readably(lab, page, ranks: int) -> None:
    run = RUNS[ranks]
    data = _write_replay(lab, run)
    lab.write_notebook(f"scale{ranks}.ipynb", [REPLAY_CELL.format(path=data, title=f"replay of {ranks} ranks"),
                                               FINISH_CELL])  # fmt: skip
    page.set_viewport_size({"width": 1400, "height": 2200})  # the whole live view on the screen
    open_notebook(page, lab, f"scale{ranks}.ipynb")
    _run_cell(page, 0, "REPLAYED", timeout=300)
    live = cell_output(page, 0).locator(".taco-dashboard").first
    live.wait_for(state="visible", timeout=60_000)
    live_plots = _laid_out(page)
    ARTIFACTS.mkdir(exist_ok=True)
    live.screenshot(path=str(ARTIFACTS / f"dashboard-scale-{ranks}-live.png"))
    _check_layout(live_plots, ranks, f"{ranks} ranks, live")

    _run_cell(page, 1, "FINISHED", timeout=120)
    static_frame(page, 0)  # the final picture took the live view's place
    final_plots = _final_picture_alone(page, ARTIFACTS / f"dashboard-scale-{ranks}-final.png")
    _check_layout(final_plots, ranks, f"{ranks} ranks, final")
