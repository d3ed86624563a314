"""What the notebook sends a rank for a cell and what the rank replies, as frozen values.

Values are checked once, where they enter (the option table, :mod:`taco_notebook.plan.resolve`), and carried
as these types from there: the ranks never parse an option's text again. Imports nothing of the package at run
time, so the notebook's modules can hold these types without importing the ranks' ``comm``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # not at run time: importing taco_notebook.comm sets up a rank (its excepthook, its GPU)
    from ..comm.compression.spec import CompressionSpec

__all__ = ["Output", "CellSettings", "CellSetup", "CellReply", "SEND_S"]

Output = Literal["all", "rank0", "errors"]
SEND_S = 0.4  # 2.5 redraws a second: what a person can follow; more only costs the ranks and the notebook


@dataclass(frozen=True)
class CellSettings:
    """A cell's own ``taco.configure()`` (``%%taco_run --algorithm/--compression/--fusion-mb/--stall-timeout``
    or their traits): each setting given, None where the rank keeps its own."""

    algorithm: str | None = None
    compression: CompressionSpec | None = None
    auto_compression: bool = False  # --compression auto: taco.tune's remembered choice on the cluster
    fusion_mb: float | None = None
    stall_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.auto_compression and self.compression is not None:
            raise ValueError("a cell's compression is either a spec or auto, not both")

    def configure_kwargs(self, auto: CompressionSpec | None = None) -> dict[str, Any]:
        """``taco.configure``'s keyword arguments for the settings given (``auto``: what auto chose)."""
        given = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "auto_compression"}
        if self.auto_compression:
            given["compression"] = auto
        return {name: value for name, value in given.items() if value is not None}


@dataclass(frozen=True)
class CellSetup:
    """What a cell's runner does on the rank before and after the code."""

    dashboard: bool = True  # send metrics while it runs (some monitor watches)
    settings: CellSettings | None = None  # taco.configure() for this cell only
    reset: bool = False  # taco.configure(reset=True) after it (the settings were set here or by configure_cell)
    output: Output = "all"  # whose stdout is sent: all, rank0 (and a failing rank's) or errors (failing ranks')
    interval: float = SEND_S  # seconds between this rank's dashboard payloads
    # a request that sent nothing on IOPub ends without the idle status, its reply saying so: for a caller
    # whose RankTracker takes such a reply as the end of the output
    silent: bool = False
    # the rank whose value of the last expression the reply brings back (None: every rank's, as ``--gather``
    # shows them): a value the notebook does not show is neither pickled nor sent (a cell ending in
    # ``taco.allreduce(t)`` would send every rank's ``t``)
    value_from: int | None = None


@dataclass(frozen=True)
class CellReply:
    """A runner's reply: the value of the cell's last expression (when asked for), whether this rank trained
    something the replica check can compare, and whether the request sent nothing on IOPub."""

    value: Any = None
    replicas: bool = False
    silent: bool = False
