"""The checks of the settings' values: each takes the value and ``what`` it came from (an option, a trait or a
variable) and returns the value made canonical, or raises a ValueError naming ``what`` and what is accepted.

The option table (:mod:`.options`) names one per option; modules they need are imported when a value is checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Check", "algorithm", "compression", "fusion_mb", "stall_timeout", "choice", "dashboard_modes", "hosts",
           "address", "positive", "flag", "text"]

Check = Callable[[Any, str], Any]


def algorithm(value: Any, what: str) -> str:
    """``auto``, ``flat`` or ``2d``, any case."""
    from ..comm.specs import check_algorithm

    return check_algorithm(value.strip().lower() if isinstance(value, str) else value)


def compression(value: Any, what: str) -> str:
    """A compression spec in its canonical form (``TopK:0.01`` → ``topk:0.01``), or ``auto`` (the ranks use what
    ``taco.tune`` last recommended on the cluster, else none)."""
    from ..comm.compression.spec import CompressionSpec
    from ..comm.training.advisor import AUTO

    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        return CompressionSpec.parse(value).name
    except ValueError as exc:  # its message names the spec and what is accepted; auto is this option's own
        raise ValueError(f"{exc}, or auto (taco.tune's choice)") from None


def fusion_mb(value: Any, what: str) -> float:
    """Megabytes >= 0 (0: no fusion)."""
    from ..comm.specs import check_fusion_mb

    try:
        return check_fusion_mb(float(value))
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of megabytes >= 0, got {value!r}") from None


def stall_timeout(value: Any, what: str) -> float:
    """Seconds > 0, or 0/off: never."""
    from ..comm.specs import check_stall_timeout

    return check_stall_timeout(value, what)


def choice(choices: tuple[str, ...] | Callable[[], tuple[str, ...]]) -> Callable[[Any, str], str]:
    """A check that the value is one of ``choices`` (or of what ``choices()`` gives, for a module imported late)."""
    def check(value: Any, what: str) -> str:
        from ..comm.specs import check_choice

        return check_choice(value, choices if isinstance(choices, tuple) else choices(), what)

    return check


def dashboard_modes() -> tuple[str, ...]:
    """The dashboard's modes, read from the widgets when a mode is checked."""
    from ..widgets.dashboard import DASHBOARD_MODES  # imports bokeh: only when a dashboard mode is checked

    return DASHBOARD_MODES


def hosts(value: Any, what: str) -> str:
    """``HOST:SLOTS,…`` as the hosts profile reads it."""
    from ..cluster.launch.profiles import parse_hosts

    parse_hosts(str(value), what)  # a ProfileError (a ValueError) naming the entry and the form
    return str(value)


def address(value: Any, what: str) -> str:
    """An IP address that is not 0.0.0.0 or ``::``."""
    import ipaddress

    try:
        if not ipaddress.ip_address(str(value)).is_unspecified:
            return str(value)
    except ValueError:
        pass
    raise ValueError(f"{what} must be this machine's address that the hosts reach, got {value!r}")


def positive(unit: str, convert: Callable[[Any], Any] = float) -> Callable[[Any, str], Any]:
    """A check for a positive, finite number of ``unit``, made by ``convert``."""
    def check(value: Any, what: str) -> Any:
        from ..comm.specs import check_positive

        return check_positive(value, what, unit, convert)

    return check


def flag(value: Any, what: str) -> bool:
    """A bool, or its text: 1/true/yes/on or 0/false/no/off."""
    if isinstance(value, bool):
        return value
    from ..comm.specs import parse_flag

    flag = parse_flag(what, str(value))
    if flag is None:
        raise ValueError(f"{what} must be 1/true/yes/on or 0/false/no/off, got {value!r}")
    return flag


def text(value: Any, what: str) -> str:
    """Any text (a path checked where it is used)."""
    return str(value)

