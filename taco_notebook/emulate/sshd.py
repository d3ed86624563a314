"""A real OpenSSH server on each emulated node, and the client side that reaches it without prompts.

Each node of an :class:`~taco_notebook.emulate.nodes.EmulatedNodes` set gets its own ``sshd`` (Debian's
openssh-server), started as ``ip netns exec NS unshare --uts -- sh -c 'hostname n0; exec sshd -D -f CONFIG'``:
inside the node's network namespace, in a UTS namespace of its own whose hostname is the node's name (namespaces
alone share the hostname, which would merge every node into one), listening only on the node's private address.
Every ssh session inherits both, so ``ssh -F CONFIG n0 hostname`` prints ``n0``.

Keys are generated per set: an ed25519 host key per node and one user key pair, whose public half is the
``authorized_keys`` of the current user (root: namespaces need it). The client config pins each node's host key
(``StrictHostKeyChecking yes`` against a known_hosts of our own) and never asks for anything (``BatchMode``).

The session environment: sshd's ``SetEnv`` puts this Python's ``bin`` directory first on ``PATH`` (sshd otherwise
resets PATH to the system default, and no ``AcceptEnv`` can change that) and gives every session the node's
``GLOO_SOCKET_IFNAME`` and TCP-only UCX; ``PYTHONPATH`` and ``TACO_*``, ``LIGHT_*``, ``MPI4PY_*`` travel from the
client (``SendEnv`` in our client config, ``AcceptEnv`` in sshd's), as on a cluster with a shared filesystem.
Processes are recorded by pid *and* creation time and stopped only when both match and the process is this
user's ``sshd`` running our config: a recycled pid is never signalled.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

__all__ = ["SSH_TOOLS", "SshdProcess", "find_sshd", "generate_key", "write_private_text", "sshd_config",
           "client_config", "known_hosts", "start_sshd", "stop_sshd", "SEND_ENV", "PRIVSEP_DIR",
           "ensure_privsep_dir", "remove_privsep_dir"]

SSH_TOOLS = {"sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client"}
SEND_ENV = ("PYTHONPATH", "TACO_*", "LIGHT_*", "MPI4PY_*", "OMP_NUM_THREADS")
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PRIVSEP_DIR = Path("/run/sshd")  # Debian's sshd refuses to start without it (its systemd unit makes it)
# Sets the node's hostname in the fresh UTS namespace, then becomes sshd (same pid: recorded by Popen).
_INNER_SCRIPT = 'hostname "$0" || exit 255; exec "$1" -D -f "$2" -E "$3"'


@dataclass(frozen=True)
class SshdProcess:
    """One node's sshd as started: its pid and creation time (psutil's, seconds since the epoch)."""

    pid: int
    create_time: float

    def proven(self, config: Path) -> psutil.Process | None:
        """The live process if it is still this sshd (same pid, same start, ours, running ``config``), else None."""
        try:
            proc = psutil.Process(self.pid)
            with proc.oneshot():
                # the listener rewrites its title ("sshd: /usr/sbin/sshd -D -f CONFIG … [listener] …")
                same = (abs(proc.create_time() - self.create_time) < 0.01 and proc.uids().real == os.getuid()
                        and os.path.basename(proc.exe()) == "sshd" and str(config) in " ".join(proc.cmdline())
                        and proc.status() != psutil.STATUS_ZOMBIE)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None
        return proc if same else None


def find_sshd() -> str | None:
    """The absolute path of ``sshd`` (it re-executes itself, so it must be started by absolute path)."""
    return shutil.which("sshd", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def write_private_text(path: Path, text: str, mode: int = 0o600) -> None:
    """Create ``path`` with ``mode`` from the start (``O_EXCL``: never through an existing file or symlink)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def generate_key(path: Path, comment: str) -> str:
    """A new passphrase-less ed25519 key pair at ``path`` and ``path.pub`` (both 0600); returns the public line."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True, text=True, timeout=30, umask=0o077)
    return path.with_name(path.name + ".pub").read_text(encoding="utf-8").strip()


def sshd_config(address: str, host_key: Path, authorized_keys: Path, user: str,
                node_env: Mapping[str, str]) -> str:
    """An sshd_config for one node: its address only, key login for ``user`` only, no forwarding of any kind."""
    path = os.pathsep.join([str(Path(sys.executable).parent), _SYSTEM_PATH])
    setenv = " ".join(f"{k}={v}" for k, v in {"PATH": path, **node_env}.items())
    return "\n".join([
        "# sshd of one emulated node (taco-notebook emulate); started with -D -f THIS in the node's namespace",
        f"ListenAddress {address}:22", "AddressFamily inet", f"HostKey {host_key}", "PidFile none",
        f"AuthorizedKeysFile {authorized_keys}", f"AllowUsers {user}", "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "UsePAM no", "StrictModes yes", "X11Forwarding no", "AllowTcpForwarding no",
        "AllowStreamLocalForwarding no", "AllowAgentForwarding no", "PermitTunnel no", "PermitUserEnvironment no",
        "PrintMotd no", "PrintLastLog no", "UseDNS no", "MaxStartups 100:30:200", "MaxSessions 100",
        f"SetEnv {setenv}", f"AcceptEnv {' '.join(SEND_ENV)}", "LogLevel INFO", "",
    ])


def known_hosts(host_keys: Mapping[str, tuple[str, str]]) -> str:
    """known_hosts lines: for each host, its name and address against its public host key line."""
    lines = []
    for host, (address, public_line) in host_keys.items():
        key_type, key = public_line.split()[:2]
        lines.append(f"{host},{address} {key_type} {key}")
    return "\n".join(lines) + "\n"


def client_config(addresses: Mapping[str, str], user: str, identity: Path, known_hosts_file: Path) -> str:
    """An ssh client config (``ssh -F THIS n0 …``) that reaches every node with no prompt of any kind."""
    blocks = ["# ssh client config of emulated nodes (taco-notebook emulate): ssh -F THIS n0 hostname"]
    for host, address in addresses.items():
        blocks.append("\n".join([
            f"Host {host}", f"  HostName {address}", "  Port 22", f"  User {user}", f"  IdentityFile {identity}",
            "  IdentitiesOnly yes", f"  UserKnownHostsFile {known_hosts_file}", "  GlobalKnownHostsFile /dev/null",
            "  StrictHostKeyChecking yes", "  CheckHostIP no", "  BatchMode yes", "  PasswordAuthentication no",
            "  ForwardAgent no", "  ForwardX11 no", "  ControlMaster no", "  ConnectTimeout 10",
            "  LogLevel ERROR", f"  SendEnv {' '.join(SEND_ENV)}",
        ]))
    return "\n\n".join(blocks) + "\n"


def ensure_privsep_dir() -> bool:
    """Make sshd's privilege-separation directory if missing (root's, 0755, empty: as Debian's unit makes it).

    True if this call made it: whoever made it removes it with :func:`remove_privsep_dir`.
    """
    try:
        os.mkdir(PRIVSEP_DIR, 0o755)
    except FileExistsError:
        return False
    return True


def remove_privsep_dir() -> None:
    """Remove the privilege-separation directory if it is empty and no sshd at all runs any more (another set's,
    or the system's, would need it for its next login)."""
    for proc in psutil.process_iter(["name", "status"]):
        if proc.info["name"] == "sshd" and proc.info["status"] != psutil.STATUS_ZOMBIE:
            return
    try:
        PRIVSEP_DIR.rmdir()
    except OSError:
        pass


def start_sshd(sshd: str, namespace: str, host: str, address: str, config: Path, log: Path,
               timeout: float = 15.0) -> SshdProcess:
    """Start ``sshd -D -f config`` on the node and wait until it accepts connections on ``address:22``.

    It runs in a new session (it must outlive the caller) with no terminal. If it exits or does not listen in
    time it is stopped and a RuntimeError quotes its log.
    """
    argv = ["ip", "netns", "exec", namespace, "unshare", "--uts", "--", "/bin/sh", "-c", _INNER_SCRIPT,
            host, sshd, str(config), str(log)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)
    record = SshdProcess(proc.pid, psutil.Process(proc.pid).create_time())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if _accepts(address) and record.proven(config) is not None:
            return record
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    told = log.read_text(encoding="utf-8", errors="replace").strip() if log.exists() else ""
    raise RuntimeError(f"sshd of node {host} did not start listening on {address}:22 "
                       f"(`{shlex.join(argv)}` exited {proc.returncode}): {told or 'no log'}")


def _accepts(address: str) -> bool:
    try:
        with socket.create_connection((address, 22), timeout=0.5):
            return True
    except OSError:
        return False


def stop_sshd(records: Mapping[SshdProcess, Path], grace_s: float = 3.0) -> int:
    """SIGTERM (then SIGKILL after ``grace_s``) each recorded sshd (-> its config) that proves to be ours.

    Returns how many were running. They are signalled together and counted gone once dead or a zombie (the
    caller that started them has exited, so their parent is init, which may reap them late).
    """
    procs = [proc for record, config in records.items() if (proc := record.proven(config)) is not None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_running(proc) for proc in procs):
            time.sleep(0.02)
    return len(procs)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
