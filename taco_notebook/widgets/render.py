"""How the dashboard's bokeh plots reach the page: a live ``BokehModel`` while a cell runs, a static picture after.

Two problems of jupyter_bokeh 4.1 in a notebook, and what this module does about them:

* **Echoed patches.** Its ``BokehView`` applies each patch the kernel sends, and BokehJS reports the change it
  made back to the view's ``on_change`` listener (flagged ``sync=false``, a flag the view ignores), so the view
  sends every ``ColumnsStreamed`` back to the kernel, where ``BokehModel._sync_model`` streams the same points a
  second time. The kernel reads those messages only once the training cell is over; then every series holds
  its points twice, and any other view of the same document (``taco.dashboard()`` in the next cell, queued
  ahead of the echoes by "Run All") receives the whole series again: a segment from the last point back to the
  first, "bytes saved" drawn twice. The view also sends the ranges it computed (``DataRange1d.start``/``end``
  of its first render), which then pin the kernel's figures to a stale window. :class:`KernelFedBokehModel`
  applies nothing the browser sends: the dashboard is drawn from the kernel only (no Python callbacks, no
  editable data), and zooming or panning stays in the page.
* **Reload.** ``BokehView`` finds BokehJS through ``window.Bokeh``. A kernel that loaded it once does not know
  that a reloaded page has not: a live view then fails with "Cannot read properties of undefined (reading
  'require')". :func:`display_bokehjs` puts the (inline) loader before every live view, and the cell's end
  replaces both with :func:`static_html`, a self-contained rendering that needs no kernel and no widget
  manager (a reloaded page, a saved notebook, nbviewer). A page reloaded while the cell still runs fetches the
  live view's state from the kernel (``ipp/comm_pump.py``): :meth:`KernelFedBokehModel.get_state` hands it the
  document as it is then, not as it was when the view was made, and the patches that follow draw on from there.
"""

from __future__ import annotations

import html
import json
from typing import Any

from bokeh.core.json_encoder import serialize_json
from jupyter_bokeh import BokehModel

from .plots import FIGURE_PX

__all__ = ["KernelFedBokehModel", "display_bokehjs", "static_html"]

ROW_MARGIN_PX = 50  # what a row of the page takes beyond its tallest figure


class KernelFedBokehModel(BokehModel):
    """A ``jupyter_bokeh.BokehModel`` (same frontend model and view) that keeps the kernel's document one-way:
    kernel → page. What the page sends (echoed streams, computed ranges, tool events) is not applied."""

    def get_state(self, key: Any = None, drop_defaults: bool = False) -> dict[str, Any]:
        """The widget's state; asked for whole once the widget is open (a page reloaded mid-run fetching it), its
        ``render_bundle`` is the document now: the bundle made with the widget holds none of the points streamed
        since, and a new page gets only the patches sent after it asked."""
        state: dict[str, Any] = super().get_state(key, drop_defaults)
        if key is None and "render_bundle" in state and self.comm is not None and self._document is not None:
            state["render_bundle"] = serialize_json(self._model_to_traits(self._model))
        return state

    def _sync_model(self, _model: BokehModel, content: dict[str, Any], _buffers: list[Any]) -> None:
        return  # an echo of the kernel's own change, or view state (ranges) that must not pin the kernel's figures

    def close(self) -> None:
        """Close once: ``BokehModel.close`` raises ``KeyError`` when called again (``Widget.__del__`` does)."""
        if getattr(self, "_taco_closed", False):
            return
        self._taco_closed = True
        super().close()


def _inline_resources() -> Any:
    from bokeh.resources import Resources

    return Resources(mode="inline", components=["bokeh"])  # the page may have no internet; core bokeh suffices


def display_bokehjs() -> Any:
    """Show BokehJS's inline loader (it runs before the views displayed after it) and return its display handle,
    so the cell's end can blank it. The loader does nothing where the page already has this BokehJS version."""
    from bokeh import __version__
    from bokeh.embed.bundle import bundle_for_objs_and_resources
    from bokeh.io.notebook import JS_MIME_TYPE, LOAD_MIME_TYPE, _loading_js
    from IPython.display import display

    bundle = bundle_for_objs_and_resources(None, _inline_resources())
    guard = f"if (window.Bokeh == null || window.Bokeh.version !== {json.dumps(__version__)})"
    data = {
        JS_MIME_TYPE: f"{guard} {{\n{_loading_js(bundle, None, register_mime=True)}\n}}",
        LOAD_MIME_TYPE: f"{guard} {{\n{_loading_js(bundle, None, register_mime=False)}\n}}",
    }
    return display(data, raw=True, display_id=True)


def _shown_height(child: Any) -> int:
    """The height a child of the layout takes on the page: a row shows when one of its figures does, as tall as
    its tallest visible figure (figures grow with their legend's rows, ``plots.fit_legend``) and a margin."""
    from bokeh.models import LayoutDOM

    if not isinstance(child, LayoutDOM):
        return 0
    children: list[Any] | None = getattr(child, "children", None)
    heights = [c.height or FIGURE_PX for c in (children or [child]) if c.visible]
    return max(heights) + ROW_MARGIN_PX if heights else 0


def static_html(layout: Any, header: str = "", title: str = "taco dashboard") -> str:
    """The plots as one self-contained HTML fragment: an ``<iframe srcdoc>`` holding a standalone bokeh page
    (BokehJS inline), under ``header`` (HTML). The frame keeps that BokehJS apart from the notebook page's
    own (live views, other cells)."""
    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    page = file_html(layout, resources=INLINE, title=title)  # INLINE: only the BokehJS parts the layout uses
    shown = sum(_shown_height(child) for child in getattr(layout, "children", [layout]))
    height = (shown or FIGURE_PX + ROW_MARGIN_PX) + 20
    frame = (f'<iframe class="taco-static-plots" title="{html.escape(title)}" srcdoc="{html.escape(page)}" '
             f'style="width:100%;height:{height}px;border:0" loading="eager"></iframe>')  # fmt: skip
    return f'<div class="taco-static-dashboard">{header}{frame}</div>'
