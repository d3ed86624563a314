"""The stall watchdog: a collective that waits longer than the stall timeout fails, naming the missing ranks.

Like Horovod's stall check (``horovod/common/stall_inspector.cc``), but failing instead of only warning, so a
notebook cell ends instead of hanging: every collective of comm/ (allreduce, broadcast, barrier, the buckets of
``DistributedOptimizer`` and of the DDP hook) runs through :func:`tracked` on the communication thread, which
numbers it and publishes the number on the group's progress board (:mod:`.board`, cheap enough for every
collective: benchmarks/stall_overhead.py). One watchdog thread per process looks at the collective in flight;
when it has waited ``stall_timeout`` seconds (``taco.configure(stall_timeout=…)``, ``%%taco_run
--stall-timeout``, ``TACO_STALL_TIMEOUT``; default 300 s, 0 = off; a warning on stderr at 60 s first), the
watchdog reads the board and

1. builds a :class:`~taco_notebook.errors.StallError` naming the ranks that have not entered the collective
   (and where they are), and marks on the board that this rank gave up;
2. takes the futures of the stuck collective and of everything queued behind it off the communication thread;
3. calls the :func:`on_stall` hooks (an elastic driver treats ``error.missing`` as lost);
4. tears the process group down (``bootstrap.abort()``: peers blocked on this rank are released too);
5. fails those futures with the error, so every waiter (the cell, ``synchronize()``, DDP) raises it.

Until the group is rebuilt by an explicit ``taco.init()``/``taco.reinit()`` on every rank (``%%taco_run`` does
it before the next cell), every collective raises the same error at once instead of rebuilding the group
behind the user's back over ranks that may never come. A late rank learns that its peers gave up as it
enters its next collective (one host), or when that collective fails or stalls in turn (several hosts, where the
board cannot be checked on entry for free; the collective it entered late may even complete with its peers'
abandoned ones); it raises a StallError naming them, and tears its group down too.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ...errors import StallError
from ..config import settings
from ..group import bootstrap
from ..state import Deferred, state

__all__ = ["StallError", "WARN_S", "tracked", "on_stall", "remove_on_stall", "in_flight", "fresh_copy"]

T = TypeVar("T")
WARN_S = 60.0  # Horovod's stall warning: a collective that waits this long is reported (once) before it fails
_POLL_S = 1.0  # the watchdog looks at least this often; it sleeps exactly until a known deadline
_FIX = ("the process group was torn down: the next %%taco_run cell, or taco.reinit() on every rank, rebuilds "
        "it; if those ranks are busy on purpose, raise the stall timeout (--stall-timeout, TACO_STALL_TIMEOUT, "
        "taco.configure(stall_timeout=...); 0 turns it off)")
_log = logging.getLogger(__name__)

StallHook = Callable[[StallError], None]
_hooks: list[StallHook] = []
_kept: list[Any] = []  # the store of a group this rank gave up on, until a new group's first collective


def on_stall(hook: StallHook) -> StallHook:
    """Call ``hook(error)`` on the watchdog thread when a collective of this rank stalls: before the group is
    torn down and before the waiters raise ``error`` (``error.missing``: the ranks to treat as lost). Usable as
    a decorator; a hook that raises is logged and skipped. Not called on a late rank (it raises on its own
    thread: catch the StallError there, ``error.gave_up`` names who left)."""
    if hook not in _hooks:
        _hooks.append(hook)
    return hook


def remove_on_stall(hook: StallHook) -> None:
    """Stop calling ``hook``."""
    if hook in _hooks:
        _hooks.remove(hook)


@dataclass
class _InFlight:
    """The collective this rank's communication thread is in."""

    seq: int
    label: str
    began: float  # time.monotonic() when the thread entered it
    warned: bool = False


class _Watchdog:
    """One daemon thread per process, started with the first tracked collective, looking at the one in flight."""

    def __init__(self) -> None:
        self.current: _InFlight | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def ensure_running(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="taco-stall-watchdog", daemon=True)
                    self._thread.start()

    def _loop(self) -> None:
        while True:
            job, timeout = self.current, settings().stall_timeout
            if job is None or not timeout:
                time.sleep(_POLL_S)
                continue
            waited = time.monotonic() - job.began
            if waited >= timeout:
                if self.current is job:
                    self.current = None
                    _fire(job, waited)
                continue
            if waited >= WARN_S and not job.warned:
                job.warned = True
                _warn(job, waited, timeout)
            next_at = WARN_S if WARN_S < timeout and not job.warned else timeout
            time.sleep(max(0.0, min(_POLL_S, next_at - waited)))


_watchdog = _Watchdog()


def in_flight() -> tuple[int, str, float] | None:
    """``(seq, label, seconds waited)`` of the collective this rank's communication thread is in, or None."""
    job = _watchdog.current
    return None if job is None else (job.seq, job.label, time.monotonic() - job.began)


def tracked(kind: str, name: Any, work: Callable[[], T]) -> Callable[[], T]:
    """``work`` (a collective, run on the communication thread) numbered, published and watched.

    Raises the group's StallError at once when the group was broken by a stall and not rebuilt since. Brings
    the group up on first use, as every collective does.
    """
    def run() -> T:
        if state.stalled is not None:
            raise fresh_copy(state.stalled)
        if _kept:  # the group was rebuilt since a stall: the old store can go
            _kept.clear()
        if not bootstrap.is_initialized():
            bootstrap.init()
        board = state.board
        if board is None:  # a group made by torch.distributed directly, not by taco's init(): nothing to watch
            return work()
        board.seq += 1
        label = _label(kind, name)
        watched = bool(settings().stall_timeout)
        if watched:
            board.publish(board.seq, label)
            if board.abandoned():
                _late(board, board.seq, label)
        # recorded even when the watchdog is off: the hang autopsy (listener.py) reports it
        # a parked operation run inside another's agreement (byname.py) nests: the outer one is watched again after
        outer, job = _watchdog.current, _InFlight(board.seq, label, time.monotonic())
        _watchdog.current = job
        if watched:
            _watchdog.ensure_running()
        try:
            return work()
        except Deferred:
            board.seq -= 1  # parked (byname.py): it takes a number when it runs, as on the other ranks
            raise
        except Exception as exc:
            if state.stalled is not None and not isinstance(exc, StallError):
                # this rank's own watchdog fired and its teardown failed the collective under us (a group of
                # taco's own, like the flat algorithm's, is released by the abort): the stall is the cause
                raise fresh_copy(state.stalled) from exc
            if state.stalled is None and not isinstance(exc, StallError) and _peers_gave_up(board):
                # a peer gave up and left, so the backend failed ("connection closed"): say why instead
                error = state.stalled = _after_failure(board, job)
                bootstrap.abort()
                raise fresh_copy(error) from exc
            raise
        finally:
            if _watchdog.current is job:
                _watchdog.current = outer

    return run


_labels: dict[tuple[str, Any], str] = {}  # (kind, name) -> label: names repeat every step (buckets)


def _label(kind: str, name: Any) -> str:
    """``allreduce ('ddp-bucket', 3)``; cached, as formatting a name costs more than publishing it."""
    try:
        return _labels[(kind, name)]
    except KeyError:
        pass
    except TypeError:  # an unhashable name
        return f"{kind} {name!r}"
    if len(_labels) > 4096:  # names that never repeat (tensor addresses): keep the cache small
        _labels.clear()
    label = _labels[(kind, name)] = kind if name is None else f"{kind} {name!r}"
    return label


def _title(seq: int, label: str) -> str:
    kind, _, name = label.partition(" ")
    return f"{kind} #{seq}" + (f" {name}" if name else "")


def _ranks(ranks: list[int]) -> str:
    return (f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks)))


def _hosts(ranks: list[int]) -> dict[int, str]:
    topology = state.topology
    return {r: topology.hostnames[r] for r in ranks} if topology is not None else {}


def _where(entries: list[Any]) -> str:
    """``rank 3 is at allreduce #55 ('bucket', 2)``: the last collective each missing rank entered, grouped."""
    by_place: dict[str, list[int]] = {}
    for entry in entries:
        place = _title(entry.seq, entry.label) if entry.seq else "no collective of this group yet"
        by_place.setdefault(place, []).append(entry.rank)
    return "; ".join(f"{_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'} at {place}"
                     if not place.startswith("no ") else f"{_ranks(ranks)} entered {place}"
                     for place, ranks in by_place.items())


def diagnose(seq: int, label: str, waited: float) -> StallError:
    """The error for this rank's collective number ``seq``, which waited ``waited`` seconds: who has not arrived
    (read from the board), where they are, and which ranks entered another collective under the same number;
    or, when peers gave up on an earlier collective (this rank is the late one, on several hosts where the board
    is not read on entry), who they are."""
    entries = state.board.read() if state.board is not None else []
    if any(0 < e.gave_up < seq for e in entries):  # they gave up on an earlier collective: this rank is late
        return _gave_up(entries, seq, label, f" stalled {waited:.0f} s")
    missing = [e for e in entries if e.seq < seq]
    other = [e for e in entries if e.seq == seq and e.label and e.label != label]
    hosts = _hosts([e.rank for e in missing])
    text = f"{_title(seq, label)} stalled {waited:.0f} s: "
    if missing:
        names = sorted(set(hosts.values()))
        text += (f"{_ranks([e.rank for e in missing])} (host{'s' if len(names) > 1 else ''} {', '.join(names)}) "
                 f"{'has' if len(missing) == 1 else 'have'} not arrived; {_where(missing)}")
    elif not other:
        text += "every rank entered it, but it did not complete (the network or the backend is stuck, not a rank)"
    if other:
        text += ("; " if missing else "") + "; ".join(
            f"rank {e.rank} entered {_title(e.seq, e.label)} instead (the ranks run different collectives)"
            for e in other)
    return StallError(f"{text}; {_FIX}", collective=_title(seq, label), seq=seq, waited_s=waited,
                      missing=tuple(e.rank for e in missing), hosts=hosts)


def _gave_up(entries: list[Any], seq: int, label: str, how: str = "") -> StallError:
    """The error of a rank that reached collective ``seq`` after the ranks in ``entries`` that gave up had left."""
    ranks = [e.rank for e in entries if e.gave_up]
    first = min((e.gave_up for e in entries if e.gave_up), default=seq)
    text = (f"{_title(seq, label)}{how}: {_ranks(ranks)} gave up waiting at collective #{first} before this rank "
            f"entered it (the stall timeout); {_FIX}")
    return StallError(text, collective=_title(seq, label), seq=seq, gave_up=tuple(ranks), hosts=_hosts(ranks))


def _warn(job: _InFlight, waited: float, timeout: float) -> None:
    error = diagnose(job.seq, job.label, waited)
    rank = state.topology.rank if state.topology is not None else "?"
    print(f"[taco] rank {rank}: {str(error).split('; the process group')[0]}; it fails at {timeout:g} s "
          f"(the stall timeout)", file=sys.stderr, flush=True)


def _fire(job: _InFlight, waited: float) -> None:
    """Fail the stalled collective and everything behind it, and tear the group down (module docstring)."""
    error = diagnose(job.seq, job.label, waited)
    if state.board is not None:
        state.board.give_up(job.seq)
        # a TCPStore lives in rank 0's process: kept until the group is rebuilt, so that a late rank can still
        # read there who gave up (one host: the mapped board outlives its file anyway)
        _kept.append(getattr(state.board, "store", None))
    state.stalled = error
    pending = state.comm_thread.take_pending()
    for hook in list(_hooks):
        try:
            hook(error)
        except Exception:  # noqa: BLE001 - one broken hook must not keep the waiters blocked
            _log.exception("stall hook %r failed", hook)
    try:
        bootstrap.abort()
    except Exception:  # noqa: BLE001 - the waiters must be released whatever the teardown did
        _log.exception("tearing the process group down after a stall failed")
    for future in pending:
        if not future.done():
            future.set_exception(fresh_copy(error))


def _after_failure(board: Any, job: _InFlight) -> StallError:
    """Why collective ``job`` failed once peers gave up: this rank came late (they left at an earlier one), or
    it waited with them and they saw the stall first."""
    entries = board.read()
    if any(0 < e.gave_up < job.seq for e in entries):
        return _gave_up(entries, job.seq, job.label)
    return diagnose(job.seq, job.label, time.monotonic() - job.began)


def _peers_gave_up(board: Any) -> bool:
    try:
        return any(entry.gave_up for entry in board.read())
    except Exception:  # noqa: BLE001 - the store went with rank 0: the backend's own error is what is known
        return False


def _late(board: Any, seq: int, label: str) -> None:
    """This rank entered collective ``seq`` after peers gave up on the group: raise, and tear the group down."""
    error = state.stalled = _gave_up(board.read(), seq, label)
    bootstrap.abort()
    raise fresh_copy(error)


def fresh_copy(error: StallError) -> StallError:
    """A fresh copy of ``error`` to raise (raising one instance in many places would chain their tracebacks)."""
    copy = StallError(str(error))
    copy.__dict__.update(error.__dict__)
    return copy
