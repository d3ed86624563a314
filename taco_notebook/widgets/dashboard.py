"""The live dashboard under a ``%%taco_run`` cell: status line, one progress bar for all ranks, bokeh plots.

``cluster/cells/run.py`` reads what the engines publish (``{"metrics": snapshot, "progress": state}`` per rank) and
hands it to a :class:`CellDashboard`, which decides how to show it:

* ``widget``: an ipywidgets ``VBox`` (status ``HTML``, ``IntProgress`` + label, and the plots in one
  ``jupyter_bokeh.BokehModel``), created at the first payload and updated in place while the cell runs. When the
  cell ends it is replaced (``update_display``) by a static, self-contained rendering of the final picture and
  the text summary (``render.static_html``), which shows after a page reload, in the saved notebook and in
  nbviewer, with no kernel or widget manager (see ``render.py`` for why).
* ``text``: where no widget frontend listens (terminal IPython, nbval, ``python -m taco_notebook run``), a compact
  summary printed when the cell ends.
* ``off``: ``--no-dashboard``.

``auto`` picks ``widget`` in a kernel that a Jupyter server started for a notebook session (JupyterLab,
Notebook 7, Voilà) or that a widget manager has talked to, else ``text``; ``%%taco_run --dashboard``,
``TacoMagics.dashboard`` or ``TACO_DASHBOARD`` = ``widget|text|off`` overrides it (VS Code, for example, needs
``widget``). The bar and the status line's step are :func:`taco_notebook.model.cell_progress`, as in the sidebar.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..model import cell_progress, slowest_rank
from .plots import plural
from .stream import MetricsStream

__all__ = [
    "Dashboard",
    "CellDashboard",
    "ProgressView",
    "DASHBOARD_MODES",
    "aggregate_progress",
    "dashboard_mode",
    "last_dashboard",
]

DASHBOARD_MODES = ("auto", "widget", "text", "off")
log = logging.getLogger("taco_notebook")
_last: Dashboard | None = None


def last_dashboard() -> Dashboard | None:
    """The dashboard of this kernel's last ``%%taco_run`` cell that reported metrics, if any."""
    return _last


def dashboard_mode(requested: str | None = None) -> str:
    """``widget``, ``text`` or ``off`` for this kernel: see the module docstring."""
    mode = (requested or os.environ.get("TACO_DASHBOARD") or "auto").lower()
    if mode not in DASHBOARD_MODES:
        raise ValueError(f"TACO_DASHBOARD must be one of {', '.join(DASHBOARD_MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    return "widget" if _widget_frontend() else "text"


def _widget_frontend() -> bool:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    try:
        from ipywidgets import Widget
    except ImportError:
        return False
    # A widget manager opens this channel when it connects, but only to a kernel that had imported ipywidgets
    # by then; a kernel that a Jupyter server started for a notebook or console session (JupyterLab, Notebook,
    # Voilà) has JPY_SESSION_NAME, whereas nbclient/nbval kernels do not.
    return Widget._control_comm is not None or "JPY_SESSION_NAME" in os.environ


class ProgressView:
    """One progress bar for many ranks: a synchronous job is as far along as its slowest rank."""

    def __init__(self, n: int, total: int | None, desc: str, seconds: float) -> None:
        self.n, self.total, self.desc, self.seconds = n, total, desc, seconds

    @property
    def rate(self) -> float:
        return self.n / self.seconds if self.seconds > 0 else math.nan

    @property
    def fraction(self) -> float | None:
        return min(self.n / self.total, 1.0) if self.total else None

    def text(self) -> str:
        """``epoch 1: 30/60 (50%) · 12.3 it/s · 2.4 s in the loop · ETA 2.4 s`` — like tqdm's. The seconds count
        from the loop's first iteration, so they are fewer than the status line's, which count from the cell's
        start (model building, the first collectives)."""
        label = f"{self.desc}: " if self.desc else ""
        rate = f"{self.rate:.2f} it/s" if not math.isnan(self.rate) else "- it/s"
        seconds = f"{self.seconds:.1f} s in the loop"
        if self.fraction is None:
            return f"{label}{self.n} it · {rate} · {seconds}"
        assert self.total is not None
        left = (self.total - self.n) / self.rate if self.rate > 0 else math.nan
        eta = "done" if self.n >= self.total else ("ETA -" if math.isnan(left) else f"ETA {left:.1f} s")
        return f"{label}{self.n}/{self.total} ({self.fraction:.0%}) · {rate} · {seconds} · {eta}"


def aggregate_progress(states: Mapping[int, Mapping[str, Any]]) -> ProgressView | None:
    """The bar for ``{rank: taco.progress state}``: :func:`~taco_notebook.model.cell_progress` (the slowest rank's
    count, the largest total, as the sidebar shows), labelled and timed by that slowest rank."""
    payloads = {r: {"progress": s} for r, s in states.items() if s}
    rank = slowest_rank(payloads)
    if rank is None:
        return None
    progress, slowest = cell_progress(payloads), states[rank]
    return ProgressView(
        progress["step"], progress["total"], str(slowest.get("desc") or ""), float(slowest.get("elapsed_seconds", 0.0))
    )


class Dashboard:
    """The live picture of one cell's run on ranks placed as ``node_of_rank``; display it to get a view."""

    def __init__(self, node_of_rank: Mapping[int, int], *, title: str = "", capacity_bps: float | None = None):
        import ipywidgets as w

        self.title = title
        self.ranks = sorted(node_of_rank)
        self.nodes = len(set(node_of_rank.values()))
        self.stream = MetricsStream(node_of_rank, capacity_bps=capacity_bps)
        self.progress: ProgressView | None = None
        self.outcome: str | None = None
        self.membership: str | None = None  # the last elastic change ("rank 2 lost: 3 ranks from step 20")
        self.running = len(self.ranks)
        self.elapsed = 0.0
        self.payloads: dict[int, Mapping[str, Any]] = {}  # every rank's latest payload: the status line's step
        self.status = w.HTML(_dom_classes=("taco-status",))
        self.bar = w.IntProgress(min=0, max=1, value=0, layout=w.Layout(width="40%", min_width="200px"),
                                 _dom_classes=("taco-progress",))  # fmt: skip
        self.bar_text = w.HTML(_dom_classes=("taco-progress-text",))
        self.layout = self._bokeh_layout()
        self._live: list[Any] = []  # live BokehModels made by widget()
        self._views: list[Any] = []  # the VBoxes widget() returned: at the cell's end they hold the final picture
        self._render_status()

    def _bokeh_layout(self) -> Any:
        from bokeh.layouts import column, row

        p = self.stream.plots
        rows = [row(p.throughput.figure, p.compression.figure, sizing_mode="stretch_width"),
                row(p.node_links.figure, p.rank_links_across.figure, p.rank_links.figure, sizing_mode="stretch_width"),
                row(p.step_time.figure, p.gpu.figure, sizing_mode="stretch_width")]  # fmt: skip
        layout = column(*rows, sizing_mode="stretch_width")
        _show_rows(layout)
        return layout

    # ------------------------------------------------------------ updates
    def update(self, payloads: Mapping[int, Mapping[str, Any]], *, running: int, elapsed: float) -> None:
        """One poll's worth of ``{rank: {"metrics": snapshot, "progress": state}}`` (latest per rank)."""
        self.running, self.elapsed = running, elapsed
        self.payloads.update(payloads)
        snapshots = [p["metrics"] for p in payloads.values() if p.get("metrics")]
        with _held(self.layout):
            if snapshots:
                self.stream.push(snapshots)
            _show_rows(self.layout)
        progress = aggregate_progress({r: p.get("progress") or {} for r, p in payloads.items()})
        if progress is not None:
            self.progress = progress
        self._render_progress()
        self._render_status()

    def finish(self, outcome: str, elapsed: float) -> None:
        """The cell ended (``finished``, ``failed: …``, ``interrupted``, …): freeze the picture with its outcome."""
        self.outcome, self.elapsed, self.running = outcome, elapsed, 0
        with _held(self.layout):
            self.stream.finish()
            _show_rows(self.layout)
        self.bar.bar_style = "success" if outcome == "finished" else "danger"
        self._render_progress()
        self._render_status()

    def _render_progress(self) -> None:
        view = self.progress
        if view is None:
            self.bar_text.value = "no taco.progress loop in this cell" if self.outcome else "waiting for the ranks…"
            return
        if view.total:
            self.bar.max, self.bar.value = view.total, min(view.n, view.total)
        else:  # unknown length: a full bar that counts
            self.bar.max, self.bar.value = 1, 1
        self.bar_text.value = view.text()

    def _status_text(self) -> str:
        # the slowest rank's position, by the same definition as the bar and the sidebar (model.cell_progress)
        step = cell_progress(self.payloads)["step"]
        state = self.outcome or "running"
        ranks = len(self.ranks)
        alive = f"{self.running}/{ranks} ranks running" if self.outcome is None else plural(ranks, "rank")
        change = f" · {self.membership}" if self.membership else ""
        return (
            f"{self.title + ' · ' if self.title else ''}{state} · {alive} on {plural(self.nodes, 'node')}"
            f"{change} · step {step} · {self.elapsed:.1f} s since the cell started"
        )

    def membership_changed(self, text: str, node_of_rank: Mapping[int, int]) -> None:
        """An elastic cell lost or gained ranks (``text`` says which): count the new ones from here."""
        self.membership = text
        self.payloads = {r: p for r, p in self.payloads.items() if r in node_of_rank}
        self.ranks = sorted(node_of_rank)
        self.nodes = len(set(node_of_rank.values()))
        self._render_status()

    def _render_status(self) -> None:
        self.status.value = f"<b>taco</b> {_escape(self._status_text())}"

    # ------------------------------------------------------------ views
    def summary(self) -> str:
        """The text fallback: status, progress and the metrics summary."""
        lines = [f"taco dashboard: {self._status_text()}"]
        if self.progress is not None:
            lines.append(f"progress: {self.progress.text()}")
        if self.stream.latest:
            lines += self.stream.summary().splitlines()[1:]
        return "\n".join(lines)

    def widget(self) -> Any:
        """A new live view: ipywidgets share their models, and a fresh ``BokehModel`` starts from the plots' current
        state (re-displaying an old one would replay its first render). Display BokehJS before it
        (``render.display_bokehjs``): the page may have been reloaded since the kernel last loaded it."""
        import ipywidgets as w

        from .render import KernelFedBokehModel

        plots = KernelFedBokehModel(self.layout, combine_events=True, layout=w.Layout(width="100%"))
        self._live.append(plots)
        head = w.HBox([self.bar, self.bar_text], layout=w.Layout(align_items="center"))
        view = w.VBox([self.status, head, plots], _dom_classes=("taco-dashboard",), layout=w.Layout(width="100%"))
        self._views.append(view)
        return view

    def static_bundle(self) -> dict[str, str]:
        """The final picture as a display bundle: ``text/html`` (status, progress and the plots, self-contained)
        and ``text/plain`` (the summary)."""
        from .render import static_html

        style = "font-family:sans-serif;font-size:13px;margin:2px 0"
        header = f'<div class="taco-status" style="{style}"><b>taco</b> {_escape(self._status_text())}</div>'
        if self.progress is not None:
            header += f'<div class="taco-progress-text" style="{style}">{_escape(self.progress.text())}</div>'
        return {"text/plain": self.summary(), "text/html": static_html(self.layout, header)}

    def close_live_views(self, picture: str | None = None) -> None:
        """Close the live ``BokehModel`` widgets: the cell's output no longer shows them (see ``finish``).

        With ``picture`` (the final picture's HTML) each live view (its ``VBox`` stays open) shows that picture
        instead: a page reloaded from a notebook saved mid-run holds the live view's output, and fetches its
        widget from the kernel (mid-run too: :mod:`taco_notebook.ipp.comm_pump`); after the cell's end it finds
        the final picture there, not a closed model."""
        if picture is not None:
            import ipywidgets as w

            for view in self._views:
                view.children = (w.HTML(picture, layout=w.Layout(width="100%")),)
                view.remove_class("taco-dashboard")
        for plots in self._live:
            plots.close()
        self._live.clear()

    def _ipython_display_(self) -> None:
        """``taco.dashboard()``: the summary in text mode; the final picture (static) once the cell ended; else a
        live view."""
        from IPython.display import display

        if dashboard_mode() == "text":
            display({"text/plain": self.summary()}, raw=True)
        elif self.outcome is not None:
            display(self.static_bundle(), raw=True)
        else:
            from .render import display_bokehjs

            display_bokehjs()
            display(self.widget())

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.summary())

    def __repr__(self) -> str:
        return self.summary()


def _show_rows(layout: Any) -> None:
    """A row of the layout shows when one of its figures does (the stream shows a figure once it has data)."""
    for child in layout.children:
        child.visible = any(figure.visible for figure in child.children)


class _held:
    """Hold a bokeh document's change events while updating (one patch message per poll, not one per column)."""

    def __init__(self, layout: Any) -> None:
        self.document = layout.document

    def __enter__(self) -> None:
        if self.document is not None:
            self.document.hold("combine")

    def __exit__(self, *exc: object) -> None:
        if self.document is not None:
            self.document.unhold()


def _escape(text: str) -> str:
    import html

    return html.escape(text)


class CellDashboard:
    """What one cell shows: created before the cell, fed by the wait loop, finished when the cell ends.

    The :class:`Dashboard` is built at the first payload that carries metrics or progress, so a cell that
    trains nothing shows nothing.
    """

    wants_metrics = True

    def __init__(
        self, node_of_rank: Mapping[int, int], mode: str, *, title: str = "", capacity_bps: float | None = None
    ) -> None:
        if mode not in ("widget", "text"):
            raise ValueError(f"mode must be 'widget' or 'text', got {mode!r}")
        self.node_of_rank = dict(node_of_rank)
        self.mode = mode
        self.title = title
        self.capacity_bps = capacity_bps
        self.dashboard: Dashboard | None = None
        self.handles: list[Any] = []  # the live view's display handles (BokehJS loader, widget): replaced at the end
        self.started = time.monotonic()
        # bokeh and the widget libraries are slow to import: pay it before the cell runs, not mid-stream
        import bokeh.plotting  # noqa: F401

        if mode == "widget":
            import ipywidgets  # noqa: F401
            import jupyter_bokeh  # noqa: F401

    def update(self, payloads: Mapping[int, Mapping[str, Any]], running: Sequence[int]) -> None:
        if not any(p.get("progress") or (p.get("metrics") or {}).get("steps") for p in payloads.values()):
            return
        global _last
        if self.dashboard is None:
            self.dashboard = _last = Dashboard(self.node_of_rank, title=self.title, capacity_bps=self.capacity_bps)
            if self.mode == "widget":
                from IPython.display import display

                from .render import display_bokehjs

                self.handles = [display_bokehjs(), display(self.dashboard.widget(), display_id=True)]
        self.dashboard.update(payloads, running=len(running), elapsed=time.monotonic() - self.started)

    def membership_changed(self, text: str, node_of_rank: Mapping[int, int]) -> None:
        """Shown on the status line: the ranks an elastic cell lost or gained (cluster/elastic/recovery.py)."""
        self.node_of_rank = dict(node_of_rank)
        if self.dashboard is not None:
            self.dashboard.membership_changed(text, node_of_rank)

    def finish(self, outcome: str) -> None:
        if self.dashboard is None:
            return
        self.dashboard.finish(outcome, time.monotonic() - self.started)
        if self.handles:  # one final, self-contained picture in place of the live view; the loader blanked
            loader, live = self.handles
            self.handles = []
            try:
                picture = self.dashboard.static_bundle()
            except Exception:  # the training result matters more than its picture: keep the live view
                log.exception("could not render the dashboard's final picture; the live view stays")
                return
            live.update(picture, raw=True)
            loader.update({"text/plain": ""}, raw=True)
            self.dashboard.close_live_views(picture["text/html"])
        if self.mode == "text":
            sys.stdout.write(self.dashboard.summary() + "\n")
            sys.stdout.flush()
