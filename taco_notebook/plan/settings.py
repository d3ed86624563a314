"""The settings of ``%%taco_run`` and ``%taco_cluster`` as traitlets traits, made from the option table
(:mod:`.options`; the reference is ``docs/options.md``), with the maps of which setting goes where.

``TacoMagics`` is an IPython ``Magics``, so a traitlets ``Configurable``: ``c.TacoMagics.compression = "fp16"``
in ``ipython_config.py`` or ``%config TacoMagics.compression = "fp16"`` in a notebook sets the trait, and
``%config TacoMagics`` lists them. For each cell the magic's option wins, then the trait when set, then the
environment (read when the cell runs, so a kernel started with ``LIGHT_TOPK_ALLREDUCE=1`` behaves as a plain
``mpiexec`` job would), then the built-in default. Unset traits are None: they defer to the environment.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from traitlets import TraitError, TraitType, validate
from traitlets.config import Configurable

from .options import OPTIONS, option, traits

__all__ = ["TacoSettings", "RANK_SETTINGS", "CLUSTER_ENV", "KERNEL_ENV", "SLURM_SETTINGS", "check_setting",
           "setting_from_env"]

RANK_SETTINGS = tuple(row.name for row in OPTIONS if row.effect == "cell")  # the ranks' taco.configure() per cell
CLUSTER_ENV = {row.name: row.env for row in OPTIONS if row.effect == "cluster" and row.env}
# read by the kernel itself (setting_from_env) when neither the option nor the trait gives them
KERNEL_ENV = {row.name: row.env for row in OPTIONS if row.kernel_env and row.env}
SLURM_SETTINGS = tuple(row.name for row in OPTIONS if row.effect == "slurm")  # the slurm profile's job


def check_setting(name: str, value: Any, what: str) -> Any:
    """``value`` of setting ``name`` checked and made canonical; a ValueError naming ``what`` (the option, trait
    or variable it came from) and what is accepted."""
    check = option(name).check
    return value if check is None else check(value, what)


def setting_from_env(name: str) -> Any:
    """Setting ``name`` from its variable in :data:`KERNEL_ENV` (``TACO_LINK_GBITS=25``), checked as the option
    and the trait are; None when unset or blank, a ValueError naming the variable when bad."""
    variable = KERNEL_ENV[name]
    raw = os.environ.get(variable, "").strip()
    return check_setting(name, raw, variable) if raw else None


def _traits() -> dict[str, TraitType[Any, Any]]:
    """One configurable trait per row of the table that has one: unset (None) unless configured."""
    return {row.name: row.trait(None, allow_none=True, help=row.trait_help).tag(config=True)
            for row in traits() if row.trait is not None}


if TYPE_CHECKING:
    _SettingTraits = Configurable
else:  # traitlets collects traits when a class is made: the table's are made into a base class
    _SettingTraits = type("_SettingTraits", (Configurable,), _traits())


class TacoSettings(_SettingTraits):
    """The traits of the option table (:data:`~.options.OPTIONS`); ``TacoMagics`` inherits them."""

    if TYPE_CHECKING:  # what the table makes, for type checkers
        def __getattr__(self, name: str) -> Any: ...

    @validate(*(row.name for row in traits()))
    def _check_trait(self, proposal: Any) -> Any:
        value, name = proposal["value"], proposal["trait"].name
        if value is None:
            return None
        what = f"TacoMagics.{name}"
        try:
            return check_setting(name, value, what)
        except ValueError as exc:
            message = str(exc)
            raise TraitError(message if what in message else f"{what}: {message}") from None

    def chosen(self, name: str, option: Any, flag: str) -> Any:
        """The option's value when given (checked, a ValueError naming ``flag``), else the trait (None: unset)."""
        if option is not None:
            return check_setting(name, option, flag)
        return getattr(self, name)
