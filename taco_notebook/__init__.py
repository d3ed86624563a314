"""taco_notebook: train PyTorch models on many MPI ranks from a Jupyter notebook.

In a notebook::

    %load_ext taco_notebook

    %%taco_run -np 4
    t = torch.full((3,), float(taco.rank()))
    taco.allreduce(t)

Outside one, the rank-side API is :mod:`taco_notebook.comm` (``mpiexec -n 4 python train.py``).
Imports stay lazy: this package is imported on every rank at launch.
"""

from __future__ import annotations

from typing import Any

from ._version import __version__

__all__ = ["__version__", "dashboard", "load_ipython_extension", "unload_ipython_extension"]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """The prebuilt JupyterLab sidebar, for ``jupyter labextension develop`` (pip installs it as shared data)."""
    return [{"src": "labextension", "dest": "taco-notebook"}]


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    """The Jupyter server extension (REST API for the sidebar); ``taco_notebook.server`` loads it lazily."""
    from .server import extension_app  # light: the app's class (and jupyter_server) is imported when it is made

    return [{"module": "taco_notebook.server", "app": extension_app}]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext taco_notebook``: register ``%%taco_run``, ``%taco_cluster``, ``%taco_doctor`` and the debugger's
    ``%taco_debug``, ``%taco_peek``, ``%taco_diff``; ``taco`` is
    this package (``taco.dashboard()``) unless the name is already taken."""
    import sys

    from .magics import TacoDebugMagics, TacoMagics

    ipython.register_magics(TacoMagics)
    ipython.register_magics(TacoDebugMagics)
    # taco.tune's result, returned from the ranks, drawn as a table (the formatter imports the widgets when used)
    html = ipython.display_formatter.formatters["text/html"]
    html.for_type_by_name("taco_notebook.comm.training.advisor", "TuneResult", _tune_html)
    if "taco" not in ipython.user_ns:
        ipython.push({"taco": sys.modules[__name__]})


def _tune_html(result: Any) -> str:
    from .widgets.tune import tune_html

    return tune_html(result)


def dashboard() -> Any:
    """The last ``%%taco_run`` cell's dashboard, to show again or read (``.summary()``).

    Shown as the last line of a cell it is its final picture (static, self-contained) once that cell ended, or
    the text summary where no widget frontend listens.

    Example: ``taco.dashboard()`` as the last line of a notebook cell.
    """
    from .errors import TacoError
    from .widgets.dashboard import last_dashboard

    last = last_dashboard()
    if last is None:
        raise TacoError("no dashboard yet: a %%taco_run cell shows one once its ranks report metrics "
                        "(taco.DistributedOptimizer steps, taco.metrics.step() or a taco.progress loop)")
    return last


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext taco_notebook``: stop the clusters this kernel started."""
    from .cluster.session import stop_all

    stop_all()
