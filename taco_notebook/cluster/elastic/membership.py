"""An elastic cluster's membership as the client knows it: the ``--elastic MIN:MAX`` bounds, the ranks lost
(read from the wrappers' marker lines by :class:`DeathWatch`), the engines joining, and the blacklist of hosts
that failed repeatedly; and :meth:`Membership.rebuild`, which gives chosen engines a new group (:mod:`.recovery`
decides when; :meth:`TacoCluster.reinit` calls it after a failed cell).

The cluster holds its :class:`Membership` (``cluster.elastic``) and never imports this module; a membership
changes the cluster only through its methods (:meth:`~TacoCluster.adopt_ranks`,
:meth:`~TacoCluster.launch_engines`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ...engine import calls
from ...model import MembershipModel
from ..describe import RankInfo
from ..processes.deaths import MARKER_LINE, signal_name
from ..session import TacoCluster

__all__ = ["ElasticSpec", "Death", "Membership", "DeathWatch", "parse_elastic", "membership_text",
           "BLACKLIST_AFTER", "BLACKLIST_WINDOW_S", "COOLDOWN_S"]

BLACKLIST_AFTER = 2  # failures of one host ...
BLACKLIST_WINDOW_S = 600.0  # ... within this window blacklist it ...
COOLDOWN_S = 300.0  # ... for this long


@dataclass(frozen=True)
class ElasticSpec:
    """``--elastic MIN:MAX``: go on while at least ``min`` ranks live; at most ``max`` ranks take part."""

    min: int
    max: int


def parse_elastic(text: str) -> ElasticSpec:
    """``"2:4"`` -> ``ElasticSpec(2, 4)``; a ValueError naming the mistake otherwise."""
    parts = text.split(":")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) != 2 or numbers[0] <= 0 or numbers[0] > numbers[1]:
        raise ValueError(f"--elastic must be MIN:MAX with 1 <= MIN <= MAX (say 2:4), got {text!r}")
    return ElasticSpec(numbers[0], numbers[1])


@dataclass(frozen=True)
class Death:
    """One engine's death as its wrapper told it."""

    rank: int  # its rank in the membership it died in
    host: str
    pid: int
    how: str  # "SIGKILL", "exit code 3"
    at: float = field(default_factory=time.time, compare=False)


@dataclass
class Membership:
    """What the client knows of an elastic cluster's membership: changes so far and the blacklist."""

    spec: ElasticSpec
    owns_membership: bool = False  # True once ranks were renumbered: the group is no longer MPI's world
    lost: list[Death] = field(default_factory=list)
    joined: int = 0
    failures: dict[str, list[float]] = field(default_factory=dict)  # host -> when its ranks died
    blacklist: dict[str, float] = field(default_factory=dict)  # host -> until when (time.time())
    launching: list[tuple[int, set[int]]] = field(default_factory=list)  # (engines started, engine ids before)
    pending: list[RankInfo] = field(default_factory=list)  # registered joiners, admitted at the next commit
    parked: list[RankInfo] = field(default_factory=list)  # live ranks of blacklisted hosts: pending after cooldown

    @staticmethod
    def of(cluster: TacoCluster) -> Membership | None:
        """The membership ``cluster`` holds (None before its first --elastic cell)."""
        return cluster.elastic if isinstance(cluster.elastic, Membership) else None

    def rebuild(self, cluster: TacoCluster, members: list[RankInfo]) -> None:
        """Give ``members`` (in this order) ranks 0..n-1 and a new process group, all through engine calls; from
        then on the client owns the membership (the group is no longer MPI's world)."""
        ids = [m.engine_id if m.engine_id >= 0 else m.rank for m in members]
        view = cluster.client[ids]
        facts = view.apply_sync(calls.placement)
        one_host = len({tuple(f["where"]) for f in facts}) == 1 and not any(f["tcp"] for f in facts)
        kind = "file" if one_host else "tcp"
        address = cluster.client[ids[0]].apply_sync(calls.open_group, kind, len(ids))
        ranks_by_key = {f["key"]: rank for rank, f in enumerate(facts)}
        view.apply_sync(calls.join_group, ranks_by_key, [f["node"] for f in facts], kind, address)
        infos = view.apply_sync(calls.rank_info)
        cluster.adopt_ranks([RankInfo(**info, engine_id=eid) for eid, info in zip(ids, infos, strict=True)])
        self.owns_membership = True

    def expect_engines(self, count: int, known: set[int]) -> None:
        """``count`` engines are being launched (:meth:`TacoCluster.launch_engines`): the ids beyond ``known``
        that register are theirs, admitted at the next commit (:mod:`.recovery`)."""
        self.launching.append((count, known))

    def grow(self, cluster: TacoCluster, size: int) -> None:
        """Launch what ``size`` ranks need beyond the members, the pending joiners and engines still starting."""
        waiting = len(self.pending) + sum(count for count, _ in self.launching)
        if size - len(cluster.ranks) - waiting > 0:
            cluster.launch_engines(size - len(cluster.ranks) - waiting)

    def record(self, deaths: list[Death], now: float | None = None) -> list[str]:
        """Count one failure against each host of ``deaths`` (a node's ranks dying together fail it once); the
        hosts that this blacklists."""
        now = time.time() if now is None else now
        self.lost += deaths
        banned = []
        for host in dict.fromkeys(d.host for d in deaths):
            recent = [t for t in self.failures.get(host, []) if now - t < BLACKLIST_WINDOW_S] + [now]
            self.failures[host] = recent
            if len(recent) >= BLACKLIST_AFTER and host not in self.blacklisted(now):
                self.blacklist[host] = now + COOLDOWN_S
                banned.append(host)
        return banned

    def model(self) -> MembershipModel:
        """As the registry, the REST API and the sidebar show it."""
        return {"min": self.spec.min, "max": self.spec.max, "joined": self.joined,
                "lost": [{"rank": d.rank, "host": d.host, "how": d.how, "at": d.at} for d in self.lost],
                "blacklisted": self.blacklisted()}

    def blacklisted(self, now: float | None = None) -> list[str]:
        """Hosts in their cooldown now."""
        now = time.time() if now is None else now
        return sorted(host for host, until in self.blacklist.items() if until > now)


def membership_text(model: MembershipModel) -> str:
    """``elastic 2:4 · lost rank 2 (n1, SIGKILL) · 1 joined · blacklisted n1`` (as the sidebar's format.ts)."""
    parts = [f"elastic {model['min']}:{model['max']}"]
    if model["lost"]:
        lost = ", ".join(f"{x['rank']} ({x['host']}, {x['how']})" for x in model["lost"])
        parts.append(f"lost rank{'s' if len(model['lost']) > 1 else ''} {lost}")
    if model["joined"]:
        parts.append(f"{model['joined']} joined")
    if model["blacklisted"]:
        parts.append(f"blacklisted {', '.join(model['blacklisted'])}")
    return " · ".join(parts)


class DeathWatch:
    """Reads the marker lines the wrappers print into the engine sets' logs, from where it last stopped."""

    def __init__(self, cluster: TacoCluster) -> None:
        self.cluster = cluster
        self.offsets: dict[str, int] = {}
        self.seen: set[tuple[str, int]] = set()  # a member who died between cells is found at the cell's start

    def read(self) -> list[Death]:
        """Deaths of current members not reported yet."""
        members = {(r.host, r.pid): r for r in self.cluster.ranks}
        found = []
        for path in self.cluster.engine_log_paths():
            try:
                with open(path, "rb") as log:
                    log.seek(self.offsets.get(path, 0))
                    text = log.read()
            except OSError:
                continue
            end = text.rfind(b"\n") + 1  # a line still being written is read next time
            self.offsets[path] = self.offsets.get(path, 0) + end
            for match in MARKER_LINE.finditer(text[:end].decode(errors="replace")):
                _, host, pid, kind, value, _ = match.groups()
                key = (host, int(pid))
                if key in self.seen or key not in members:
                    continue
                self.seen.add(key)
                how = signal_name(int(value)) if kind == "signal" else f"exit code {value}"
                found.append(Death(members[key].rank, host, int(pid), how))
        return found
