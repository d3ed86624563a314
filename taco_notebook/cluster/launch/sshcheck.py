"""Which hosts of a ``hosts`` profile ssh cannot reach, to name them before a cluster over ssh starts.

mpich's hydra reports an ssh failure with the address ssh tried ("ssh: connect to host 10.0.0.2 port 22:
Connection refused") and no host name, a host that drops packets keeps ssh waiting for the kernel's TCP
timeout, and the ranks already started on the other hosts are killed in MPI_Init, leaving their shared memory.
:func:`unreachable_hosts` asks each host the way hydra will (the profile's ``launcher_exec`` or ``ssh``), all at
once, in batch mode (no prompt) with a short connect timeout, and returns what failed.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence

from .profiles import Profile

__all__ = ["unreachable_hosts", "runs_locally", "ssh_command", "CONNECT_TIMEOUT_S"]

CONNECT_TIMEOUT_S = 10


def runs_locally(host: str) -> bool:
    """Whether hydra starts ``host``'s ranks without ssh (this machine by its name or a loopback address)."""
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def ssh_command(ssh: str, host: str, command: Sequence[str], timeout: float = CONNECT_TIMEOUT_S) -> list[str]:
    """``command`` run on ``host`` the way hydra reaches it: ``ssh`` (a profile's ``launcher_exec`` or ``ssh``) in
    batch mode (never a prompt) with a connect timeout of ``timeout`` seconds (at least 1)."""
    return [ssh, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout))}", host, *command]


def _reason(run: subprocess.Popen[str], stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"ssh exited with status {run.returncode}"


def unreachable_hosts(profile: Profile, timeout: float = CONNECT_TIMEOUT_S) -> dict[str, str]:
    """``{host: why}`` for each host of ``profile`` where ``ssh HOST true`` fails or outlasts ``timeout``
    seconds plus a margin; hosts that hydra runs locally are not asked. Empty: every host answered."""
    ssh = profile.launcher_exec or "ssh"
    asked = [host for host, _ in profile.hosts if not runs_locally(host)]
    if asked and shutil.which(ssh) is None:
        return {host: f"{ssh} cannot be run (not found or not executable)" for host in asked}
    runs = {host: subprocess.Popen(ssh_command(ssh, host, ["true"], timeout),
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True)
            for host in asked}
    deadline = time.monotonic() + timeout + 5
    failed = {}
    for host, run in runs.items():
        try:
            _, stderr = run.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            run.kill()
            run.communicate()
            failed[host] = f"ssh gave no answer in {timeout + 5:.0f} s"
            continue
        if run.returncode != 0:
            failed[host] = _reason(run, stderr)
    return failed
