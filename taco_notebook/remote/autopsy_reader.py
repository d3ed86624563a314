"""The hang autopsy's reader for one host: every listed rank's answer from its Unix socket, and for a rank that
gives none what the OS says of it (``/proc/PID/status`` state, ``wchan``).

The collector (:mod:`.autopsy`) calls :func:`read_pids` in its own process for the ranks of its host, and runs
this module over ssh on every other host, one ssh per host, since a Unix socket is reached only from its own
host. There it prints one JSON line::

    python -m taco_notebook.remote.autopsy_reader --dir /tmp/taco-0/stacks --timeout 1.5 4711 4712
    {"host": "n1", "pids": {"4711": {"reply": {"now": {...}, "at_stall": null}}, "4712": {"missing": "..."}}}

Standard library only (no ``taco_notebook.comm``, which imports torch), so it starts without torch's import
time. It only connects to the ranks' sockets and reads ``/proc``: it never stops or changes a rank.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..private import UnsafeDirectoryError, check_private_dir

__all__ = ["MAX_REPLY_BYTES", "MODULE", "STACKS", "peek_request", "ask", "os_state", "read_pid",
           "read_pids", "main"]

MAX_REPLY_BYTES = 8 << 20  # a few hundred threads of deep stacks: far less; anything larger is not ours
MODULE = "taco_notebook.remote.autopsy_reader"  # what the collector runs with ``python -m`` over ssh


STACKS = {"ask": "stacks"}  # the listener's reply: {"now": snapshot, "at_stall": snapshot or None}


def peek_request(expression: str, timeout: float) -> dict[str, Any]:
    """The request that evaluates ``expression`` on the rank (``%taco_peek``), waiting at most ``timeout`` s; the
    listener's reply: ``{"peek": {"value": repr} or {"error": why}, "rank": rank}``."""
    return {"ask": "peek", "expr": expression, "timeout": timeout}


def ask(path: Path | str, timeout: float, request: dict[str, Any] | None = None) -> dict[str, Any]:
    """The reply of the listener at ``path`` to ``request`` (:data:`STACKS` by default). Raises OSError (none
    listens there), TimeoutError (it did not answer in ``timeout`` s) or ValueError (not JSON)."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(str(path))
        conn.sendall(json.dumps(request or STACKS).encode() + b"\n")
        chunks, size = [], 0
        while True:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = conn.recv(1 << 16)
            except TimeoutError:
                raise TimeoutError(f"no answer in {timeout:g} s") from None
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_REPLY_BYTES:
                raise ValueError(f"reply over {MAX_REPLY_BYTES} bytes")
    if not chunks:
        raise ValueError("the listener closed the connection without an answer")
    reply: dict[str, Any] = json.loads(b"".join(chunks))
    return reply


def os_state(pid: int) -> str:
    """What this host's OS says of process ``pid``: its state and where its main thread sleeps in the kernel."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return f"no process {pid} on {socket.gethostname()}"
    except OSError as exc:
        return f"/proc/{pid}/status unreadable: {exc.strerror}"
    state = next((line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("State:")), "?")
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "0"
    except OSError:
        wchan = "unreadable"
    return f"process {pid} is {state} (/proc/{pid}/status), wchan {wchan if wchan != '0' else 'none (running)'}"


def read_pid(pid: int, directory: Path, timeout: float, request: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"reply": …}`` from the listener of process ``pid`` in ``directory``, else ``{"missing": why}``."""
    path = directory / f"{pid}.sock"
    try:
        return {"reply": ask(path, timeout, request)}
    except TimeoutError as exc:
        return {"missing": f"its listener did not answer ({exc}; its main thread may hold the GIL in C); "
                           + os_state(pid)}
    except (OSError, ValueError) as exc:
        reason = "no listener" if isinstance(exc, FileNotFoundError | ConnectionRefusedError) else str(exc)
        return {"missing": f"{reason} at {path}; " + os_state(pid)}


def read_pids(pids: Sequence[int], directory: Path, timeout: float,
              request: dict[str, Any] | None = None) -> dict[int, dict[str, Any]]:
    """:func:`read_pid` of every process at once (so the whole read takes at most ``timeout``). A stacks
    directory that another user could control is not read at all: every pid is missing, with the reason."""
    try:
        check_private_dir(directory, "stacks directory", f"remove it (rm -r {directory}) so the ranks create it "
                          "again, private, or set TACO_AUTOPSY_DIR to a directory of your own with mode 0700")
    except FileNotFoundError:
        pass  # no listener started on this host: each pid says so
    except UnsafeDirectoryError as exc:
        return {pid: {"missing": f"{exc}; " + os_state(pid)} for pid in pids}
    if not pids:
        return {}
    with ThreadPoolExecutor(min(64, len(pids)), thread_name_prefix="taco-autopsy") as pool:
        answers = list(pool.map(lambda pid: read_pid(pid, directory, timeout, request), pids))
    return dict(zip(pids, answers, strict=True))


def main(argv: Sequence[str] | None = None) -> int:
    """Read the pids named on the command line and print ``{"host", "pids"}`` as one JSON line."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, type=Path, help="the ranks' stacks directory on this host")
    parser.add_argument("--timeout", type=float, default=1.5, help="seconds each rank gets to answer")
    parser.add_argument("--request", type=json.loads, default=None, metavar="JSON",
                        help=f"what to ask each listener (default: {json.dumps(STACKS)})")
    parser.add_argument("pids", nargs="+", type=int, metavar="PID")
    args = parser.parse_args(argv)
    found = read_pids(args.pids, args.dir, args.timeout, args.request)
    print(json.dumps({"host": socket.gethostname(), "pids": {str(pid): answer for pid, answer in found.items()}},
                     default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
