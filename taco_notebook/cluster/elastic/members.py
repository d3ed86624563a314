"""What a :class:`~taco_notebook.cluster.session.TacoCluster` adds for elastic membership (``--elastic``): ranks
renumbered over live engines (engine ids no longer equal ranks), a group rebuilt without MPI, engine sets
added to a running cluster. A mixin, so the cluster stays one object with one home for its state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..cells import engine
from ..describe import RankInfo

__all__ = ["ElasticMembers"]


class ElasticMembers:
    """Mixed into TacoCluster; uses its ``ranks``, ``client``, ``elastic``, ``view`` and engine-set records."""

    ranks: list[RankInfo]
    client: Any
    elastic: Any
    running: bool
    needs_reinit: bool
    _engine_logs: list[str]
    _engine_launchers: list[Any]

    if TYPE_CHECKING:  # TacoCluster's own
        @property
        def view(self) -> Any: ...

        def _engine_sets(self, cluster: Any = None) -> list[Any]: ...

    def kill_ranks(self, ranks: list[int]) -> None:
        """SIGKILL the engines of ``ranks`` (hung members, cluster/elastic/recovery.py): a local engine only when it
        is in the process tree of one of this cluster's engine sets (proven ours), any other through ipyparallel's
        signal request to that engine. Their wrappers' marker lines then report the deaths."""
        import signal

        from ..processes.tree import descendants, kill

        ours = {p.pid: p for es in self._engine_sets() for p in descendants(getattr(es, "process", None))}
        local = [ours[r.pid] for r in self.ranks if r.rank in ranks and r.pid in ours]
        kill(local, wait=False)
        remote = [r.rank for r in self.ranks if r.rank in ranks and r.pid not in ours]
        if remote:
            self.client.send_signal(signal.SIGKILL, targets=self.engine_ids(remote), block=False)

    def engine_ids(self, ranks: list[int] | None = None) -> list[int]:
        """The ipyparallel engine ids of ``ranks`` (default: every rank), in that order."""
        by_rank = {r.rank: (r.engine_id if r.engine_id >= 0 else r.rank) for r in self.ranks}
        return [by_rank[r] for r in (sorted(by_rank) if ranks is None else ranks)]

    def reinit(self) -> None:
        """Rebuild the process group on every rank (after a failed or interrupted cell): over MPI's world, or
        over the members the client chose once an elastic change happened (cluster/elastic/recovery.py)."""
        if self.elastic is not None and self.elastic.owns_membership:
            from .membership import rebuild

            rebuild(self, list(self.ranks))
        else:
            self.view.apply_sync(engine.reinit)
        self.needs_reinit = False

    def refresh_engine_sets(self) -> None:
        """Remember the engine sets and their logs (at start, and when an elastic cluster grows)."""
        self._engine_launchers = self._engine_sets()
        self._engine_logs = [es.output_file for es in self._engine_launchers if getattr(es, "output_file", None)]

    def engine_log_paths(self) -> list[str]:
        """The engine sets' logs, where mpiexec gathers what the ranks and their wrappers print."""
        return self._engine_logs or [es.output_file for es in self._engine_sets() if getattr(es, "output_file", None)]

    def launch_engines(self, count: int) -> None:
        """Start ``count`` more engines for an elastic cluster (:func:`.membership.launch_engines`; any thread):
        they join at the next commit of a running ``--elastic`` cell, or at the next such cell."""
        from .membership import launch_engines

        launch_engines(self, count)  # type: ignore[arg-type]

    def grows_elastically(self, size: int) -> bool:
        """On a cluster that ran an elastic cell, launch the engines ``size`` needs (:func:`.membership.grow`)
        instead of a restart; False elsewhere (or when shrinking)."""
        if self.elastic is None or not self.running or size <= len(self.ranks):
            return False
        from .membership import grow

        grow(self, size)  # type: ignore[arg-type]
        return True
