"""A launch overlay: how to reach hosts that a tool made, published by that tool as plain data.

Emulated nodes (``python -m taco_notebook emulate up``) are ssh hosts ``n0``, ``n1``… that only their own ssh
stand-in reaches, that call the controller back on a bridge address, and whose ranks must pin gloo and UCX to
the node's interface. The ``hosts`` profile needs those three facts for ``--hosts n0:2,n1:2``; rather than import
the emulator (a tool beside production), it reads what the emulator wrote when its nodes were up::

    STATE/launch-overlay.json
    {"version": 1, "hosts": ["n0", "n1"], "launcher_exec": "STATE/ssh/ssh-launcher",
     "controller_ip": "10.77.0.254", "environment": {"GLOO_SOCKET_IFNAME": "taco0", "UCX_TLS": "self,tcp", ...}}

``STATE`` is ``$TACO_EMULATE_DIR``, else ``$XDG_STATE_HOME/taco-notebook/emulated`` (or ``~/.local/state/…``).
The file names a program that mpiexec runs, so it is trusted only as :mod:`~taco_notebook.private` trusts
files: written 0600 in a 0700 directory, read only from a directory of this user that no one else may write, only
if it is a regular file of this user, small, and well formed; otherwise :class:`ProfileError` says which and how
to fix it. No file, or one whose hosts do not include all of the profile's: None, and the hosts are real ones.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...private import UnsafeDirectoryError, check_private_dir, read_private_json, write_private_json
from .hostfiles import ProfileError

__all__ = ["LaunchOverlay", "OVERLAY_FILE", "OVERLAY_VERSION", "default_state_dir", "write_launch_overlay",
           "read_launch_overlay", "overlay_for"]

OVERLAY_FILE = "launch-overlay.json"
OVERLAY_VERSION = 1
_MAX_BYTES = 64 << 10


@dataclass(frozen=True)
class LaunchOverlay:
    """What a ``hosts`` profile over ``hosts`` takes instead of its defaults: hydra's ``-launcher-exec``, the
    address the hosts reach the controller on, and environment variables for mpiexec (copied to every rank)."""

    hosts: tuple[str, ...]
    launcher_exec: str
    controller_ip: str
    environment: Mapping[str, str] = field(default_factory=dict)

    def covers(self, hosts: Iterable[str]) -> bool:
        """Whether every one of ``hosts`` is one of the overlay's (a profile over other hosts ignores it)."""
        return set(hosts) <= set(self.hosts)

    def to_json(self) -> dict[str, Any]:
        return {"version": OVERLAY_VERSION, "hosts": list(self.hosts), "launcher_exec": self.launcher_exec,
                "controller_ip": self.controller_ip, "environment": dict(self.environment)}

    @classmethod
    def from_json(cls, data: Any) -> LaunchOverlay:
        """The overlay in ``data`` (as :meth:`to_json` writes it); ValueError naming the first field that is wrong."""
        if not isinstance(data, dict) or data.get("version") != OVERLAY_VERSION:
            raise ValueError(f"not a launch overlay of version {OVERLAY_VERSION}")
        hosts, launcher, address, env = (data.get(key) for key in
                                         ("hosts", "launcher_exec", "controller_ip", "environment"))
        if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) and h for h in hosts):
            raise ValueError(f"'hosts' must be a non-empty list of host names, got {hosts!r}")
        if not isinstance(launcher, str) or not os.path.isabs(launcher):
            raise ValueError(f"'launcher_exec' must be an absolute path, got {launcher!r}")
        try:
            ipaddress.ip_address(address if isinstance(address, str) else "")
        except ValueError:
            raise ValueError(f"'controller_ip' must be an IP address, got {address!r}") from None
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError(f"'environment' must map names to strings, got {env!r}")
        return cls(tuple(hosts), launcher, str(address), dict(env))


def default_state_dir() -> Path:
    """``$TACO_EMULATE_DIR``, else ``$XDG_STATE_HOME`` (default ``~/.local/state``) ``/taco-notebook/emulated``:
    the emulated nodes' state directory, where their launch overlay is published."""
    if os.environ.get("TACO_EMULATE_DIR"):
        return Path(os.environ["TACO_EMULATE_DIR"]).absolute()
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base, "taco-notebook", "emulated").absolute()


def write_launch_overlay(state_dir: Path, overlay: LaunchOverlay) -> Path:
    """Publish ``overlay`` as ``state_dir/launch-overlay.json`` (0600, atomically; the directory 0700)."""
    path = state_dir / OVERLAY_FILE
    write_private_json(path, overlay.to_json(), what="launch overlay's directory")
    return path


def read_launch_overlay(state_dir: Path | None = None) -> LaunchOverlay | None:
    """The overlay published in ``state_dir`` (default :func:`default_state_dir`), None when there is none;
    ProfileError when the file or its directory could be another user's, or the file is not an overlay."""
    state_dir = (state_dir or default_state_dir()).absolute()
    path = state_dir / OVERLAY_FILE
    if not os.path.lexists(path):
        return None
    fix = (f"if emulated nodes are up there, `python -m taco_notebook emulate down --state-dir {state_dir}` "
           "removes them; else remove the directory, or point TACO_EMULATE_DIR at a directory of your own")
    try:
        check_private_dir(state_dir, "emulated hosts' state directory", fix=fix)
        data = read_private_json(path, os.geteuid(), _MAX_BYTES)
    except UnsafeDirectoryError as exc:
        raise ProfileError(str(exc)) from None
    except FileNotFoundError:  # removed since we looked: the nodes went down
        return None
    except ValueError as exc:  # it names the file
        raise ProfileError(f"refusing a launch overlay: {exc}; {fix}") from None
    try:
        return LaunchOverlay.from_json(data)
    except ValueError as exc:
        raise ProfileError(f"refusing the launch overlay {path}: {exc}; {fix}") from None


def overlay_for(hosts: Iterable[str], state_dir: Path | None = None) -> LaunchOverlay | None:
    """The published overlay if it covers every one of ``hosts``, else None (see :func:`read_launch_overlay`)."""
    overlay = read_launch_overlay(state_dir)
    return overlay if overlay is not None and overlay.covers(hosts) else None
