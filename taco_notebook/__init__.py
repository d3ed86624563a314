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

__version__ = "0.1.0"
__all__ = ["__version__", "load_ipython_extension", "unload_ipython_extension"]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext taco_notebook``: register ``%%taco_run`` and ``%taco_cluster``."""
    from .magics import TacoMagics

    ipython.register_magics(TacoMagics)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext taco_notebook``: stop the clusters this kernel started."""
    from .cluster.session import stop_all

    stop_all()
