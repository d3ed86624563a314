"""``%%taco_run --elastic MIN:MAX``: a rank dies, the survivors roll back to the last commit and go on.

The client owns the membership. In an elastic cell every engine tells its wrapper
(:mod:`taco_notebook.engine.rankwrap`) to keep the MPI job alive if the engine dies; the wrapper still prints
its marker line (rank, host, pid, signal) into the engine set's log, which :class:`DeathWatch` reads while the
cell runs. On a death:

1. the survivors' cell ends: those whose collective failed drop their group at once (``calls.abort``), which
   releases peers blocked on them; any still running after :data:`SETTLE_S` get SIGINT;
2. hosts that failed :data:`BLACKLIST_AFTER` times within :data:`BLACKLIST_WINDOW_S` are blacklisted for
   :data:`COOLDOWN_S` (their live engines sit out); with fewer than MIN members left the cell fails, naming them;
3. :meth:`Membership.rebuild`: the members get contiguous ranks in their old order, the new rank 0 opens a store,
   every member joins it (:mod:`taco_notebook.comm.group.members`: a new topology, hence a new 2D layout), all
   through ``view.apply`` of functions in :mod:`taco_notebook.engine.calls`;
4. every ``taco.elastic.State`` is restored to its last commit and synced from the new rank 0, and the cell
   runs again, so ``while state.step < N`` resumes at the committed step.

The survivors' other variables stay: their processes never restarted.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

from ...engine import calls
from ...errors import TacoError
from ..cells.reporting import ranks_phrase, stalled_ranks
from ..cells.run import CellOptions, CellRun, OutputSink
from ..describe import RankInfo
from ..session import TacoCluster
from .membership import (
    BLACKLIST_AFTER,
    COOLDOWN_S,
    Death,
    DeathWatch,
    ElasticSpec,
    Membership,
    membership_text,
    parse_elastic,
)

__all__ = ["ElasticSpec", "ElasticError", "Membership", "Death", "DeathWatch", "parse_elastic", "run_elastic",
           "membership_text", "collect_joiners", "wait_for_joiners", "admit", "SETTLE_S", "INTERRUPT_S"]

SETTLE_S = 0.3  # how long survivors get to fail on their own (a reset peer's neighbours do at once) before SIGINT
INTERRUPT_S = 3.0  # ...and to honour SIGINT, before the cluster is given up on
class ElasticError(TacoError):
    """An elastic cell cannot go on: fewer than MIN ranks are left, or survivors could not be stopped."""


class JoinRequested(Exception):  # noqa: N818 - an event, like MembershipLost
    """Every rank stopped at a commit because engines wait to join (never reaches the user)."""


class MembershipLost(Exception):
    """Raised inside the cell's wait loop when members died (never reaches the user)."""

    def __init__(self, deaths: list[Death]) -> None:
        super().__init__(", ".join(f"rank {d.rank}" for d in deaths))
        self.deaths = deaths


class _ElasticCellRun(CellRun):
    """The cell's wait loop, watching the wrappers' markers as well as mpiexec."""

    def __init__(self, cluster: TacoCluster, options: CellOptions, sink: OutputSink, watch: DeathWatch) -> None:
        super().__init__(cluster, options, sink)
        self.watch = watch
        self.asked_to_stop = False
        self.stall_killed: set[int] = set()

    def check_alive(self) -> None:
        deaths = self.watch.read()
        if deaths:
            raise MembershipLost(deaths)
        super().check_alive()  # the whole job gone (mpiexec died): not recoverable
        if collect_joiners(self.cluster) and not self.asked_to_stop and _room(self.cluster):
            self.asked_to_stop = True  # every rank stops at its next commit (State.commit: MembershipChanged)
            self.cluster.client.send_signal(signal.SIGUSR1, targets=self.engines, block=False)

    def collect_errors(self) -> None:
        self.check_alive()  # a survivor's gloo error usually lands before we read its peer's marker
        outcomes = self.outcomes()
        if outcomes and all(getattr(v, "ename", None) == "MembershipChanged" for v in outcomes.values()):
            if len(outcomes) == len(self.targets):
                raise JoinRequested()
            return  # the others stop at the same commit
        self.end_stalled(outcomes)
        super().collect_errors()

    def end_stalled(self, outcomes: dict[int, Any]) -> None:
        """Ranks that the others' StallErrors name as never having arrived (``--stall-timeout``) are hung members:
        SIGKILL their engines (:meth:`TacoCluster.kill_ranks`), so their wrappers' marker lines start
        the same recovery as any death. Without --elastic a stall fails the cell instead (:mod:`.cells.run`)."""
        stalled = [r for r in stalled_ranks(outcomes) if r not in outcomes and r not in self.stall_killed]
        if not stalled:
            return
        self.stall_killed.update(stalled)
        self.sink.warn(f"{ranks_phrase(stalled)} never reached the collective the others waited in for "
                       f"--stall-timeout: ending {'it' if len(stalled) == 1 else 'them'} as lost members")
        self.cluster.kill_ranks(stalled)

    def engine_died(self) -> None:
        deadline = time.monotonic() + 3.0  # the hub can see an engine go before its wrapper's line is in the log
        while time.monotonic() < deadline and self.cluster.engines_alive():
            if deaths := self.watch.read():
                raise MembershipLost(deaths)
            time.sleep(0.05)
        super().engine_died()

    def finish_monitors(self, error: BaseException | None) -> None:
        if not isinstance(error, MembershipLost | JoinRequested):  # the cell runs again: not its end
            super().finish_monitors(error)


def _room(cluster: TacoCluster) -> int:
    membership = Membership.of(cluster)
    return max(0, membership.spec.max - len(cluster.ranks)) if membership is not None else 0


def collect_joiners(cluster: TacoCluster) -> list[RankInfo]:
    """Engines of :meth:`TacoCluster.launch_engines` that registered: set up (no group yet), added to
    ``membership.pending``, which is returned. Kernel thread only (it drives the ipyparallel client)."""
    membership = Membership.of(cluster)
    if membership is None:
        return []
    banned = set(membership.blacklisted())
    back = [r for r in membership.parked if r.host not in banned]
    if back:  # their host's cooldown is over: they join again like new engines
        membership.parked = [r for r in membership.parked if r.host in banned]
        membership.pending += back
    for entry in list(membership.launching):
        count, known = entry
        new = sorted(set(cluster.client.ids) - known)
        if len(new) < count:
            continue
        membership.launching.remove(entry)
        cluster.client[new].apply_sync(calls.setup_joiner)
        infos = cluster.client[new].apply_sync(calls.rank_info)
        membership.pending += [RankInfo(**info, engine_id=eid) for eid, info in zip(new, infos, strict=True)]
    return membership.pending


def wait_for_joiners(cluster: TacoCluster, timeout: float = 120.0) -> list[RankInfo]:
    """Wait until every engine launched so far registered (``%taco_cluster scale``); the pending joiners."""
    deadline = time.monotonic() + timeout
    while (membership := Membership.of(cluster)) is not None and membership.launching \
            and time.monotonic() < deadline:
        collect_joiners(cluster)
        time.sleep(0.1)
    if membership is not None and membership.launching:
        raise ElasticError(f"engines added to cluster {cluster.name!r} did not register within {timeout:g} s; "
                           "see %taco_cluster status, or stop and restart the cluster")
    return membership.pending if membership is not None else []


def admit(cluster: TacoCluster, sink: OutputSink, monitors: Any = ()) -> bool:
    """Give pending joiners (up to MAX) rank 0's variables, rebuild the group with them, restore every State to
    its last commit from rank 0. False when nobody waits or there is no room."""
    membership = Membership.of(cluster)
    if membership is None or not membership.pending or not _room(cluster):
        return False
    joining = membership.pending[: _room(cluster)]
    started = time.monotonic()
    payload, left = cluster.client[cluster.engine_ids([0])[0]].apply_sync(calls.export_namespace)
    cluster.client[[j.engine_id for j in joining]].apply_sync(calls.import_namespace, payload)
    membership.rebuild(cluster, [*cluster.ranks, *joining])
    membership.pending = membership.pending[len(joining):]
    membership.joined += len(joining)
    counters = cluster.view.apply_sync(calls.elastic_restore)[0]
    cluster.view.apply_sync(calls.elastic_mode, True)
    hosts = ", ".join(sorted({j.host for j in joining}))
    stayed = f"; not copied to them (cannot be pickled): {', '.join(left)}" if left else ""
    sink.notice(f"{len(joining)} rank{'s' if len(joining) != 1 else ''} joined (host {hosts}); continuing on "
                f"{len(cluster.ranks)} ranks {_committed(counters)} (group rebuilt in "
                f"{time.monotonic() - started:.1f} s){stayed}")
    for monitor in monitors:
        if hasattr(monitor, "membership_changed"):
            monitor.membership_changed(f"{len(joining)} joined: {len(cluster.ranks)} ranks {_committed(counters)}",
                                       {r.rank: r.node for r in cluster.ranks})
    cluster.set_run(cluster.run)
    return True


def _survivors(cluster: TacoCluster, deaths: list[Death]) -> list[RankInfo]:
    dead = {(d.host, d.pid) for d in deaths}
    return [r for r in cluster.ranks if (r.host, r.pid) not in dead]


def _settle(run: _ElasticCellRun, survivors: list[RankInfo]) -> list[Death]:
    """End the survivors' cell: drop the group of those done (releasing peers blocked on them) and SIGINT those
    still running after :data:`SETTLE_S` (all roll back anyway; a rank blocked on a failed peer would otherwise
    wait for the collective timeout). Returns further deaths seen meanwhile (a node's ranks go one by one)."""
    cluster, deaths = run.cluster, []
    every = run.tracker.parts if run.tracker is not None else {}
    parts = {r.rank: every[r.rank] for r in survivors if r.rank in every}
    aborted: set[int] = set()
    start, interrupted = time.monotonic(), False
    while True:
        deaths += run.watch.read()
        gone = {(d.host, d.pid) for d in deaths}
        live = [r for r in survivors if (r.host, r.pid) not in gone]
        running = [r for r in live if not parts[r.rank].done()]
        done = [r for r in live if parts[r.rank].done() and r.rank not in aborted]
        registered = set(cluster.client.ids)  # a rank of a lost node can be unregistered before its death is read
        reachable = [r for r in done if r.engine_id in registered]
        if reachable and running:
            cluster.client[[r.engine_id for r in reachable]].apply_async(calls.abort)
        if done and running:
            aborted.update(r.rank for r in done)
        if not running:
            return deaths
        waited = time.monotonic() - start
        if waited > SETTLE_S and not interrupted:
            delivered = cluster.client.send_signal(signal.SIGINT, targets=[r.engine_id for r in running],
                                                   block=False)
            try:  # see it delivered: a signal still in flight could land in the cell's next run
                delivered.result(timeout=1.0)
            except Exception:  # noqa: BLE001 - a wedged engine: the kill below deals with it
                pass
            interrupted = True
        elif waited > SETTLE_S + INTERRUPT_S:
            phrase = ranks_phrase([r.rank for r in running])
            cluster.kill_engines(f"{phrase} hung after a rank died")
            raise ElasticError(f"{phrase} did not stop after a rank died, not even on SIGINT: the cluster's "
                               "engines were killed; the next cell starts a fresh cluster")
        time.sleep(0.02)


def _committed(counters: dict[str, Any]) -> str:
    if "step" in counters:
        return f"from commit at step {counters['step']}"
    if counters:
        return "from commit at " + ", ".join(f"{k}={v}" for k, v in counters.items())
    return "(no taco.elastic.State to roll back)"


def _recover(run: _ElasticCellRun, lost: MembershipLost, membership: Membership, sink: OutputSink) -> None:
    """After ``lost``: settle the survivors, rebuild over them, restore every State, say what happened."""
    cluster = run.cluster
    deaths = list(lost.deaths)
    deaths += _settle(run, _survivors(cluster, deaths))
    survivors = _survivors(cluster, deaths)
    banned = membership.record(deaths)
    blacklisted = set(membership.blacklisted())
    members = [r for r in survivors if r.host not in blacklisted][: membership.spec.max]
    what = "; ".join(f"rank {d.rank} (host {d.host}) died: {d.how}" for d in deaths)
    if banned:
        what += f"; host {', '.join(banned)} failed {BLACKLIST_AFTER} times: blacklisted for {COOLDOWN_S:g} s"
    if len(members) < min(membership.spec.min, len(survivors)):  # sitting hosts out would end the run: keep them
        members = survivors[: membership.spec.max]
        what += " (its ranks stay: without them fewer than MIN would be left)" if blacklisted else ""
    membership.parked += [r for r in survivors if r not in members and r.host in blacklisted]
    membership.owns_membership = True  # MPI's world has a dead rank from now on
    cluster.mark_group_broken()
    if len(members) < membership.spec.min:
        cluster.adopt_ranks(survivors, rebuilt=False)
        raise ElasticError(f"{what}; {len(members)} rank{'s' if len(members) != 1 else ''} left, fewer than "
                           f"--elastic's MIN {membership.spec.min}: the cell stops here. The survivors keep their "
                           "variables; run it with a lower MIN, or %taco_cluster restart for a full cluster")
    started = time.monotonic()
    membership.rebuild(cluster, members)
    counters = cluster.view.apply_sync(calls.elastic_restore)[0]
    sink.notice(f"{what}; continuing on {len(members)} ranks {_committed(counters)} "
                f"(group rebuilt in {time.monotonic() - started:.1f} s)")
    gone = ", ".join(f"rank {d.rank} ({d.host}) lost" for d in deaths)
    for monitor in run.options.monitors:  # the dashboard's status line; the sidebar reads cluster.model()
        if hasattr(monitor, "membership_changed"):
            monitor.membership_changed(f"{gone}: {len(members)} ranks {_committed(counters)}",
                                       {r.rank: r.node for r in cluster.ranks})
    cluster.set_run(cluster.run)  # publishes the model (its membership) to the registry, hence the sidebar


def run_elastic(cluster: TacoCluster, submit: Callable[[Any, Any], Any], captured: bool, options: CellOptions,
                sink: OutputSink, origin: str | None = None, *, spec: ElasticSpec) -> Any:
    """Run a cell (or a script) as an elastic one (``CellOptions.runner``, with ``spec`` bound): on a rank's
    death recover (module docstring) and ``submit`` it again (see :meth:`.run.CellRun.run`)."""
    membership = Membership.of(cluster)
    if membership is None:
        membership = Membership(spec)
        cluster.hold_membership(membership)
    membership.spec = spec
    if len(cluster.ranks) < spec.min:
        raise ElasticError(f"cluster {cluster.name!r} has {len(cluster.ranks)} ranks, fewer than --elastic's MIN "
                           f"{spec.min}: lower MIN or %taco_cluster restart -n {spec.min}")
    if cluster.needs_reinit:
        cluster.reinit()
    cluster.view.apply_sync(calls.elastic_mode, True)
    collect_joiners(cluster)
    admit(cluster, sink, options.monitors)  # engines added between cells join at the cell's start
    watch = DeathWatch(cluster)
    try:
        while True:
            run = _ElasticCellRun(cluster, options, sink, watch)
            run.origin = origin
            try:
                return run.run(submit, captured)
            except MembershipLost as lost:
                sink.flush()
                _recover(run, lost, membership, sink)
            except JoinRequested:
                sink.flush()
                admit(cluster, sink, options.monitors)
    finally:
        live = [e for e in cluster.engine_ids() if e in cluster.client.ids] if cluster.running else []
        if live:  # a member that died and was not yet recovered from is no longer registered
            cluster.client[live].apply_sync(calls.elastic_mode, False)

