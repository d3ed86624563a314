"""``--horovod``: a Horovod PyTorch script runs with no edit, its ``horovod`` imports answered by taco's face.

While :func:`as_horovod` is entered (around the script, on each rank: :func:`~taco_notebook.engine.runner.
run_script`), ``import horovod.torch as hvd`` gives :mod:`taco_notebook.horovod`, ``horovod.torch.mpi_ops`` and
the face's other modules give theirs, and ``import horovod`` gives a package whose ``run`` says why it cannot start
processes here (the script already runs on every rank). Any other ``horovod.*`` module (``horovod.tensorflow``,
``horovod.spark``, ...) fails to import with a ModuleNotFoundError that names what is provided. On leaving, every
name is put back as it was: without the option nothing is shadowed, and a real Horovod installed beside taco is
untouched.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.machinery import ModuleSpec
from typing import Any

__all__ = ["as_horovod", "HorovodRunError", "PROVIDED"]

PROVIDED = ("horovod", "horovod.torch")


class HorovodRunError(RuntimeError):
    """``horovod.run`` called under ``--horovod``: taco starts the ranks, not the script."""


def _run(*args: Any, **kwargs: Any) -> Any:
    raise HorovodRunError(
        "horovod.run starts processes of its own; under taco's --horovod this script already runs on every rank, "
        "so call the training function directly (in Horovod's examples: leave out --num-proc)")


class _Refuse:
    """A meta path finder that answers any other ``horovod.*`` module with an error saying what is provided."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: Any = None) -> ModuleSpec | None:
        if fullname.startswith("horovod."):
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: taco's --horovod provides {' and '.join(PROVIDED)} (and "
                f"horovod.torch's modules) as its PyTorch face; other Horovod frameworks are not matched "
                f"(docs/horovod-and-ddp.md)", name=fullname)
        return None


def _names() -> dict[str, types.ModuleType]:
    """The modules to shadow: ``horovod``, ``horovod.torch`` and each module of the face under it."""
    face = importlib.import_module("taco_notebook.horovod")
    package = types.ModuleType("horovod", "Horovod's package, as taco's --horovod provides it: only its PyTorch "
                                          "face (horovod.torch) and horovod.run's name")
    package.__path__ = []  # a package: its submodules come from sys.modules, or the refusal above
    package.torch = face  # type: ignore[attr-defined]
    package.run = _run  # type: ignore[attr-defined]
    names = {"horovod": package, "horovod.torch": face}
    for info in pkgutil.iter_modules(face.__path__):
        if info.name != "shadow":
            names[f"horovod.torch.{info.name}"] = importlib.import_module(f"taco_notebook.horovod.{info.name}")
    return names


@contextmanager
def as_horovod() -> Iterator[None]:
    """Shadow ``horovod`` and ``horovod.torch`` with taco's face while entered (see the module docstring)."""
    names = _names()
    saved = {name: sys.modules.get(name) for name in names}
    others = {name: module for name, module in sys.modules.items()
              if name.startswith("horovod.") and name not in names}  # a real Horovod's other modules
    refuse = _Refuse()
    for name in others:
        del sys.modules[name]
    sys.modules.update(names)
    sys.meta_path.insert(0, refuse)
    try:
        yield
    finally:
        sys.meta_path.remove(refuse)
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        sys.modules.update(others)
