"""Everything the kernel asks an engine to do.

The notebook kernel drives its engines only through the plain functions below, called with
``view.apply(engine.func, ...)`` (``apply_sync`` where the kernel needs the answer, ``apply_async`` where it
only needs the order): the user's cell is the one thing sent as source (a script's source travels as the
argument of :func:`.runner.run_script`). A module-level function travels as its code and runs on the engine
with this module's globals (ipyparallel re-imports the module there), so the engine's state (the metrics
sender) lives here and a rename fails at import, not in a cell at run time.

What ``taco`` is on the engines is defined here, in :func:`setup_namespace`: the rank's API,
:mod:`taco_notebook.comm` (``taco.rank()``, ``taco.allreduce``…), as in ``import taco_notebook.comm as taco``
under plain ``mpiexec``. In the notebook itself ``%load_ext taco_notebook`` binds ``taco`` to the package
:mod:`taco_notebook` (``taco.dashboard()``): the kernel has no rank, so it has no rank API.

The engine's side of the live dashboard is here too: while a cell runs, ``taco.metrics`` hands snapshots to
the sender installed by :func:`begin_cell`, which sends them on the engine's IOPub as an ipyparallel
``data_message``; they land in the cell's ``AsyncResult`` metadata (``md["data"][KEY]``, latest value
wins), which the kernel's wait loop (:mod:`.cells.run`) reads. After every execution the engine sends once more if
anything changed, so the dashboard's final picture is the cell's true end state, not the last throttled one.

The user namespace is reached as ``get_ipython().user_ns`` (the dict ipyparallel runs cells and applied
functions in) rather than through ``@interactive``, which would rebuild a function with the user namespace
as its globals and so cut it off from this module's state and helpers.
"""

from __future__ import annotations

import os
import pickle
import sys
import types
from typing import Any

from ..ipp.quiet_kernel import quiet_kernel
from ..ipp.signals import answer_signals
from ..ipp.stdstreams import lean_streams
from .wire import SEND_S, CellSettings

__all__ = ["KEY", "SEND_S", "RESULT_NAME", "UNPICKLABLE", "setup_namespace", "rank_info", "begin_cell",
           "configure_cell", "send_interval", "user_shell", "send_end_state", "check_replicas", "settings_in_force",
           "reset_settings", "reinit", "abort", "fetch_result", "elastic_mode", "placement", "open_group",
           "join_group", "elastic_restore", "setup_joiner", "export_namespace", "import_namespace"]

KEY = "taco"  # the key of the engines' payload in an AsyncResult's ``metadata["data"]``
PAYLOADS_PER_S = 250  # what the whole cluster sends the notebook at most: past 100 ranks each sends less often


def send_interval(ranks: int) -> float:
    """Seconds between a rank's dashboard payloads in a cell on ``ranks`` ranks: :data:`SEND_S`, longer past 100
    ranks so that the notebook receives at most :data:`PAYLOADS_PER_S` (1,000 ranks: one every 4 s each).

    >>> send_interval(4), send_interval(1000)
    (0.4, 4.0)
    """
    return max(SEND_S, ranks / PAYLOADS_PER_S)
RESULT_NAME = "__taco_result__"  # the kernel rewrites a cell's last expression into an assignment to it
UNPICKLABLE = "__taco_unpicklable__"  # fetch_result's mark for a value that cannot travel: (UNPICKLABLE, repr)


def user_shell() -> Any:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("taco_notebook.engine.calls runs on ipyparallel engines, which have an "
                           "IPython shell")
    return shell


class _Sender:
    """The metrics sender: remembers what it last sent so the post-execute flush sends only news."""

    def __init__(self) -> None:
        self.sent: tuple[int, Any] | None = None

    def __call__(self, payload: dict[str, Any]) -> None:
        from ..ipp.upstream import publish_data

        progress = payload.get("progress")
        self.sent = (payload["metrics"]["steps"], progress and progress.get("n"))
        publish_data({KEY: payload})

    def flush(self) -> None:
        """post_execute: send the end state if steps or progress moved since the last send."""
        from ..comm.diagnostics import metrics

        if metrics.sender() is not self:
            return
        progress = metrics.progress_state()
        now = (metrics.steps(), progress and progress.get("n"))
        if now != self.sent and (now[0] or progress is not None):
            metrics.send()


_sender = _Sender()


def send_end_state() -> None:
    """After code that fires no post_execute (an applied script): send the dashboard the end state if it moved."""
    _sender.flush()


def _skip(name: str, value: Any) -> bool:
    import builtins

    return (name.startswith("_") or name in _SHELL_NAMES or value is getattr(builtins, name, None)
            or callable(value) and str(getattr(value, "__module__", "")).startswith("IPython"))


_SHELL_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "taco", "torch", RESULT_NAME}


def export_namespace() -> tuple[bytes, list[str]]:
    """This rank's variables that can travel, pickled together (so a State keeps its model and optimizer), for
    engines joining an elastic cluster; and the names left out because they cannot travel. Modules travel as
    their names (the joiner imports them).

    With cloudpickle installed, instances of classes defined in a cell travel too; without it they need their
    class importable on the joining engine."""

    try:
        from cloudpickle import dumps
    except ImportError:
        dumps = pickle.dumps

    chosen: dict[str, Any] = {}
    modules: dict[str, str] = {}
    left: list[str] = []
    for name, value in list(user_shell().user_ns.items()):
        if _skip(name, value):
            continue
        if isinstance(value, types.ModuleType):
            modules[name] = value.__name__
            continue
        try:
            dumps(value)
        except Exception:  # noqa: BLE001 - any pickling failure: that name stays behind
            left.append(name)
            continue
        chosen[name] = value
    return dumps({"modules": modules, "values": chosen}), left


def import_namespace(payload: bytes) -> list[str]:
    """A joining engine takes rank 0's variables (:func:`export_namespace`); the names it got."""
    import importlib

    loaded = pickle.loads(payload)
    names = {name: importlib.import_module(module) for name, module in loaded["modules"].items()}
    names.update(loaded["values"])
    user_shell().user_ns.update(names)
    return sorted(names)


def setup_joiner() -> None:
    """An engine of a later engine set (``%taco_cluster scale`` on an elastic cluster): the namespace and the
    metrics flush of :func:`setup_namespace`, but no process group (it joins one at the next commit)."""
    import torch

    import taco_notebook.comm as taco

    shell = user_shell()
    shell.run_line_magic("xmode", "Plain")
    shell.user_ns.update(taco=taco, torch=torch)
    _serve_cells(shell)


def _serve_cells(shell: Any) -> None:
    """What every engine needs to run cells, after its namespace: the autopsy's listener (and %taco_peek's
    namespace), the lean streams
    (:mod:`.stdstreams`: no IOPub message for a stream with nothing to flush), the quiet kernel
    (:mod:`.quiet_kernel`: no busy status, no log line per request, no idle status for a silent cell), the
    signals a client sends, answered without a nanny (:mod:`.signals`) and the metrics' end-of-execution flush."""
    from ..comm.diagnostics.peek import set_namespace

    set_namespace(lambda: shell.user_ns)  # what %taco_peek's expressions read, beside the cell
    _listen_for_autopsy()
    lean_streams()
    quiet_kernel()
    answer_signals()
    if _sender.flush not in shell.events.callbacks["post_execute"]:
        shell.events.register("post_execute", _sender.flush)


def _listen_for_autopsy() -> None:
    """The hang autopsy's listener thread (:mod:`.diagnostics.listener`): answers while the main thread is
    blocked. Without it (its directory refused as unsafe) the engine still runs: the autopsy then says this rank
    has no listener."""
    from ..comm.diagnostics.listener import listen

    try:
        listen()
    except OSError as exc:
        print(f"[taco] no hang autopsy for this rank: {exc}", file=sys.stderr, flush=True)


def setup_namespace() -> None:
    """Once per engine at cluster start: ``taco`` and ``torch`` in the user namespace, the process group up,
    and the end-of-execution flush of the metrics sender installed."""
    import torch

    import taco_notebook.comm as taco

    shell = user_shell()
    # Plain tracebacks: IPython's richer modes cache every failed frame's variables, the process group among
    # them, and a group kept alive keeps its sockets open: peers blocked on a failed rank would never be
    # released (abort() clears the frames, not those caches).
    shell.run_line_magic("xmode", "Plain")
    shell.user_ns.update(taco=taco, torch=torch)  # what a cell sees as `taco`: the rank's API (module docstring)
    taco.init()
    _serve_cells(shell)


def rank_info() -> dict[str, Any]:
    """This engine's rank, host, pid, placement and what its host offers (a ``RankInfo``'s fields)."""
    from ..comm import topology
    from ..comm.group.hardware import gpu_names, hugepages, visible_gpus

    topo = topology()
    return {"rank": topo.rank, "host": topo.hostname, "pid": os.getpid(),
            "local_rank": topo.local_rank, "node": topo.node, "gpus": visible_gpus(), "hugepages": hugepages(),
            "gpu_names": gpu_names()}


def begin_cell(dashboard: bool = True, interval: float = SEND_S) -> None:
    """Before a ``%%taco_run`` cell: count from zero, and send metrics only if the cell has a dashboard."""
    from ..comm.diagnostics import metrics, replicas

    metrics.reset()
    replicas.begin_cell()
    _sender.sent = None
    metrics.set_sender(_sender if dashboard else None, interval)


def check_replicas(run: bool) -> dict[str, Any] | bool | None:
    """After a cell on every rank, the replica check (:mod:`.diagnostics.replicas`). ``run`` False: whether this
    rank has something to check (no collective). True: the check itself (collective, once every rank said yes)."""
    from ..comm.diagnostics.replicas import after_cell, wanted

    return after_cell() if run else wanted()


def configure_cell(settings: CellSettings) -> str | None:
    """``taco.configure()`` with a cell's ``settings`` for the next cell; with ``--compression auto``, the line
    saying what auto chose (taco.tune's remembered choice, or none)."""
    from ..comm import configure
    from ..comm.training.advisor import auto_choice

    _cell_settings[0] = True
    spec, note = auto_choice() if settings.auto_compression else (None, None)
    configure(**settings.configure_kwargs(auto=spec))
    return note


_cell_settings = [False]  # a cell's settings are in force: reset before the next cell if its own reset was missed


def settings_in_force() -> bool:
    """Whether a cell's settings (:func:`configure_cell`) are still in force: its reset did not run."""
    return _cell_settings[0]


def reset_settings() -> None:
    """After such a cell: back to the rank's defaults (``taco.configure(reset=True)``)."""
    from ..comm import configure

    configure(reset=True)
    _cell_settings[0] = False


def reinit() -> None:
    """Rebuild the process group (collective: every rank) after a cell that failed, was interrupted or aborted."""
    from ..comm import reinit as _reinit

    _reinit()


def abort() -> None:
    """Drop this rank's process group now so peers blocked on it fail fast (not collective; see bootstrap.abort)."""
    from ..comm.group.bootstrap import abort as _abort

    _abort()


class _Rebuilt:
    """A value made ready to travel: unpickling it calls ``rebuild(*args)``, which gives the value itself."""

    __slots__ = ("rebuild", "args")

    def __init__(self, rebuild: Any, args: tuple[Any, ...]) -> None:
        self.rebuild, self.args = rebuild, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.rebuild, self.args


def _tensor_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> Any:
    """The tensor :func:`_travelling` sent as its bytes (a writable copy: the message's bytes are not)."""
    import torch

    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


def _tensor_bytes(value: Any) -> _Rebuilt | None:
    """A plain CPU tensor (no grad, no subclass, no names) as its raw bytes, dtype and shape; None for anything
    else, or where the bytes cannot be had (no numpy)."""
    torch = sys.modules.get("torch")
    if (torch is None or type(value) is not torch.Tensor or value.device.type != "cpu"
            or value.layout != torch.strided or value.requires_grad or value.is_quantized
            or getattr(value, "has_names", lambda: False)()):  # named tensors: gone from newer torch
        return None
    try:
        flat = value.resolve_conj().resolve_neg().contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError):
        return None
    return _Rebuilt(_tensor_from_bytes, (data, str(value.dtype).removeprefix("torch."), tuple(value.shape)))


def _travelling(value: Any) -> Any:
    """``value`` as it goes back to the notebook, or ``(UNPICKLABLE, repr)``. A plain CPU tensor goes as its
    bytes, not through torch's pickling (``torch.save`` into a buffer on the rank, ``torch.load`` in the
    notebook), the slow part of bringing back a large tensor. Anything else goes as its pickle, made once here
    to see that it can travel, not a second time in the reply."""
    raw = _tensor_bytes(value)
    if raw is not None:
        return raw
    try:
        data = pickle.dumps(value)
    except Exception:  # noqa: BLE001 - any pickling failure: the notebook shows the repr instead
        return (UNPICKLABLE, repr(value))
    return _Rebuilt(pickle.loads, (data,))


def fetch_result() -> Any:
    """The value of the cell's last expression on this rank, or ``(UNPICKLABLE, repr)`` if it cannot travel
    (as it travels: unpickling the reply gives the value itself)."""
    return _travelling(user_shell().user_ns.get(RESULT_NAME))


# ---------------------------------------------------------------- elastic (cluster/elastic/recovery.py drives these)

def elastic_mode(on: bool) -> bool:
    """Tell this rank's wrapper (engine/rankwrap.py) whether its death should keep the MPI job alive
    (``%%taco_run --elastic``); False when the engine was not started by the wrapper."""
    import signal

    from ..comm.training.elastic import forget_update, request_update
    from .rankwrap import MODE_FD_ENV

    # SIGUSR1 from the notebook: engines wait to join, stop at the next commit (comm/training/elastic.py); one that
    # arrives after the cell is ignored, not fatal
    forget_update()
    signal.signal(signal.SIGUSR1, request_update if on else signal.SIG_IGN)
    fd = os.environ.get(MODE_FD_ENV)
    if fd is None:
        return False
    try:
        os.write(int(fd), b"elastic\n" if on else b"strict\n")
    except OSError:
        return False
    return True


def placement() -> dict[str, Any]:
    """Where this engine runs, for the client that numbers the members and picks the store's kind: ``key``
    (boot id and pid: unique across hosts), ``where`` (what tells hosts apart), ``node`` (its node name) and
    ``tcp`` (``TACO_MASTER_ADDR`` set: a TCPStore even on one host)."""
    from ..comm.group.members import placement as where
    from ..comm.group.topology import node_name

    here = where()
    return {"key": f"{here[0]}:{os.getpid()}", "where": here, "node": node_name(),
            "tcp": bool(os.environ.get("TACO_MASTER_ADDR"))}


def open_group(kind: str, size: int) -> str:
    """On the new rank 0: the address of a fresh store for a ``size``-member group (comm/group/members.py)."""
    from ..comm.group.members import open_group as _open

    return _open(kind, size)


def join_group(ranks_by_key: dict[str, int], hostnames: list[str], kind: str, address: str) -> int:
    """Join the group the client chose: this engine's new rank is ``ranks_by_key[placement()["key"]]``."""
    from ..comm.group.members import join_group as _join

    return _join(ranks_by_key[placement()["key"]], hostnames, kind, address)


def elastic_restore() -> dict[str, Any]:
    """Roll every ``taco.elastic.State`` back to its last commit and take rank 0's (collective); the first
    state's counters afterwards, for the cell's message ({} without a State)."""
    from ..comm.training.elastic import live_states, restore_all, sync_all

    restore_all()
    sync_all(0)
    states = sorted(live_states(), key=lambda s: s.order)
    return states[0].counters if states else {}
