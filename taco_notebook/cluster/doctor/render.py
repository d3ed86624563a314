"""The doctor's table: a row per node, then the problems, each with its remedy and the nodes that have it; text
for a terminal, HTML for a notebook. Both come from the same cells (:func:`rows`), so they say the same thing.

This module imports the report (:mod:`.report`), never the reverse: :class:`ShownReport` is the report the
doctor's entry points (:mod:`.collect`, :mod:`.engines`) hand a user, which shows itself through these functions.
"""

from __future__ import annotations

import html
from typing import Any

from .findings import Finding
from .report import DoctorReport, NodeReport

__all__ = ["COLUMNS", "rows", "grouped_findings", "render_text", "render_html", "ShownReport"]

COLUMNS = ("node", "huge pages 2 MB", "huge pages 1 GB", "GPUs", "NICs", "CPUs / NUMA", "MPI", "torch / NCCL",
           "link (1 s TCP)")
_CELL_STYLE = "text-align:left;vertical-align:top;padding:2px 8px"
_MARK = {"error": "✗", "warning": "!", "info": "·"}


def _pages(node: NodeReport, page_kb: int) -> list[str]:
    pool = node.hugepages(page_kb)
    if pool is None:
        return ["not offered"]
    mounts = [str(m["path"]) for m in node.facts.get("hugepages", {}).get("mounts", [])
              if m.get("page_kb") == page_kb]
    return [f"{pool['free']} free of {pool['total']}", *(mounts or ["not mounted"])]


def _gpus(facts: dict[str, Any]) -> list[str]:
    gpus = facts.get("gpus", {})
    listed = gpus.get("gpus", [])
    if not listed:
        return ["none" if gpus.get("tool") in ("ok", "missing") else "nvidia-smi failed"] + \
            (["nvidia-smi missing"] if gpus.get("tool") == "missing" else [])
    models: dict[str, int] = {}
    for gpu in listed:
        memory = f", {gpu['memory_mib'] / 1024:.0f} GiB" if gpu.get("memory_mib") else ""
        models[f"{gpu['name']}{memory}"] = models.get(f"{gpu['name']}{memory}", 0) + 1
    lines = [f"{count} × {model}" for model, count in models.items()]
    if gpus.get("tool") == "missing":
        lines.append("nvidia-smi missing")
    return lines


def _nics(facts: dict[str, Any]) -> list[str]:
    lines = []
    for nic in facts.get("nics", []):
        speed = f"{nic['speed_mbit'] / 1000:g} Gbit/s" if nic.get("speed_mbit") else "speed ?"
        state = "" if nic.get("up") else " (down)"
        lines.append(f"{nic['name']} {speed} mtu {nic.get('mtu')}{state}")
    return lines or ["none"]


def _cpus(facts: dict[str, Any]) -> list[str]:
    cpu = facts.get("cpu", {})
    numa = cpu.get("numa_nodes", [])
    return [f"{cpu.get('cpus')} cpus ({cpu.get('usable_cpus')} usable)",
            f"{len(numa)} NUMA: " + ", ".join(f"{n['node']}:{n['cpus']}" for n in numa) if numa else "NUMA ?"]


def _mpi(facts: dict[str, Any]) -> list[str]:
    mpi = facts.get("mpi", {})
    if mpi.get("mpiexec") == "missing":
        return ["mpiexec missing"]
    lines = [f"{mpi.get('implementation')} {mpi.get('version')}"]
    loaded = mpi.get("mpi4py", {})
    if loaded.get("error"):
        lines.append("mpi4py: error")
    elif (loaded.get("implementation"), loaded.get("version")) == (mpi.get("implementation"), mpi.get("version")):
        lines.append(f"mpi4py {loaded.get('mpi4py')} agrees")
    else:
        lines.append(f"mpi4py on {loaded.get('implementation')} {loaded.get('version')}")
    return lines


def _torch(facts: dict[str, Any]) -> list[str]:
    torch = facts.get("torch", {})
    lines = [str(torch.get("version"))]
    if torch.get("cuda"):
        lines.append(f"CUDA {torch['cuda']}, NCCL {torch.get('nccl') or 'n/a'}")
    return lines


def _link(report: DoctorReport, name: str) -> list[str]:
    if len(report.nodes) < 2:
        return ["n/a (one node)"]
    lines = []
    for link in report.links:
        if link.get("from") == name:
            rate = f"{link['gbit_per_s']:.2f} Gbit/s" if link.get("gbit_per_s") is not None else "failed"
            lines.append(f"→ {link['to']}: {rate}")
    return lines or ["not measured"]


def rows(report: DoctorReport) -> list[list[list[str]]]:
    """One row per node, one cell per :data:`COLUMNS` entry, each cell a list of lines."""
    table = []
    for node in report.nodes:
        if "error" in node.facts:
            table.append([[node.name], ["unreadable"], *([[""]] * (len(COLUMNS) - 3)), _link(report, node.name)])
            continue
        facts = node.facts
        table.append([[node.name] + ([str(facts["hostname"])] if facts.get("hostname") not in (None, node.name)
                                      else []),
                      _pages(node, 2048), _pages(node, 1024 * 1024), _gpus(facts), _nics(facts), _cpus(facts),
                      _mpi(facts), _torch(facts), _link(report, node.name)])
    return table


def grouped_findings(report: DoctorReport) -> list[tuple[Finding, list[str]]]:
    """Each distinct finding once, with the nodes that have it, errors first: 100 nodes missing the same pages
    read as one line, not 100."""
    groups: dict[Finding, list[str]] = {}
    for name, finding in report.findings:
        groups.setdefault(finding, []).append(name)
    return list(groups.items())


def render_text(report: DoctorReport) -> str:
    """The table with aligned, multi-line cells, then per node its problems (✗ error, ! warning, · info)."""
    table = [[[c] for c in COLUMNS], *rows(report)]
    widths = [max(len(line) for row in table for line in row[i]) for i in range(len(COLUMNS))]
    rule = "-+-".join("-" * w for w in widths)
    out = []
    for row in table:
        for k in range(max(len(cell) for cell in row)):
            out.append(" | ".join((cell[k] if k < len(cell) else "").ljust(w)
                                  for cell, w in zip(row, widths, strict=True)).rstrip())
        out.append(rule)
    healthy = [node.name for node in report.nodes if not node.findings]
    if healthy:
        out.append(f"{', '.join(healthy)}: no problems found")
    for finding, names in grouped_findings(report):
        out.append(f"{_MARK.get(finding.severity, '?')} [{finding.severity}] {', '.join(names)}: {finding.problem}")
        out.append(f"    fix: {finding.remedy}")
    for node in report.nodes:
        topology = node.facts.get("gpus", {}).get("topology")
        if topology:
            out.append(f"GPU topology of {node.name} (nvidia-smi topo -m):")
            out.extend(f"    {line}" for line in topology.splitlines())
    return "\n".join(out)


def _cell_html(lines: list[str]) -> str:
    return "<br>".join(html.escape(line) for line in lines)


def render_html(report: DoctorReport) -> str:
    """The same table as HTML, each node's problems in a list under it, topology in a collapsed block."""
    colour = {"error": "#b00020", "warning": "#a15c00", "info": "#555"}
    head = "".join(f"<th style='{_CELL_STYLE}'>{html.escape(c)}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td style='{_CELL_STYLE}'>{_cell_html(cell)}</td>" for cell in row) + "</tr>"
                   for row in rows(report))
    parts = [f"<table class='taco-doctor'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"]
    healthy = [node.name for node in report.nodes if not node.findings]
    if healthy:
        parts.append(f"<p><b>{html.escape(', '.join(healthy))}</b>: no problems found</p>")
    items = "".join(
        f"<li><span style='color:{colour.get(f.severity, '#000')}'>[{html.escape(f.severity)}]</span> "
        f"<b>{html.escape(', '.join(names))}</b>: {html.escape(f.problem)}<br><small>fix: "
        f"{html.escape(f.remedy)}</small></li>" for f, names in grouped_findings(report))
    if items:
        parts.append(f"<ul>{items}</ul>")
    for node in report.nodes:
        topology = node.facts.get("gpus", {}).get("topology")
        if topology:
            parts.append(f"<details><summary>GPU topology of {html.escape(node.name)}</summary>"
                         f"<pre>{html.escape(topology)}</pre></details>")
    return "<div class='taco-doctor-report'>" + "".join(parts) + "</div>"


class ShownReport(DoctorReport):
    """A :class:`DoctorReport` as a user sees it: ``str()`` is the terminal table, ``_repr_html_`` the notebook's."""

    def __str__(self) -> str:
        return render_text(self)

    def _repr_html_(self) -> str:
        return render_html(self)

