"""Emulated nodes as real ssh hosts that outlive the process that made them (``python -m taco_notebook emulate``).

:class:`EmulatedHosts` is an :class:`~taco_notebook.emulate.nodes.EmulatedNodes` set (network namespaces on a
shaped bridge) with a real ``sshd`` on every node (:mod:`~taco_notebook.emulate.sshd`), all of it recorded in one
private state directory (0700, files 0600) so that ``status`` and ``down`` find it again from other processes::

    STATE/nodes.json            the namespaces, links, subnet (saved.save_nodes)
    STATE/hosts.json            slots per node, each sshd's pid and start time
    STATE/launch-overlay.json   what ``--hosts n0:2,…`` needs, once ssh works (cluster/launch/overlay.py)
    STATE/netns/                EmulatedNodes' work directory
    STATE/ssh/config            ssh -F STATE/ssh/config n0 hostname   (prints n0)
    STATE/ssh/ssh-launcher      `ssh -F STATE/ssh/config "$@"`, for mpich's -launcher-exec
    STATE/ssh/id_ed25519[.pub], authorized_keys, known_hosts
    STATE/nodes/n0/ssh_host_ed25519_key[.pub], sshd_config, sshd.log

The default state directory is ``$TACO_EMULATE_DIR``, else ``$XDG_STATE_HOME/taco-notebook/emulated`` (or
``~/.local/state/…``; :func:`~taco_notebook.cluster.launch.overlay.default_state_dir`). Its parents must be
writable only by root or you: sshd's ``StrictModes`` refuses an ``authorized_keys`` below a world-writable
directory such as ``/tmp``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cluster.launch.overlay import OVERLAY_FILE, LaunchOverlay, default_state_dir, write_launch_overlay
from ..private import make_private_dirs, read_private_json, write_private_json
from .nodes import REQUIRED_TOOLS, EmulatedNodes
from .saved import load_nodes, save_nodes
from .sshd import (
    SSH_TOOLS,
    SshdProcess,
    client_config,
    ensure_privsep_dir,
    find_sshd,
    generate_key,
    known_hosts,
    remove_privsep_dir,
    sshd_config,
    start_sshd,
    stop_sshd,
    write_private_text,
)

__all__ = ["EmulatedHosts", "EmulateError", "NodeStatus", "default_state_dir", "check_prerequisites", "down"]

_TOOL_PACKAGES = {"ip": "iproute2", "tc": "iproute2", "unshare": "util-linux", "hostname": "hostname", **SSH_TOOLS}
_HOSTS_FILE, _NODES_FILE = "hosts.json", "nodes.json"


class EmulateError(Exception):
    """A problem the user can fix; ``exit_code`` is what the command line exits with (2: can't run here)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class NodeStatus:
    """One node as ``status`` sees it."""

    host: str
    address: str
    namespace: str
    namespace_exists: bool
    sshd_pid: int | None
    sshd_alive: bool

    @property
    def healthy(self) -> bool:
        return self.namespace_exists and self.sshd_alive


def check_prerequisites() -> str:
    """The path of ``sshd`` if this process can make emulated hosts; else EmulateError (exit code 2) naming
    what is missing and how to get it."""
    if os.geteuid() != 0:
        raise EmulateError(f"emulated nodes need root to create network namespaces (running as uid {os.geteuid()});"
                           " run it as root, e.g. `sudo python -m taco_notebook emulate up 2x2`", 2)
    missing = {tool: _TOOL_PACKAGES[tool] for tool in (*REQUIRED_TOOLS, *SSH_TOOLS)
               if (find_sshd() if tool == "sshd" else shutil.which(tool)) is None}
    if missing:
        packages = " ".join(sorted(set(missing.values())))
        raise EmulateError(f"emulated nodes need {', '.join(missing)}, not found on PATH; install them with "
                           f"`apt-get install -y {packages}` (Debian/Ubuntu package names)", 2)
    sshd = find_sshd()
    assert sshd is not None
    return sshd


def _missing_parents(directory: Path) -> list[Path]:
    """The ancestors of ``directory`` that do not exist yet, outermost first."""
    return [p for p in reversed(directory.parents) if not os.path.lexists(p)]


def _check_sshd_trusts(directory: Path) -> None:
    """sshd's StrictModes refuses keys below a directory someone else may write: say so before making anything."""
    me = os.geteuid()
    for parent in [directory, *directory.parents]:
        if not os.path.lexists(parent):
            continue  # made 0700 by us
        info = os.stat(parent)
        if info.st_uid not in (0, me) or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise EmulateError(f"cannot keep emulated nodes' keys below {parent} (mode {stat.filemode(info.st_mode)}"
                               f", uid {info.st_uid}): sshd refuses keys below a directory others may write; "
                               "choose a --state-dir (or TACO_EMULATE_DIR) under your home directory", 2)


class EmulatedHosts:
    """Started emulated nodes with an sshd each, as hosts ``n0``… for ``--hosts n0:SLOTS,…``.

    Made by :meth:`up`, found again by :meth:`load`, removed by :meth:`remove` (or :func:`down`); in-process
    it is also a context manager: ``with EmulatedHosts.up(2, 2, "1gbit", state_dir) as hosts: …``.
    """

    def __init__(self, state_dir: Path, nodes: EmulatedNodes, slots: int,
                 sshd: Mapping[str, SshdProcess] | None = None, made_parents: list[Path] | None = None) -> None:
        self.state_dir = state_dir
        self.nodes = nodes
        self.slots = slots
        self.sshd: dict[str, SshdProcess] = dict(sshd or {})
        self.made_parents = list(made_parents or [])  # directories above state_dir that up made: down removes them
        self.made_privsep_dir = False  # /run/sshd made by up: down removes it when no sshd is left

    def __enter__(self) -> EmulatedHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ---- where things are ---------------------------------------------------------------------------------
    @property
    def ssh_config(self) -> Path:
        """The ssh client config: ``ssh -F <this> n0 hostname``."""
        return self.state_dir / "ssh" / "config"

    @property
    def launcher(self) -> Path:
        """A script that runs ``ssh -F <config> "$@"``: mpich hydra's ``-launcher-exec``."""
        return self.state_dir / "ssh" / "ssh-launcher"

    def sshd_config_of(self, host: str) -> Path:
        return self.state_dir / "nodes" / host / "sshd_config"

    @property
    def hosts_string(self) -> str:
        """``n0:2,n1:2``: every node with its slots, for ``mpiexec -hosts`` or ``--profile hosts --hosts``."""
        return ",".join(f"{host}:{self.slots}" for host in self.nodes.nodes)

    def mpiexec_args(self) -> list[str]:
        """mpich hydra arguments that start ranks over real ssh, ``slots`` on each node.

        ``-localhost`` is the root namespace's bridge address, where the nodes reach mpiexec's control port.
        """
        return ["-launcher", "ssh", "-launcher-exec", str(self.launcher), "-localhost", self.nodes.bridge_address,
                "-hosts", self.hosts_string]

    def mpiexec_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default ``os.environ``) for ``mpiexec``: hydra copies it to every rank, so it carries the
        node interface for gloo and TCP-only UCX, and no per-node identity (``HOSTNAME``, ``TACO_NODE_NAME``)."""
        env = dict(os.environ if base is None else base)
        for key in ("TACO_NODE_NAME", "HOSTNAME", "TACO_NETNS_MAP"):
            env.pop(key, None)
        env.update(self._node_env())
        return env

    def launch_overlay(self) -> LaunchOverlay:
        """What a ``hosts`` profile over these nodes needs, published as data so that production code finds the
        nodes without importing the emulator: the ssh stand-in, the bridge address and the node environment."""
        return LaunchOverlay(tuple(self.nodes.nodes), str(self.launcher), self.nodes.bridge_address, self._node_env())

    def _node_env(self) -> dict[str, str]:
        """What every session on a node needs so traffic between nodes uses the shaped link."""
        return {"GLOO_SOCKET_IFNAME": self.nodes.interface, "UCX_TLS": "self,tcp",
                "UCX_NET_DEVICES": self.nodes.interface}

    # ---- up ---------------------------------------------------------------------------------------------------
    @classmethod
    def up(cls, num_nodes: int, slots: int, rate: str | int | None, state_dir: Path | None = None,
           interface: str = "taco0") -> EmulatedHosts:
        """Create the nodes, start and check their sshd; on any failure remove everything made and raise."""
        sshd = check_prerequisites()
        state_dir = (state_dir or default_state_dir()).absolute()
        if os.path.lexists(state_dir):
            raise EmulateError(f"emulated nodes are already up (state in {state_dir}): "
                               "`python -m taco_notebook emulate status` shows them, `… down` removes them")
        _check_sshd_trusts(state_dir.parent)
        made_parents = _missing_parents(state_dir)
        make_private_dirs(state_dir.parent)
        try:
            os.mkdir(state_dir, 0o700)
        except FileExistsError:  # another `up` got there first
            raise EmulateError(f"emulated nodes are already up (state in {state_dir})") from None
        nodes = EmulatedNodes(num_nodes, rate=rate, interface=interface, workdir=state_dir / "netns")
        hosts = cls(state_dir, nodes, slots, made_parents=made_parents)
        try:
            nodes.start()
            save_nodes(nodes, state_dir / _NODES_FILE)  # from here on `down` can undo it, even if this process dies
            hosts._save()
            hosts._write_keys_and_configs()
            hosts.made_privsep_dir = ensure_privsep_dir()
            for host in nodes.nodes:
                hosts._start_sshd(sshd, host)
            hosts._check_ssh()
            write_launch_overlay(state_dir, hosts.launch_overlay())  # profiles find the hosts from here on
        except BaseException:
            hosts.remove()
            raise
        return hosts

    def _write_keys_and_configs(self) -> None:
        ssh_dir, nodes = self.state_dir / "ssh", self.nodes
        make_private_dirs(ssh_dir)
        user = pwd.getpwuid(os.getuid()).pw_name
        identity = ssh_dir / "id_ed25519"
        write_private_text(ssh_dir / "authorized_keys", generate_key(identity, f"taco-emulate {user}") + "\n")
        host_keys = {}
        for host in nodes.nodes:
            node_dir = make_private_dirs(self.state_dir / "nodes" / host)
            host_key = node_dir / "ssh_host_ed25519_key"
            host_keys[host] = (nodes.address_of(host), generate_key(host_key, f"taco-emulate {host}"))
            write_private_text(self.sshd_config_of(host), sshd_config(
                nodes.address_of(host), host_key, ssh_dir / "authorized_keys", user, self._node_env()))
        write_private_text(ssh_dir / "known_hosts", known_hosts(host_keys))
        addresses = {host: nodes.address_of(host) for host in nodes.nodes}
        write_private_text(self.ssh_config, client_config(addresses, user, identity, ssh_dir / "known_hosts"))
        ssh = shutil.which("ssh")
        write_private_text(self.launcher, "#!/bin/sh\n# ssh to emulated nodes, for mpiexec -launcher-exec\n"
                           f"exec {ssh} -F '{self.ssh_config}' \"$@\"\n", mode=0o700)

    def _start_sshd(self, sshd: str, host: str) -> None:
        log = self.state_dir / "nodes" / host / "sshd.log"
        self.sshd[host] = start_sshd(sshd, self.nodes.namespace_of(host), host, self.nodes.address_of(host),
                                     self.sshd_config_of(host), log)
        self._save()

    def _check_ssh(self) -> None:
        """Every node answers ``ssh HOST hostname`` with its own name: keys, config and identity all work."""
        runs = {host: subprocess.Popen(["ssh", "-F", str(self.ssh_config), host, "hostname"], text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
                for host in self.nodes.nodes}
        for host, run in runs.items():
            try:
                out, err = run.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                run.kill()
                out, err = run.communicate()
            if run.returncode != 0 or out.strip() != host:
                raise RuntimeError(f"ssh to emulated node {host} failed (exit {run.returncode}): "
                                   f"{(err or out).strip() or 'no output'}")

    def _save(self) -> None:
        write_private_json(self.state_dir / _HOSTS_FILE, {
            "version": 1, "slots": self.slots, "made_parents": [str(p) for p in self.made_parents],
            "made_privsep_dir": self.made_privsep_dir,
            "sshd": {h: {"pid": p.pid, "create_time": p.create_time} for h, p in self.sshd.items()}},
            what="emulated nodes' state directory")

    # ---- found again ----------------------------------------------------------------------------------------
    @classmethod
    def load(cls, state_dir: Path | None = None) -> EmulatedHosts | None:
        """The hosts recorded in ``state_dir``, or None if nothing is up there; ValueError for a damaged state."""
        state_dir = (state_dir or default_state_dir()).absolute()
        if not state_dir.exists():
            return None
        nodes = load_nodes(state_dir / _NODES_FILE)
        data: Any = read_private_json(state_dir / _HOSTS_FILE, os.geteuid(), 1 << 20)
        try:
            sshd = {str(h): SshdProcess(int(p["pid"]), float(p["create_time"])) for h, p in data["sshd"].items()}
            made_parents = [Path(p) for p in data["made_parents"] if state_dir.is_relative_to(p)]
            hosts = cls(state_dir, nodes, int(data["slots"]), sshd, made_parents)
            hosts.made_privsep_dir = bool(data["made_privsep_dir"])
            return hosts
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{state_dir / _HOSTS_FILE}: not a state file of emulated hosts ({err})") from None

    def status(self) -> list[NodeStatus]:
        """Each node: its namespace still there? its sshd still the one we started?"""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split()
        rows = []
        for host in self.nodes.nodes:
            record = self.sshd.get(host)
            alive = record is not None and record.proven(self.sshd_config_of(host)) is not None
            rows.append(NodeStatus(host, self.nodes.address_of(host), self.nodes.namespace_of(host),
                                   self.nodes.namespace_of(host) in listed, record.pid if record else None, alive))
        return rows

    # ---- down -------------------------------------------------------------------------------------------------
    def remove(self) -> None:
        """Stop our sshds (proven by pid and start time), then the nodes (what else runs in them, links,
        namespaces, /etc/netns files), then delete the state directory with its keys."""
        try:
            (self.state_dir / OVERLAY_FILE).unlink(missing_ok=True)  # first: no new cluster picks the nodes up
            stop_sshd({record: self.sshd_config_of(host) for host, record in self.sshd.items()})
            self.nodes.stop()
        finally:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            if self.made_privsep_dir:
                remove_privsep_dir()
            for parent in reversed(self.made_parents):
                try:
                    parent.rmdir()  # only when empty
                except OSError:
                    break


def down(state_dir: Path | None = None) -> EmulatedHosts | None:
    """Remove every trace of the emulated hosts recorded in ``state_dir``; None if there were none. Idempotent.

    A state directory left half-made (``up`` killed before it recorded anything) is removed too.
    """
    state_dir = (state_dir or default_state_dir()).absolute()
    if not state_dir.exists():
        return None
    if not (state_dir / _NODES_FILE).exists():
        if os.stat(state_dir).st_uid != os.geteuid():
            raise EmulateError(f"{state_dir} is not yours: not removing it")
        shutil.rmtree(state_dir)
        return None
    hosts = EmulatedHosts.load(state_dir) if (state_dir / _HOSTS_FILE).exists() else None
    if hosts is None:
        hosts = EmulatedHosts(state_dir, load_nodes(state_dir / _NODES_FILE), 0)
    hosts.remove()
    return hosts
