"""How the dashboard reaches the page: the live view's patches, the static final picture, ``taco.dashboard()``,
readable axes, the straggler and GPU memory. Real bokeh, ipywidgets, jupyter_bokeh and IPython display machinery;
hand-made snapshots (see ``test_widgets.py``)."""

from __future__ import annotations

import html
import json
import re
from typing import Any

import bokeh
import pytest
from bokeh.models import ColumnDataSource, CustomJSTickFormatter
from IPython.core.displaypub import CapturingDisplayPublisher
from jupyter_bokeh import BokehModel

from taco_notebook.widgets import MetricsStream, build_plots
from taco_notebook.widgets.dashboard import CellDashboard, Dashboard
from taco_notebook.widgets.plots import plural
from taco_notebook.widgets.render import KernelFedBokehModel, static_html
from taco_notebook.widgets.stream import gpu_text, straggler

from .test_widgets import NODE_OF_RANK, batch, payloads, snapshot

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def throughput_times(board: Dashboard) -> list[float]:
    source = board.layout.select_one({"type": ColumnDataSource, "name": "taco-throughput"})
    return list(source.data["time"])


def record_sends(model: BokehModel) -> list[dict[str, Any]]:
    """What the kernel would send this live view (instead of a comm to a browser)."""
    sent: list[dict[str, Any]] = []
    model.send = lambda content, buffers=None: sent.append(content)  # type: ignore[method-assign]
    return sent


def echo_from_browser(model: BokehModel, sent: list[dict[str, Any]]) -> int:
    """Do what jupyter_bokeh's BokehView does with each patch: apply it, then send the document event it caused
    back to the kernel as a ``jsevent`` (it ignores BokehJS's ``sync=false``). Returns how many it echoed."""
    echoed = 0
    for content in list(sent):
        payload = content.get("payload")
        if not isinstance(payload, str) or '"events"' not in payload:
            continue  # header, metadata
        for event in json.loads(payload)["events"]:
            if event["kind"] == "ColumnsStreamed":
                model._sync_model(model, {**event, "event": "jsevent"}, [])
                echoed += 1
    return echoed


@pytest.mark.parametrize("model_class, points", [(BokehModel, 2), (KernelFedBokehModel, 1)])
def test_a_stream_echoed_by_the_browser_is_applied_once(model_class: type[BokehModel], points: int) -> None:
    """The Run All bug at its cause: jupyter_bokeh's plain ``BokehModel`` streams the echoed points a second time
    (and forwards them to every other view of the document); ``KernelFedBokehModel`` does not."""
    board = Dashboard(NODE_OF_RANK)
    live = model_class(board.layout, combine_events=True)
    other = KernelFedBokehModel(board.layout)  # the view `taco.dashboard()` made in the next cell under Run All
    sent, to_other = record_sends(live), record_sends(other)
    board.update(payloads(1.0, 10), running=4, elapsed=1.0)
    board.update(payloads(1.5, 20), running=4, elapsed=1.5)
    assert len(throughput_times(board)) == 30 and to_other

    to_other.clear()
    assert echo_from_browser(live, sent) >= 2  # throughput and compression
    assert len(throughput_times(board)) == 30 * points
    assert bool(to_other) == (points == 2)  # the duplicate reached the other view: a line back to its first point


@pytest.mark.parametrize("model_class, pinned", [(BokehModel, True), (KernelFedBokehModel, False)])
def test_ranges_the_browser_computed_do_not_pin_the_kernels_figures(model_class: type[BokehModel],
                                                                    pinned: bool) -> None:
    """A view reports the x range of its first render; applied, it would frame the final picture on that window."""
    board = Dashboard(NODE_OF_RANK)
    live = model_class(board.layout)
    x_range = board.stream.plots.throughput.figure.x_range
    event = {"kind": "ModelChanged", "model": {"id": x_range.id}, "attr": "start", "new": 8.8, "event": "jsevent"}
    live._sync_model(live, event, [])
    assert (x_range.start == 8.8) == pinned


def test_the_dashboards_live_views_ignore_echoed_streams() -> None:
    board = Dashboard(NODE_OF_RANK)
    plots = board.widget().children[-1]
    assert isinstance(plots, KernelFedBokehModel)
    sent = record_sends(plots)
    for elapsed, n in ((1.0, 10), (1.5, 20), (2.0, 30)):
        board.update(payloads(elapsed, n), running=4, elapsed=elapsed)
    drawn = throughput_times(board)
    echo_from_browser(plots, sent)
    assert throughput_times(board) == drawn and len(drawn) == 40 and drawn[-1] == pytest.approx(2.0)
    compression = board.layout.select_one({"type": ColumnDataSource, "name": "taco-compression"})
    assert list(compression.data["time"]) == drawn  # "bytes saved" drawn once


def bundle_times(bundle: Any) -> list[float]:
    """The throughput source's times in a ``render_bundle`` (as sent to the page, or the trait itself)."""
    from bokeh.document import Document

    bundle = json.loads(bundle) if isinstance(bundle, str) else bundle
    (doc_json,) = bundle["docs_json"].values()
    source = Document.from_json(doc_json).select_one({"type": ColumnDataSource, "name": "taco-throughput"})
    return [float(t) for t in source.data["time"]]


def test_a_page_asking_for_a_live_views_whole_state_gets_the_document_as_it_is_now() -> None:
    """A page reloaded mid-run asks for the live view's state; the bundle made with the widget (before
    the first points) would draw only what is streamed after the reload."""
    board = Dashboard(NODE_OF_RANK)
    plots = board.widget().children[-1]
    for elapsed, n in ((1.0, 10), (1.5, 20), (2.0, 30)):
        board.update(payloads(elapsed, n), running=4, elapsed=elapsed)
    assert bundle_times(plots.render_bundle) == []  # what the widget was made with
    assert bundle_times(plots.get_state()["render_bundle"]) == throughput_times(board) and len(throughput_times(board))
    assert "render_bundle" not in plots.get_state("combine_events")  # a trait's own update sends no bundle
    plots.close()


def finished_board() -> Dashboard:
    board = Dashboard(NODE_OF_RANK, title="cluster 'x'")
    for elapsed, n in ((1.0, 20), (1.5, 40), (2.0, 60)):
        board.update(payloads(elapsed, n), running=4, elapsed=elapsed + 1)
    board.finish("finished", elapsed=3.2)
    return board


def test_static_bundle_is_self_contained_and_holds_the_final_data() -> None:
    board = finished_board()
    bundle = board.static_bundle()
    assert bundle["text/plain"] == board.summary()
    page = bundle["text/html"]
    assert page.startswith('<div class="taco-static-dashboard">') and "<iframe" in page
    assert "finished · 4 ranks on 2 nodes · step 59 · 3.2 s since the cell started" in page
    assert "train: 59/60 (98%)" in html.unescape(page)
    inner = html.unescape(re.search(r'srcdoc="([^"]*)"', page).group(1))
    assert "cdn.bokeh.org" not in inner and "Bokeh.embed.embed_items" in inner
    assert bokeh.__version__ in inner and len(inner) > 500_000  # BokehJS itself is inline, not linked
    assert '"taco-throughput"' in inner and "1.5" in inner and "2.0" in inner
    print(f"static final picture: {len(page) / 1e6:.2f} MB of HTML")


def test_static_html_height_follows_the_visible_rows() -> None:
    board = Dashboard(NODE_OF_RANK)
    without_gpu = re.search(r"width:100%;height:(\d+)px", static_html(board.layout)).group(1)
    board.stream.plots.gpu.figure.visible = True
    with_gpu = re.search(r"width:100%;height:(\d+)px", static_html(board.layout)).group(1)
    assert int(with_gpu) > int(without_gpu)


@pytest.fixture
def published(ip, monkeypatch) -> list[dict[str, Any]]:
    """Every display message the real shell publishes (data, transient display_id, update flag)."""
    publisher = CapturingDisplayPublisher()
    monkeypatch.setattr(ip, "display_pub", publisher)
    return publisher.outputs


def test_cell_end_replaces_the_live_view_with_the_static_picture(published) -> None:
    cell = CellDashboard(NODE_OF_RANK, "widget", title="cluster 'x'")
    cell.update(payloads(1.0, 10), [0, 1, 2, 3])
    loader, live = published
    assert "application/javascript" in loader["data"] and "window.Bokeh == null" in loader["data"][
        "application/javascript"]  # loads BokehJS only where the (maybe reloaded) page lacks it
    assert WIDGET_MIME in live["data"] and loader["transient"]["display_id"] != live["transient"]["display_id"]
    bokeh_view = cell.dashboard._live[0]
    cell.update(payloads(1.5, 20), [0, 1, 2, 3])
    cell.finish("finished")

    updates = {out["transient"]["display_id"]: out for out in published[2:]}
    assert all(out["update"] for out in published[2:]) and len(published) == 4
    final = updates[live["transient"]["display_id"]]["data"]
    assert set(final) == {"text/plain", "text/html"} and WIDGET_MIME not in final
    assert final["text/plain"].startswith("taco dashboard: cluster 'x' · finished") and "VBox(" not in str(final)
    assert updates[loader["transient"]["display_id"]]["data"] == {"text/plain": ""}  # 1 MB less in the notebook
    assert bokeh_view.comm is None  # closed: nothing left for a reloaded page to fail to create
    # the live view's box (what a page reloaded from a notebook saved mid-run shows) holds the final picture
    (view,) = cell.dashboard._views
    assert view.comm is not None and [type(c).__name__ for c in view.children] == ["HTML"]
    assert view.children[0].value == final["text/html"] and "taco-dashboard" not in view._dom_classes
    bokeh_view.close()  # again, as Widget.__del__ does: no KeyError from jupyter_bokeh


def test_taco_dashboard_in_text_mode_is_the_summary_not_a_widget_repr(published, monkeypatch) -> None:
    from IPython.display import display

    board = finished_board()
    monkeypatch.setenv("TACO_DASHBOARD", "text")
    display(board)
    assert published[-1]["data"] == {"text/plain": board.summary()}
    assert repr(board) == board.summary()

    monkeypatch.setenv("TACO_DASHBOARD", "widget")
    display(board)  # finished: the final picture, static, not a second live view of the same document
    assert set(published[-1]["data"]) == {"text/plain", "text/html"} and not board._live


def test_axes_and_colour_bars_read_in_units() -> None:
    plots = build_plots(NODE_OF_RANK, capacity_bps=3.125e9)
    saved_axis = plots.compression.figure.select_one({"name": "saved_axis"})
    assert isinstance(saved_axis.formatter, CustomJSTickFormatter) and saved_axis.formatter.args["suffix"] == ""
    for plot in (plots.node_links, plots.rank_links, plots.rank_links_across):
        bars = plot.figure.right
        assert [b.name for b in bars] == ["scale"]  # one colour bar per heatmap
        assert all(isinstance(b.formatter, CustomJSTickFormatter) and b.formatter.args["suffix"] == "/s"
                   for b in bars)  # fmt: skip
    assert plots.throughput.figure.yaxis[0].formatter.format == "0,0.[0]"


def test_bytes_tick_formatter_writes_what_format_bytes_writes() -> None:
    """Run the formatter's JavaScript with node (installed for the lab extension) on ticks from 0 B/s to 3.13 GB/s."""
    import shutil
    import subprocess

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the JavaScript tick formatter cannot be run here")
    formatter = build_plots(NODE_OF_RANK).compression.figure.select_one({"name": "saved_axis"}).formatter
    ticks = [0, 512, 2.0e7, 1.5e8, 3.125e9]
    script = (f"const f = (tick, suffix) => {{ {formatter.code} }};"
              f"console.log(JSON.stringify({json.dumps(ticks)}.map((t) => f(t, '/s'))));")  # fmt: skip
    out = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(out) == ["0 B/s", "512 B/s", "20 MB/s", "150 MB/s", "3.13 GB/s"]


def test_one_straggler_for_the_outline_the_label_and_the_summary() -> None:
    stream = MetricsStream(NODE_OF_RANK)
    stream.push(batch(1.0))
    stream.push(batch(1.5))
    stream.push(batch(2.0, ranks=(0, 1, 2)))  # rank 3 silent: its bar (and its claim to "slowest") is kept
    bars = stream.plots.step_time.sources["step_time"].data
    rank = straggler(dict(zip((0, 1, 2, 3), bars["total"], strict=True)),
                     dict(zip((0, 1, 2, 3), bars["compute"], strict=True)))  # fmt: skip
    assert rank == 3  # bars of one height: the most compute, its peers wait for it (WAIT_PER_STEP)
    assert bars["note"] == ["", "", "", "slowest"] and bars["outline"] == [None, None, None, "black"]
    assert "slowest rank: 3 (0.250 s/step: compute 0.225 s" in stream.summary()
    assert straggler({0: 0.2, 1: 0.2}) == 0 and straggler({0: 0.0}) is None


def test_plurals() -> None:
    assert plural(1, "rank") == "1 rank" and plural(2, "node") == "2 nodes" and plural(0, "step") == "0 steps"
    stream = MetricsStream({0: 0})
    stream.push([snapshot(0, 1.0)])
    assert "taco metrics: 1 rank on 1 node, 1.0 s, 4 optimizer steps" in stream.summary()
    board = Dashboard({0: 0})
    board.finish("finished", 1.0)
    assert "finished · 1 rank on 1 node · step 0" in board.summary()


GPU = {"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 1_200_000_000, "peak_bytes": 3_400_000_000,
       "utilization": 87}  # fmt: skip


def test_gpu_memory_is_drawn_and_summarised_when_ranks_report_it() -> None:
    stream = MetricsStream(NODE_OF_RANK)
    gpus = {0: GPU, 1: {**GPU, "utilization": None, "memory_bytes": 5e8}, 2: None, 3: None}
    for elapsed in (1.0, 1.5):
        stream.push([{**snapshot(r, elapsed), "gpu": gpus[r]} for r in NODE_OF_RANK])
    plot = stream.plots.gpu
    assert plot.figure.visible
    data = plot.sources["gpu"].data
    assert data["memory"][:2] == [1.2e9, 5e8] and data["peak"][0] == 3.4e9
    assert all(v != v for v in data["memory"][2:])  # NaN: no GPU on ranks 2 and 3
    assert data["label"] == ["H100 80GB HBM3 · 87% busy", "H100 80GB HBM3", "", ""]
    line = next(line for line in stream.summary().splitlines() if line.startswith("gpu: "))
    assert line == ("gpu: rank 0 NVIDIA H100 80GB HBM3: 1.2 GB in use, peak 3.4 GB, 87% busy; "
                    "rank 1 NVIDIA H100 80GB HBM3: 500.0 MB in use, peak 3.4 GB")  # fmt: skip
    assert gpu_text({**GPU, "utilization": None}).endswith("peak 3.4 GB")


def test_without_gpus_nothing_gpu_shows() -> None:
    stream = MetricsStream(NODE_OF_RANK)
    for elapsed in (1.0, 1.5):
        stream.push([{**snapshot(r, elapsed), "gpu": None} for r in NODE_OF_RANK])
    assert not stream.plots.gpu.figure.visible and "gpu" not in stream.summary()
