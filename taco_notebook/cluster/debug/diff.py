"""``%taco_diff EXPR``: one value compared across ranks, the ranks on each side named, and for a container the
first key or index where they part.

Each rank sends the fingerprint tree of its value (:mod:`taco_notebook.engine.fingerprint`: digests and short
descriptions, never the value itself), so comparing a model's state on 1,000 ranks moves a few kilobytes each.

    >>> print(DiffReport("xs", trees).text())  # doctest: +SKIP
    xs differs across 4 ranks, first at [2]:
      ranks 0, 2, 3: 3
      rank 1: 30
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..cells.autopsy import rank_span

__all__ = ["DiffReport", "first_difference"]

_ABSENT = {"d": "", "s": "(absent)"}


def _groups(nodes: Mapping[int, dict[str, Any]]) -> list[tuple[dict[str, Any], list[int]]]:
    """Ranks by equal digest, the largest group first (ties: the lowest rank first)."""
    by_digest: dict[str, list[int]] = {}
    for rank in sorted(nodes):
        by_digest.setdefault(nodes[rank]["d"], []).append(rank)
    ordered = sorted(by_digest.values(), key=lambda ranks: (-len(ranks), ranks[0]))
    return [(nodes[ranks[0]], ranks) for ranks in ordered]


def first_difference(trees: Mapping[int, dict[str, Any]]) -> tuple[str, dict[int, dict[str, Any]]]:
    """The path to the first place the ranks' trees differ (``""``: the values themselves, when they are not
    containers alike) and each rank's node there. Children are walked in the lowest rank's order, then those
    only other ranks have."""
    path, nodes = "", dict(trees)
    while all("k" in node for node in nodes.values()):
        children = {rank: dict((label, child) for label, child in node["k"]) for rank, node in nodes.items()}
        labels: list[str] = []
        for rank in sorted(children):
            labels += [label for label in children[rank] if label not in labels]
        differing = next((label for label in labels
                          if len({children[r].get(label, _ABSENT)["d"] for r in children}) > 1), None)
        if differing is None:  # same children, another container type (a list against a tuple)
            break
        path += differing
        nodes = {rank: kids.get(differing, _ABSENT) for rank, kids in children.items()}
    return path, nodes


@dataclass
class DiffReport:
    """Every rank's fingerprint tree of ``expression``, and the report of where they differ."""

    expression: str
    trees: dict[int, dict[str, Any]]

    @property
    def equal(self) -> bool:
        return len({tree["d"] for tree in self.trees.values()}) <= 1

    def differing(self) -> tuple[str, list[tuple[str, list[int]]]]:
        """The first differing path and, there, each distinct value's description and its ranks."""
        path, nodes = first_difference(self.trees)
        return path, [(node["s"], ranks) for node, ranks in _groups(nodes)]

    def text(self) -> str:
        count = len(self.trees)
        if self.equal:
            tree = next(iter(self.trees.values()))
            return f"{self.expression}: the same on {rank_span(list(self.trees))} ({tree['s']})"
        path, groups = self.differing()
        where = f", first at {path}" if path else ""
        lines = [f"{self.expression} differs across {count} ranks{where}:"]
        lines += [f"  {rank_span(ranks)}: {said}" for said, ranks in groups]
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text())

    def __str__(self) -> str:
        return self.text()
