"""Jupyter server extension: the REST API under ``/taco-notebook/api/`` that the JupyterLab sidebar polls.

Enabled on install (``jupyter-config/server-config/taco_notebook.json``). Imports stay lazy: the package
``taco_notebook`` is imported on every MPI rank, so tornado and jupyter_server load only when the server
loads the extension.
"""

from __future__ import annotations

from typing import Any

__all__ = ["API_PATH", "MANAGER_SETTING", "_load_jupyter_server_extension"]

API_PATH = "taco-notebook/api"
MANAGER_SETTING = "taco_notebook_manager"  # web_app.settings key of the ClusterManager


def _load_jupyter_server_extension(serverapp: Any) -> None:
    """Add the handlers; the manager stops the clusters this server started when the server process exits."""
    from .handlers import setup_handlers

    setup_handlers(serverapp.web_app)
    serverapp.log.info("taco_notebook server extension: REST API at %s%s/", serverapp.base_url, API_PATH)
