"""Elastic training state: commit what a step has made, roll back to it, and hand it to every rank.

As Horovod's ``hvd.elastic.TorchState``: a :class:`State` holds a model, an optimizer and any counters::

    state = taco.elastic.State(model=model, optimizer=opt, step=0)
    while state.step < 300:
        train_one_step(); state.step += 1
        if state.step % 10 == 0:
            state.commit()

Under ``%%taco_run --elastic MIN:MAX`` the notebook does the rest (:mod:`taco_notebook.cluster.elastic.recovery`):
when a rank dies, every live :class:`State` is :meth:`~State.restore`-d to its last commit on the survivors, the
group is rebuilt over them (:mod:`.membership`), :meth:`~State.sync` hands rank 0's copy to all, and the cell runs
again, so the loop resumes at the committed ``step``. :func:`run` gives the same retry under plain ``mpiexec`` as
far as MPI allows.

Imports no IPython; torch is imported when a state is made.
"""

from __future__ import annotations

import copy
import itertools
import logging
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from ..diagnostics.replicas import track_state
from ..group import bootstrap
from ..state import state as process

__all__ = ["State", "MembershipChanged", "run", "live_states", "restore_all", "sync_all", "request_update",
           "forget_update"]

T = TypeVar("T")
_log = logging.getLogger(__name__)
_states: weakref.WeakSet[State] = weakref.WeakSet()  # every State of this process, for restore_all/sync_all
_made = itertools.count()  # creation order: the same on every rank, so sync_all's collectives line up
_update = {"requested": False}  # set by request_update (a signal handler): ranks are waiting to join


class MembershipChanged(Exception):  # noqa: N818 - what happened, as Horovod's HostsUpdatedInterrupt
    """Raised by :meth:`State.commit` on every rank at once when ranks wait to join: the notebook rebuilds the
    group with them and runs the cell again from this commit."""


def request_update(*_: Any) -> None:
    """Ask every rank to stop at its next commit (the notebook sends SIGUSR1 when engines wait to join)."""
    _update["requested"] = True


def forget_update() -> None:
    """Drop a request that came too late for the cell it was meant for."""
    _update["requested"] = False


def _agreed_update() -> bool:
    """Whether any rank was asked to stop (collective: every rank commits at the same step)."""
    import torch

    from ..collectives.ops import allreduce

    if not bootstrap.is_initialized():
        return False
    flag = torch.tensor([1.0 if _update["requested"] else 0.0])
    allreduce(flag, op="max")
    _update["requested"] = False
    return bool(flag.item())


def _clone(value: Any) -> Any:
    """A deep copy that keeps tensors off the autograd graph (a committed copy must not change with training)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_clone(v) for v in value)
    return copy.deepcopy(value)


class State:
    """A model, an optimizer and named counters (``State(model=m, optimizer=o, step=0, epoch=0)``).

    Counters are attributes (``state.step += 1``). :meth:`commit` saves a copy, :meth:`restore` goes back to it,
    :meth:`sync` makes every rank's copy rank ``root``'s. A new State is committed at once.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **counters: Any) -> None:
        object.__setattr__(self, "_counters", dict(counters))
        self.model = model
        self.optimizer = optimizer
        self.commits = 0  # how many commits this rank made (the first, at creation, counts)
        self.order = next(_made)
        self._saved: dict[str, Any] = {}
        self.save()
        _states.add(self)
        track_state(model, optimizer)  # the replica check after each cell (replicas.py)

    def __getattr__(self, name: str) -> Any:
        counters = object.__getattribute__(self, "_counters")
        if name in counters:
            return counters[name]
        raise AttributeError(f"elastic State has no counter {name!r}; counters: {sorted(counters) or 'none'} "
                             f"(give it as State(..., {name}=0))")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._counters:
            self._counters[name] = value
        else:
            object.__setattr__(self, name, value)

    @property
    def counters(self) -> dict[str, Any]:
        """The counters as they are now (a copy)."""
        return dict(self._counters)

    @property
    def committed(self) -> dict[str, Any]:
        """The counters as of the last commit (what a rollback goes back to)."""
        return dict(self._saved["counters"])

    def save(self) -> None:
        """Keep a copy of model, optimizer and counters in memory (no collective, no membership check)."""
        self._saved = {
            "model": _clone(self.model.state_dict()) if self.model is not None else None,
            "optimizer": _clone(self.optimizer.state_dict()) if self.optimizer is not None else None,
            "counters": copy.deepcopy(self._counters),
        }
        self.commits += 1

    def commit(self) -> None:
        """Save the state: after a failure the ranks roll back to here (every rank calls it at the same step).

        Then, with the others, checks whether ranks wait to join: if so raises :class:`MembershipChanged` on
        every rank (one tiny allreduce per commit)."""
        self.save()
        if _agreed_update():
            raise MembershipChanged(f"ranks are joining at {self._describe()}: the notebook rebuilds the group "
                                    "and runs the cell again from this commit")

    def _describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self._counters.items()) or "this commit"

    def __setstate__(self, saved: dict[str, Any]) -> None:
        """Unpickled (a joining engine receives rank 0's variables): a live State like the others."""
        object.__setattr__(self, "__dict__", saved)
        _states.add(self)

    def restore(self) -> None:
        """Go back to the last commit (this rank only)."""
        if self.model is not None:
            self.model.load_state_dict(_clone(self._saved["model"]))
        if self.optimizer is not None:
            self.optimizer.load_state_dict(_clone(self._saved["optimizer"]))
        self._counters.clear()
        self._counters.update(copy.deepcopy(self._saved["counters"]))

    def sync(self, root: int = 0) -> None:
        """Make every rank's state (model tensors, optimizer state, counters) rank ``root``'s, then commit it
        (collective). Called after a membership change, from a rank that survived."""
        import torch
        import torch.distributed as dist

        from ..collectives.ops import broadcast_parameters

        if not bootstrap.is_initialized():  # under plain mpiexec the group comes up on first use
            bootstrap.init()
        if self.model is not None:
            broadcast_parameters(self.model, root)
        rest = [{"optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                 "counters": dict(self._counters)}]
        process.comm_thread.run(lambda: dist.broadcast_object_list(rest, src=root))
        if self.optimizer is not None:
            self.optimizer.load_state_dict(rest[0]["optimizer"])
        counters: dict[str, Any] = dict(rest[0]["counters"] or {})  # on the root its own: copy before clearing
        self._counters.clear()
        self._counters.update(counters)
        with torch.no_grad():
            self.save()

    def __repr__(self) -> str:
        return f"State({', '.join(f'{k}={v!r}' for k, v in self._counters.items())}, commits={self.commits})"


def live_states() -> list[State]:
    """Every State this process holds (made in a cell and still referenced)."""
    return list(_states)


def restore_all() -> dict[str, Any]:
    """Roll every State back to its last commit; the counters of the first, for the notebook's message."""
    states = sorted(_states, key=lambda s: s.order)
    for item in states:
        item.restore()
    return states[0].counters if states else {}


def sync_all(root: int = 0) -> None:
    """:meth:`State.sync` every State, in the order they were made on every rank (collective)."""
    for item in sorted(_states, key=lambda s: s.order):
        item.sync(root)


def run(fn: Callable[..., T], retries: int = 3) -> Callable[..., T]:
    """Wrap ``fn(state, *args)`` so a failed collective rolls ``state`` back to its last commit and retries.

    Under plain ``mpiexec`` the world is MPI's: a rank that *dies* ends the job (mpiexec stops every rank, and
    MPI cannot rebuild a world without it), so what this recovers from is a collective that failed on live
    ranks (a timeout, a reset connection): the group is rebuilt over the same ranks, every rank restores and
    syncs from rank 0, and ``fn`` runs again, at most ``retries`` times. Losing and adding ranks needs a client
    that owns the membership: ``%%taco_run --elastic`` in a notebook.
    """
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        for attempt in range(retries + 1):
            try:
                state.sync()
                return fn(state, *args, **kwargs)
            except RuntimeError as exc:  # torch.distributed raises RuntimeError (DistBackendError) on a failed peer
                if attempt == retries:
                    raise
                _log.warning("collective failed (%s); rolling back to the last commit and retrying", exc)
                state.restore()
                bootstrap.reinit()
        raise AssertionError("unreachable")

    return wrapper
