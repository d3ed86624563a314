"""The node report behind ``%taco_doctor``, as data: each node's facts and :class:`Finding` s (what is wrong, and
what to do), the links measured between nodes, and :func:`require_hugepages`.

Facts come from :func:`taco_notebook.cluster.doctor.nodefacts.node_facts`, run where each node is; gathering them
into a report is :mod:`.collect`'s (through command prefixes) and :mod:`.engines`' (through a cluster's engines).
This model knows nothing of how it is shown: :mod:`.render` draws it (text for a terminal, HTML for a notebook)
and imports it, never the reverse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from ...errors import TacoError
from .findings import Finding, diagnose, diagnose_cluster, page_label, parse_page_size

__all__ = ["Finding", "NodeReport", "DoctorReport", "HugePagesError", "diagnose", "require_hugepages"]


class HugePagesError(TacoError):
    """Nodes lack the free huge pages a job was told to require (``--require-hugepages N``)."""


@dataclass
class NodeReport:
    """One node: its facts (``node_facts()``'s dict, or ``{"node", "error"}`` when unreadable) and findings."""

    facts: dict[str, Any]
    findings: list[Finding] = field(default_factory=list)

    @classmethod
    def from_facts(cls, facts: dict[str, Any]) -> NodeReport:
        return cls(facts, diagnose(facts))

    @property
    def name(self) -> str:
        return str(self.facts.get("node") or self.facts.get("hostname") or "?")

    def hugepages(self, page_kb: int) -> dict[str, int] | None:
        """``{"total", "free", "reserved"}`` for pages of ``page_kb``; None where the node does not offer them."""
        pool = self.facts.get("hugepages", {}).get("pools", {}).get(str(page_kb))
        return dict(pool) if pool is not None else None


R = TypeVar("R", bound="DoctorReport")


@dataclass
class DoctorReport:
    """Every node's report and the measured links (:class:`.render.ShownReport` is the same, shown as a table).

    ``links``: ``{"from", "to", "gbit_per_s"}`` per measured pair (``"error"`` instead when it failed); empty
    for a single node, whose link column reads "n/a".
    """

    nodes: list[NodeReport]
    links: list[dict[str, Any]] = field(default_factory=list)
    # problems between nodes (different MPIs, a link that failed), from diagnose_cluster
    cluster_findings: list[Finding] = field(default_factory=list)

    @property
    def findings(self) -> list[tuple[str, Finding]]:
        """(node, finding) for every node, and ("cluster", finding) for those between them; errors first."""
        order = {"error": 0, "warning": 1, "info": 2}
        pairs = [(node.name, f) for node in self.nodes for f in node.findings]
        pairs += [("cluster", f) for f in self.cluster_findings]
        return sorted(pairs, key=lambda pair: order.get(pair[1].severity, 3))

    @property
    def ok(self) -> bool:
        """No finding of severity "error"."""
        return not any(f.severity == "error" for _, f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": [{"facts": n.facts, "findings": [asdict(f) for f in n.findings]} for n in self.nodes],
                "links": self.links, "cluster_findings": [asdict(f) for f in self.cluster_findings]}

    @classmethod
    def from_facts(cls: type[R], facts: Sequence[dict[str, Any]], links: Sequence[dict[str, Any]] = ()) -> R:
        """Diagnose each node's ``facts`` and what lies between them (``links``), as a report of this class."""
        facts = [dict(f) for f in facts]
        return cls([NodeReport.from_facts(f) for f in facts], list(links), diagnose_cluster(facts, list(links)))


def require_hugepages(reports: Sequence[NodeReport] | DoctorReport, n: int, page_size: str = "default") -> None:
    """Raise :class:`HugePagesError` naming every node with fewer than ``n`` free huge pages of ``page_size``.

    ``page_size``: ``"2M"``, ``"1G"``, or ``"default"`` (each node's default huge page size, the one its
    ``/dev/hugepages`` and ``vm.nr_hugepages`` use: 1 GB on nodes booted with ``default_hugepagesz=1GB``).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of huge pages to require must be a positive integer, got {n!r}")
    nodes = reports.nodes if isinstance(reports, DoctorReport) else list(reports)
    wanted = None if page_size == "default" else parse_page_size(page_size)
    short = []
    for node in nodes:
        if "error" in node.facts:
            short.append(f"{node.name} (could not be read: {node.facts['error']})")
            continue
        size = wanted or node.facts.get("hugepages", {}).get("default_kb") or 2048
        pool = node.hugepages(size)
        if pool is None:
            short.append(f"{node.name} (offers no {page_label(size)} pages)")
        elif pool["free"] < n:
            short.append(f"{node.name} ({pool['free']} free of {pool['total']} {page_label(size)} pages)")
    if short:
        what = "of its default size" if wanted is None else page_label(wanted)
        raise HugePagesError(
            f"{len(short)} of {len(nodes)} node{'s' if len(nodes) != 1 else ''} lack {n} free huge pages "
            f"{what}: {'; '.join(short)}. Reserve them on those nodes (2 MB: `sysctl -w vm.nr_hugepages=N`; "
            "1 GB: `default_hugepagesz=1GB hugepagesz=1GB hugepages=N` on the kernel command line and a reboot), "
            "or start without requiring huge pages.")

