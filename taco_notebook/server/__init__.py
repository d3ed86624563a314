"""Jupyter server extension: the REST API under ``/taco-notebook/api/`` that the JupyterLab sidebar polls.

Enabled on install (``jupyter-config/server-config/taco_notebook.json``); the extension point names
:func:`extension_app`, whose app adds the handlers and stops the server's clusters when the server shuts down.
Imports stay lazy: the package ``taco_notebook`` is imported on every MPI rank, so tornado and jupyter_server
load only when the server makes the app.
"""

from __future__ import annotations

from typing import Any

__all__ = ["API_PATH", "MANAGER_SETTING", "extension_app"]

API_PATH = "taco-notebook/api"
MANAGER_SETTING = "taco_notebook_manager"  # web_app.settings key of the ClusterManager


def extension_app() -> Any:
    """The extension's app (``_jupyter_server_extension_points``'s ``app``): jupyter_server calls this to make it,
    so tornado and jupyter_server are imported only then. It adds the handlers and, at server shutdown, stops the
    clusters the server started (:class:`~taco_notebook.server.handlers.TacoServerExtension`)."""
    from .handlers import TacoServerExtension

    return TacoServerExtension()
