"""A one-second TCP bandwidth measurement between two nodes, for ``%taco_doctor``.

A receiver binds only to the address it is given (never 0.0.0.0), accepts one connection that opens with the
measurement's token, counts the bytes until the sender stops and answers with what it measured; the sender
streams zeros for ``seconds``. The figure is the receiver's (bytes after the first read over the time from it to
the end of the stream): socket buffers cannot inflate it. Run each half where its node is, by hand::

    python -m taco_notebook.comm.diagnostics.linkspeed receive 10.0.0.1 --token T  # {"port": N}, then the result
    python -m taco_notebook.comm.diagnostics.linkspeed send 10.0.0.1 N --token T   # the result

or let :func:`measure_link` run both through command prefixes (``ssh host python3``, ``ip netns exec NS python``).
It hands each Python this file on stdin (``python - receive …``): the module needs only the standard library, so
a node needs neither this package nor torch to be measured, and no second of import time skews the start.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["receive", "start_receiver", "send", "measure_link", "LinkSpeedError", "main"]

_CHUNK = 1 << 20


class LinkSpeedError(RuntimeError):
    """The measurement could not be made (nothing listening, a timeout, a half that failed)."""


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def _read_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _count(conn: socket.socket) -> tuple[int, float]:
    """Bytes received after the first read, and the seconds from that read to the end of the stream."""
    buf = bytearray(_CHUNK)
    first = conn.recv_into(buf)
    if not first:
        return 0, 0.0
    start, total = time.perf_counter(), 0
    while n := conn.recv_into(buf):
        total += n
    return total, time.perf_counter() - start


def receive(address: str, token: str, port: int = 0, timeout: float = 20.0,
            ready: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Listen on ``address`` only, measure one sender that opens with ``token``; ``ready(port)`` once listening.

    Connections that do not present the token are closed and waited past, until ``timeout``.
    """
    deadline = time.monotonic() + timeout
    with socket.socket(_family(address), socket.SOCK_STREAM) as server:
        server.bind((address, port))
        server.listen(4)
        if ready is not None:
            ready(server.getsockname()[1])
        while True:
            server.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, peer = server.accept()
            except TimeoutError:
                raise LinkSpeedError(f"no sender reached {address} within {timeout:g} s") from None
            with conn:
                conn.settimeout(max(1.0, deadline - time.monotonic()))
                if _read_exact(conn, len(token)) != token.encode():
                    continue
                received, seconds = _count(conn)
                result = {"to": address, "from": peer[0], "bytes": received, "seconds": round(seconds, 4),
                          "gbit_per_s": round(received * 8 / seconds / 1e9, 4) if seconds > 0 else 0.0}
                conn.sendall(json.dumps(result).encode() + b"\n")
                return result


def start_receiver(address: str, timeout: float = 20.0) -> dict[str, Any]:
    """Start :func:`receive` on ``address`` in a daemon thread; ``{"port", "token"}`` for the :func:`send` to it.

    For engines (``view.apply``): apply this on the receiving node's engine, then :func:`send` on the sender's,
    which returns the receiver's figures. The thread ends after one measurement or ``timeout``.
    """
    token, ready, ports = secrets.token_hex(8), threading.Event(), list[int]()

    def listening(port: int) -> None:
        ports.append(port)
        ready.set()

    def serve() -> None:
        try:
            receive(address, token, timeout=timeout, ready=listening)
        except (OSError, LinkSpeedError):
            ready.set()  # the sender will find nothing listening and say so

    threading.Thread(target=serve, name=f"taco-linkspeed-{address}", daemon=True).start()
    if not ready.wait(timeout) or not ports:
        raise LinkSpeedError(f"could not listen on {address} (is it an address of this node?)")
    return {"port": ports[0], "token": token}


def send(address: str, port: int, token: str, seconds: float = 1.0, timeout: float = 20.0) -> dict[str, Any]:
    """Stream zeros to a :func:`receive` at ``address:port`` for ``seconds``; return the receiver's figures."""
    payload = bytes(_CHUNK)
    with socket.create_connection((address, port), timeout=timeout) as conn:
        conn.sendall(token.encode())
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := conn.recv(4096):
            reply += chunk
    if not reply.strip():
        raise LinkSpeedError(f"the receiver at {address}:{port} closed without a result")
    result: dict[str, Any] = json.loads(reply)
    return result


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


def _stop(proc: subprocess.Popen[str]) -> str:
    """End the receiver (its own session, started here) if it still runs; its stderr."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.stdout is not None and proc.stderr is not None
    if proc.stderr.closed:  # stopped already
        return ""
    err = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    return err.strip()


def measure_link(receiver: Sequence[str], sender: Sequence[str], address: str, seconds: float = 1.0,
                 timeout: float = 30.0) -> dict[str, Any]:
    """Measure ``sender``'s node → ``address`` (on ``receiver``'s node) for ``seconds``; the receiver's figures.

    ``receiver`` and ``sender`` are the command prefixes that run a Python with this package on each node, for
    example ``[sys.executable]`` here, ``["ip", "netns", "exec", NS, sys.executable]`` in a namespace node or
    ``["ssh", HOST, "python3"]``. Both halves are stopped before this returns, whatever happened.
    """
    token = secrets.token_hex(8)
    source = Path(__file__).read_text(encoding="utf-8")
    proc = subprocess.Popen([*receiver, "-", "receive", address, "--token", token, "--timeout", str(timeout)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdin is not None
        proc.stdin.write(source)
        proc.stdin.close()
        line = _read_line(proc, timeout)
        if not line.startswith("{"):
            raise LinkSpeedError(f"the receiver on {address} did not start: {line.strip() or _stop(proc)}")
        port = json.loads(line)["port"]
        done = subprocess.run([*sender, "-", "send", address, str(port), "--token", token, "--seconds",
                               str(seconds)], input=source, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise LinkSpeedError(f"the sender to {address}:{port} failed: {done.stderr.strip()[-500:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result
    except subprocess.TimeoutExpired:
        raise LinkSpeedError(f"measuring the link to {address} took over {timeout:g} s") from None
    finally:
        _stop(proc)


def main(argv: Sequence[str] | None = None) -> int:
    """The two halves as commands (see the module docstring); results as JSON lines on stdout."""
    parser = argparse.ArgumentParser(prog="python -m taco_notebook.comm.diagnostics.linkspeed", description=__doc__)
    sub = parser.add_subparsers(dest="role", required=True)
    rx = sub.add_parser("receive", help="listen on ADDRESS only and measure one sender")
    rx.add_argument("address")
    tx = sub.add_parser("send", help="stream to ADDRESS PORT for --seconds")
    tx.add_argument("address")
    tx.add_argument("port", type=int)
    tx.add_argument("--seconds", type=float, default=1.0)
    for half in (rx, tx):
        half.add_argument("--token", required=True, help="the shared secret both halves present")
        half.add_argument("--timeout", type=float, default=20.0)
    args = parser.parse_args(argv)
    try:
        if args.role == "receive":
            result = receive(args.address, args.token, timeout=args.timeout,
                             ready=lambda port: print(json.dumps({"port": port}), flush=True))
        else:
            result = send(args.address, args.port, args.token, args.seconds, args.timeout)
    except (OSError, LinkSpeedError) as exc:
        print(f"linkspeed {args.role} {args.address}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
