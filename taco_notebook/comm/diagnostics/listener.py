"""The rank's side of the hang autopsy: every thread's Python stack and the collective this rank is in, served
on a Unix socket by a small listener thread, so they can be read while the main thread is blocked.

Why a listener thread and not the rank's engine: the engine answers on its main thread, which is the one that
hangs. Why not a signal (``faulthandler``): a Python signal handler also runs on the main thread, and only
between bytecodes, so a rank blocked in C would not answer; faulthandler's C handler writes to a file
descriptor and cannot report the collective. The listener needs only the GIL, which a rank blocked in a
collective, in ``time.sleep`` or in I/O has released, and which a rank busy in Python hands over every
``sys.getswitchinterval()`` (5 ms). A rank whose main thread holds the GIL in C for long (a C extension that
never releases it) does not answer: the collector then reports what the OS says (``/proc/PID/status``, ``wchan``).

Reading the stacks never stops or changes the rank: :func:`sys._current_frames` is a read of the interpreter's
frames, and the listener only writes to its own socket.

The socket is ``<dir>/<pid>.sock`` in a directory of this user's alone (0700; :func:`socket_dir`): another user
can neither connect nor plant a socket, and the listener also checks its peer's uid (``SO_PEERCRED``). A path,
not an abstract socket, so that ranks in network namespaces (the emulated nodes) are reached too.

    >>> listen()  # on each rank (engine/calls.py does it at engine setup)  # doctest: +SKIP
    >>> ask(socket_path(pid), timeout=1.0)  # from another process of the same user  # doctest: +SKIP

The reader's side (:func:`~taco_notebook.remote.autopsy_reader.ask`, and :mod:`taco_notebook.cluster.cells.autopsy`
with the ssh to other hosts) must not import this package, which imports torch.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from ...errors import StallError
from ...model import PEEK_TIMEOUT_S
from . import stall
from .userframes import library_file

__all__ = ["DIR_ENV", "socket_dir", "socket_path", "snapshot", "remember_stall", "listen", "stop_listening"]

DIR_ENV = "TACO_AUTOPSY_DIR"
_THREAD_NAME = "taco-autopsy"


def socket_dir() -> Path:
    """``$TACO_AUTOPSY_DIR``, else ``<tmp>/taco-<uid>/stacks``: short (a socket path is at most 107 bytes) and
    on every host. Created 0700; refused (PermissionError) if it is a symlink, another user's, or open to others."""
    base = os.environ.get(DIR_ENV)
    path = Path(base) if base else Path(tempfile.gettempdir()) / f"taco-{os.geteuid()}" / "stacks"
    for directory in ([path] if base else [path.parent, path]):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
        info = os.lstat(directory)
        if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid()
                or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO)):
            raise PermissionError(f"refusing the stacks directory {directory}: it must be a directory of uid "
                                  f"{os.geteuid()} with mode 0700 (found {stat.filemode(info.st_mode)}, uid "
                                  f"{info.st_uid}); remove it, or set {DIR_ENV} to a private directory")
    return path


def socket_path(pid: int, directory: Path | None = None) -> Path:
    """Where the rank with process id ``pid`` listens."""
    return (directory or socket_dir()) / f"{pid}.sock"


def _frames(frame: Any) -> list[list[Any]]:
    return [[f.filename, f.lineno, f.name, f.line or ""] for f in traceback.extract_stack(frame)]


def _user_place(frames: list[list[Any]]) -> list[Any] | None:
    """The innermost frame in the user's code (a cell, a script); None when the thread runs none (idle)."""
    for frame in reversed(frames):
        if not library_file(frame[0]):
            return frame
    return None


_CONSISTENT_TRIES = 5


def _same_flight(before: tuple[int, str, float] | None, after: tuple[int, str, float] | None) -> bool:
    """Whether two reads of :func:`.stall.in_flight` are one collective (or none); its wait time grows."""
    if before is None or after is None:
        return before is after
    return before[:2] == after[:2]


def _threads() -> tuple[list[dict[str, Any]], list[Any] | None]:
    """Every thread's frames but the listener's, the main thread first, and the main thread's user frame."""
    names = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident
    me = threading.get_ident()
    threads = []
    place = None
    for ident, frame in sys._current_frames().items():
        thread = names.get(ident)
        if ident == me or (thread is not None and thread.name.startswith(_THREAD_NAME)):
            continue
        frames = _frames(frame)
        if ident == main:
            place = _user_place(frames)
        threads.append({"name": thread.name if thread else f"thread {ident}", "main": ident == main,
                        "frames": frames})
    threads.sort(key=lambda t: (not t["main"], t["name"]))
    return threads, place


def snapshot() -> dict[str, Any]:
    """This process now: ``{rank, pid, host, taken_at, collective, place, threads}``; ``collective`` is
    ``{name, seq, waited_s}`` or None; ``place`` the main thread's innermost frame of user code."""
    from ..state import state

    # the frames and the collective must describe one moment: read the collective on both sides of the frames
    # and read again while the rank entered or left one in between
    flight = stall.in_flight()
    for _ in range(_CONSISTENT_TRIES):
        threads, place = _threads()
        after = stall.in_flight()
        if _same_flight(flight, after):
            break
        flight = after
    collective = None if flight is None else {"seq": flight[0], "name": flight[1], "waited_s": round(flight[2], 3)}
    topology = state.topology
    return {"rank": topology.rank if topology is not None else None, "pid": os.getpid(),
            "host": socket.gethostname(), "taken_at": time.time(), "collective": collective, "place": place,
            "threads": threads}


_at_stall: dict[str, Any] | None = None


def remember_stall(seq: int, label: str, waited: float) -> None:
    """What this rank looked like while it waited in collective ``seq`` (``label``: ``allreduce 'step'``), kept
    for the next reader: afterwards the rank is no longer in the collective."""
    global _at_stall
    taken = snapshot()
    taken["collective"] = {"seq": seq, "name": label, "waited_s": round(waited, 3)}
    _at_stall = taken


def _on_stall(error: StallError) -> None:
    """The stall watchdog's hook (:func:`.stall.on_stall`): called as it fires, before it tears the group down."""
    title, seq = error.collective or "", error.seq or 0
    remember_stall(seq, title.replace(f" #{seq}", "", 1), error.waited_s or 0.0)


class _Listener:
    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.path: Path | None = None
        self.lock = threading.Lock()


_listener = _Listener()


def listen(directory: Path | None = None) -> Path:
    """Serve :func:`snapshot` on ``<socket_dir>/<pid>.sock`` from a daemon thread (once per process; later calls
    return the path). Sockets left by processes that no longer exist are removed first."""
    with _listener.lock:
        if _listener.path is not None and _listener.path.exists():
            return _listener.path
        directory = directory or socket_dir()
        _remove_dead(directory)
        path = socket_path(os.getpid(), directory)
        path.unlink(missing_ok=True)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        os.chmod(path, 0o600)
        server.listen(16)
        _listener.sock, _listener.path = server, path
        threading.Thread(target=_serve, args=(server,), name=_THREAD_NAME, daemon=True).start()
        atexit.register(stop_listening)
        stall.on_stall(_on_stall)
        return path


def stop_listening() -> None:
    """Close the socket and remove its file (at exit; tests)."""
    with _listener.lock:
        server, path = _listener.sock, _listener.path
        _listener.sock = _listener.path = None
    if server is not None:
        try:
            server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        server.close()
    if path is not None:
        path.unlink(missing_ok=True)


def _remove_dead(directory: Path) -> None:
    for entry in directory.glob("*.sock"):
        pid = entry.stem
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            entry.unlink(missing_ok=True)


REQUEST_BYTES = 64 * 1024  # a request line: ``{"ask": "stacks"}`` or ``{"ask": "peek", "expr": …, "timeout": s}``


def _request(conn: socket.socket) -> dict[str, Any]:
    """The reader's one JSON line."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > REQUEST_BYTES:
            raise ValueError(f"request over {REQUEST_BYTES} bytes")
    request: dict[str, Any] = json.loads(data or b"{}")
    return request


def _answer(request: dict[str, Any]) -> dict[str, Any]:
    if request.get("ask") == "peek":
        from ..state import state
        from .peek import evaluate

        timeout = min(float(request.get("timeout", 1.0)), PEEK_TIMEOUT_S)
        rank = state.topology.rank if state.topology is not None else None
        return {"peek": evaluate(str(request.get("expr", "")), timeout), "rank": rank}
    return {"now": snapshot(), "at_stall": _at_stall}


def _reply(conn: socket.socket) -> None:
    """Answer one reader of this user, then close."""
    with conn:
        conn.settimeout(2.0)  # a reader that stops reading must not hold the listener
        try:
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))[1]
            if uid != os.geteuid():
                return
            reply = _answer(_request(conn))
            conn.sendall(json.dumps(reply, default=str).encode())
        except Exception:  # noqa: BLE001 - one failed reply must not end the listener
            return


def _serve(server: socket.socket) -> None:
    """Each reader on a thread of its own: a peek may wait for its expression, the stacks readers must not."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:  # closed by stop_listening
            return
        threading.Thread(target=_reply, args=(conn,), name=_THREAD_NAME, daemon=True).start()
