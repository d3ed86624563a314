"""The node report behind ``%taco_doctor``: facts from every node, their problems with remedies, the links.

Facts come from :func:`taco_notebook.cluster.doctor.nodefacts.node_facts`, run where each node is (an engine's
``view.apply``, or ``python -m taco_notebook.cluster.doctor.nodefacts`` through a command prefix: ``ssh HOST python3``,
``ip netns exec NS python``). :func:`diagnose` turns one node's facts into :class:`Finding` s, each with what to
do; :class:`DoctorReport` shows them as one table (HTML in a notebook, text in a terminal)::

    report = diagnose_nodes({"n0": ["ssh", "n0", "python3"], "n1": ["ssh", "n1", "python3"]},
                            addresses={"n0": "10.0.0.1", "n1": "10.0.0.2"})
    report                          # the table, then each node's problems and their remedies
    require_hugepages(report.nodes, 50, "1G")   # raises HugePagesError naming the nodes short of them
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ...comm.linkspeed import LinkSpeedError, measure_link
from ...errors import TacoError
from .findings import Finding, diagnose, diagnose_cluster, page_label, parse_page_size

__all__ = ["Finding", "NodeReport", "DoctorReport", "HugePagesError", "diagnose", "local_report",
           "diagnose_nodes", "read_node_facts", "measure_links", "report_from_facts", "require_hugepages"]

_FACTS_TIMEOUT_S = 180.0  # a loaded node imports torch slowly; 2 cores under test load took ~20 s


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


@dataclass
class DoctorReport:
    """Every node's report and the measured links; ``str()`` is the terminal table, ``_repr_html_`` the notebook's.

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

    def __str__(self) -> str:
        from .render import render_text

        return render_text(self)

    def _repr_html_(self) -> str:
        from .render import render_html

        return render_html(self)


def report_from_facts(facts: Sequence[dict[str, Any]], links: Sequence[dict[str, Any]] = ()) -> DoctorReport:
    """A report from facts gathered elsewhere (e.g. ``node_facts`` applied on one engine per node)."""
    facts = [dict(f) for f in facts]
    return DoctorReport([NodeReport.from_facts(f) for f in facts], list(links), diagnose_cluster(facts, list(links)))


def local_report() -> DoctorReport:
    """This machine alone: its facts read in this process, no link to measure."""
    from .nodefacts import node_facts

    return report_from_facts([node_facts()])


def read_node_facts(name: str, runner: Sequence[str], timeout: float = _FACTS_TIMEOUT_S) -> dict[str, Any]:
    """``python -m taco_notebook.cluster.doctor.nodefacts`` through ``runner`` (a prefix ending in a Python
    interpreter).

    Named ``name`` in the report whatever its hostname (namespace nodes share one). A node that cannot be read
    gives ``{"node": name, "error": why}``, which :func:`diagnose` reports as an error, instead of raising.
    """
    argv = [*runner, "-m", "taco_notebook.cluster.doctor.nodefacts"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"node": name, "error": f"`{' '.join(argv)}` did not finish: {exc}"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        said = done.stderr.strip().splitlines()
        return {"node": name, "error": f"`{' '.join(argv)}` exited {done.returncode}: "
                                       f"{said[-1] if said else 'no output'}"}
    facts: dict[str, Any] = json.loads(lines[-1])
    facts["node"] = name
    return facts


def measure_links(runners: Mapping[str, Sequence[str]], addresses: Mapping[str, str],
                  seconds: float = 1.0) -> list[dict[str, Any]]:
    """Each node sends to the next for ``seconds`` (a ring: n0→n1, n1→n2, …, back to n0 for three or more).

    One measurement at a time, so no two share a link; a failed one is recorded with its error.
    """
    names = list(runners)
    if len(names) < 2:
        return []
    receivers = names[1:] + names[:1]
    pairs = list(zip(names, receivers, strict=True)) if len(names) > 2 else [(names[0], names[1])]
    links = []
    for sender, receiver in pairs:
        try:
            result = measure_link(runners[receiver], runners[sender], addresses[receiver], seconds)
            links.append({"from": sender, "to": receiver, "gbit_per_s": result["gbit_per_s"],
                          "bytes": result["bytes"], "seconds": result["seconds"]})
        except (LinkSpeedError, KeyError, OSError) as exc:
            links.append({"from": sender, "to": receiver, "gbit_per_s": None, "error": str(exc)})
    return links


def diagnose_nodes(runners: Mapping[str, Sequence[str]], addresses: Mapping[str, str] | None = None,
                   seconds: float = 1.0) -> DoctorReport:
    """Facts from each node through its runner, then the links between them where ``addresses`` are given."""
    facts = [read_node_facts(name, runner) for name, runner in runners.items()]
    links = measure_links(runners, addresses, seconds) if addresses else []
    return report_from_facts(facts, links)


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

