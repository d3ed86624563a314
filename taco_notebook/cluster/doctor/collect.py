"""The doctor's entry points: facts gathered from nodes into a :class:`~.render.ShownReport` (a
:class:`~.report.DoctorReport` that shows itself: HTML in a notebook, text in a terminal).

Facts come from :func:`taco_notebook.cluster.doctor.nodefacts.node_facts`, run where each node is (an engine's
``view.apply``: :mod:`.engines`, or ``python -m taco_notebook.cluster.doctor.nodefacts`` through a command
prefix: ``ssh HOST python3``, ``ip netns exec NS python``)::

    report = diagnose_nodes({"n0": ["ssh", "n0", "python3"], "n1": ["ssh", "n1", "python3"]},
                            addresses={"n0": "10.0.0.1", "n1": "10.0.0.2"})
    report                          # the table, then each node's problems and their remedies
    require_hugepages(report.nodes, 50, "1G")   # raises HugePagesError naming the nodes short of them
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from ...comm.diagnostics.linkspeed import LinkSpeedError, measure_link
from .render import ShownReport

__all__ = ["report_from_facts", "local_report", "read_node_facts", "measure_links", "diagnose_nodes"]

_FACTS_TIMEOUT_S = 180.0  # generous: a loaded node imports torch slowly


def report_from_facts(facts: Sequence[dict[str, Any]], links: Sequence[dict[str, Any]] = ()) -> ShownReport:
    """A report from facts gathered elsewhere (e.g. ``node_facts`` applied on one engine per node)."""
    return ShownReport.from_facts(facts, links)


def local_report() -> ShownReport:
    """This machine alone: its facts read in this process, no link to measure."""
    from .nodefacts import node_facts

    return report_from_facts([node_facts()])


def read_node_facts(name: str, runner: Sequence[str], timeout: float = _FACTS_TIMEOUT_S) -> dict[str, Any]:
    """``python -m taco_notebook.cluster.doctor.nodefacts`` through ``runner``, a prefix ending in an interpreter.

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
                   seconds: float = 1.0) -> ShownReport:
    """Facts from each node through its runner, then the links between them where ``addresses`` are given."""
    facts = [read_node_facts(name, runner) for name, runner in runners.items()]
    links = measure_links(runners, addresses, seconds) if addresses else []
    return report_from_facts(facts, links)
