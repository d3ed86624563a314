"""A multi-node cluster emulated on one Linux machine: network namespaces, a bridge and rate-limited links.

Each emulated node is a network namespace holding one end of a veth pair; the other ends join a bridge in
the root namespace. Every node's link is shaped with ``tc`` htb in both directions (a tbf with a small burst
chokes on the 64 KiB packets veth passes), so traffic between nodes crosses real sockets at a real bandwidth
limit, while ranks on the same node talk over loopback. For tests and benchmarks of multi-node code (root).

MPI ranks are placed on the nodes by mpich's hydra with :mod:`taco_notebook.emulate.netns_launch` as its ssh::

    with EmulatedNodes(2, rate="1gbit") as cluster:
        subprocess.run(["mpiexec", *cluster.mpiexec_args(2), "-n", "4", "python", "train.py"],
                       env=cluster.mpiexec_env(), check=True)

Only private addresses inside the namespaces created here are used; the bridge has no route to anywhere else.
:mod:`taco_notebook.emulate.saved` saves and loads a set so it can outlive its maker: ``python -m taco_notebook
emulate`` (:mod:`taco_notebook.emulate.hosts`) runs a real sshd on each node that way.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from . import netns_launch

__all__ = ["EmulatedNodes", "parse_rate", "REQUIRED_TOOLS"]

REQUIRED_TOOLS = ("ip", "tc", "unshare", "hostname")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_ETC_NETNS = Path("/etc/netns")
_MIN_BURST_BYTES = 128 * 1024  # two of the largest (64 KiB GSO) packets veth hands to the qdisc


def parse_rate(rate: str | int) -> int:
    """A ``tc``-style rate (``"1gbit"``, ``"100mbit"``, ``"125mbps"`` = bytes/s) or an int, in bits/s.

    >>> parse_rate("1gbit"), parse_rate("2mbps")
    (1000000000, 16000000)
    """
    if isinstance(rate, int):
        bits = rate
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)\s*", rate.lower())
        if not match:
            raise ValueError(f"rate must look like '1gbit', '100mbit' or '125mbps', got {rate!r}")
        number, prefix, unit = match.groups()
        bits = int(float(number) * _UNITS[prefix] * (8 if unit == "bps" else 1))
    if bits <= 0:
        raise ValueError(f"rate must be positive, got {rate!r}")
    return bits


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", *args], check=check)


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{shlex.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network on an interface or in a route of the root namespace."""
    text = _ip("-4", "-o", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    nets = []
    for word in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?\b", text):
        try:
            nets.append(ipaddress.IPv4Network(word, strict=False))
        except ValueError:
            continue
    return nets


def _pick_subnet() -> ipaddress.IPv4Network:
    """A random free 10.213.X.0/24 (a corner of 10/8 that clusters and VPNs rarely use)."""
    used = _networks_in_use()
    candidates = list(range(1, 255))
    random.shuffle(candidates)
    for third in candidates:
        net = ipaddress.IPv4Network(f"10.213.{third}.0/24")
        if not any(net.overlaps(other) for other in used):
            return net
    raise RuntimeError("every 10.213.X.0/24 is in use; pass subnet= explicitly")


class EmulatedNodes:
    """N emulated nodes (network namespaces) on one bridge, each link shaped to ``rate`` in both directions.

    A context manager, or call :meth:`start` / :meth:`stop`. ``rate=None`` leaves the links unshaped (the
    baseline to compare against). Node host names are ``n0``, ``n1``, ...; the namespaces, veths and bridge
    carry a random per-instance prefix (``taco-<random>-n0``), so several instances can coexist.
    """

    def __init__(self, num_nodes: int = 2, rate: str | int | None = "1gbit", *, interface: str = "taco0",
                 subnet: str | None = None, workdir: str | os.PathLike[str] | None = None) -> None:
        net = ipaddress.IPv4Network(subnet) if subnet else None
        if not 1 <= num_nodes <= 253 or (net is not None and net.num_addresses - 2 < num_nodes + 1):
            raise ValueError(f"num_nodes must be 1..253 and fit the subnet with the bridge, got {num_nodes}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,15}", interface):
            raise ValueError(f"interface must be a valid Linux interface name, got {interface!r}")
        self.rate_bits_per_s: int | None = None if rate is None else parse_rate(rate)
        self.interface = interface
        self.prefix = f"taco-{random.getrandbits(20):05x}"
        self.bridge = f"{self.prefix}-br"
        self._num_nodes = num_nodes
        self._requested_subnet = net
        self._subnet: ipaddress.IPv4Network | None = None
        self._workdir: Path | None = None
        self._requested_workdir = None if workdir is None else Path(workdir).absolute()
        self._started = False
        self._made: list[tuple[str, str]] = []  # ("link" | "netns", name) in creation order, to undo

    # ---- what the cluster looks like -------------------------------------------------------------------
    @property
    def nodes(self) -> list[str]:
        """Host names of the nodes, as given to ``mpiexec -hosts``."""
        return [f"n{i}" for i in range(self._num_nodes)]

    def _index(self, host: str) -> int:
        if host not in self.nodes:
            raise KeyError(f"unknown emulated host {host!r}: this cluster has {', '.join(self.nodes)}")
        return self.nodes.index(host)

    def namespace_of(self, host: str) -> str:
        """The network namespace that stands for ``host`` (for ``ip netns exec``)."""
        self._index(host)
        return f"{self.prefix}-{host}"

    def _veth_of(self, host: str) -> str:
        return f"{self.prefix}-h{self._index(host)}"

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        if self._subnet is None:
            raise RuntimeError("the emulated cluster is not started: no subnet chosen yet")
        return self._subnet

    def address_of(self, host: str) -> str:
        """The node's IPv4 address on its interface (``.1`` for n0, ``.2`` for n1, …)."""
        return str(self.subnet.network_address + 1 + self._index(host))

    @property
    def bridge_address(self) -> str:
        """The root namespace's address on the bridge: where the nodes reach mpiexec's control port."""
        return str(self.subnet.broadcast_address - 1)

    # ---- launching ranks -------------------------------------------------------------------------------
    @property
    def launcher(self) -> str:
        """The ssh stand-in script that hydra runs (``-launcher-exec``)."""
        if self._workdir is None:
            raise RuntimeError("the emulated cluster is not started")
        return str(self._workdir / "ssh")

    @property
    def map_file(self) -> str:
        if self._workdir is None:
            raise RuntimeError("the emulated cluster is not started")
        return str(self._workdir / "nodes.json")

    def mpiexec_args(self, ranks_per_node: int | Sequence[int]) -> list[str]:
        """mpich hydra arguments placing ``ranks_per_node`` ranks on each node (or one count per node).

        ``-localhost`` makes the proxies in the namespaces call back to mpiexec over the bridge address.
        """
        n = self._num_nodes
        counts = [ranks_per_node] * n if isinstance(ranks_per_node, int) else list(ranks_per_node)
        if len(counts) != n or any(c < 1 for c in counts):
            raise ValueError(f"need a positive rank count for each of the {n} nodes, got {counts}")
        hosts = ",".join(f"{host}:{count}" for host, count in zip(self.nodes, counts, strict=True))
        return ["-launcher", "ssh", "-launcher-exec", self.launcher, "-localhost", self.bridge_address,
                "-hosts", hosts]

    def launcher_env(self) -> dict[str, str]:
        """Environment variables mpiexec's launch needs on top of the caller's.

        UCX (mpich's default netmod) would see one machine and move inter-node MPI traffic through shared
        memory, bypassing the shaped link: it is limited to TCP on the node interface.
        """
        return {netns_launch.MAP_ENV: self.map_file, "GLOO_SOCKET_IFNAME": self.interface,
                "UCX_TLS": "self,tcp", "UCX_NET_DEVICES": self.interface}

    def mpiexec_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default ``os.environ``) plus :meth:`launcher_env`, without per-node identity variables.

        hydra copies mpiexec's environment over each node's, so a ``TACO_NODE_NAME`` or ``HOSTNAME`` there
        would give every node the same name.
        """
        env = dict(os.environ if base is None else base)
        for key in ("TACO_NODE_NAME", "HOSTNAME"):
            env.pop(key, None)
        env.update(self.launcher_env())
        return env

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def __enter__(self) -> EmulatedNodes:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> EmulatedNodes:
        """Create the namespaces, bridge, veths and shaping; on any failure undo what was made and raise."""
        if self._started:
            return self
        _check_prerequisites()
        self._started = True
        atexit.register(self.stop)
        try:
            self._subnet = self._requested_subnet or _pick_subnet()
            self._workdir = self._make_workdir()
            self._create_bridge()
            for host in self.nodes:
                self._create_node(host)
            self._write_launcher()
        except BaseException:
            self.stop()
            raise
        return self

    def _make_workdir(self) -> Path:
        """A new private (0700) directory for the launcher and map: ``workdir=`` if given, else a temporary one."""
        if self._requested_workdir is None:
            return Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        os.mkdir(self._requested_workdir, 0o700)  # FileExistsError: never take over an existing directory
        return self._requested_workdir

    def _create_bridge(self) -> None:
        prefixlen = self.subnet.prefixlen
        if any(self.subnet.overlaps(other) for other in _networks_in_use()):
            raise RuntimeError(f"subnet {self.subnet} is already in use here; pass another subnet=")
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("addr", "add", f"{self.bridge_address}/{prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def _create_node(self, host: str) -> None:
        ns, veth, ifname = self.namespace_of(host), self._veth_of(host), self.interface
        _ip("netns", "add", ns)
        self._made.append(("netns", ns))
        self._write_hosts_file(ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", ifname, "netns", ns)
        self._made.append(("link", veth))
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{self.address_of(host)}/{self.subnet.prefixlen}", "dev", ifname)
        _ip("-n", ns, "link", "set", ifname, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        if self.rate_bits_per_s is not None:
            self._shape([], veth)  # traffic into the node
            self._shape(["-n", ns], ifname)  # traffic out of the node

    def _write_hosts_file(self, namespace: str) -> None:
        """Write ``/etc/netns/NS/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``.

        Node names resolve, and addresses resolve back (c10d's store does that), as on a real cluster.
        """
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        for host in self.nodes:  # the v4-mapped form is how a dual-stack listener sees its peers
            lines += [f"{self.address_of(host)} {host}", f"::ffff:{self.address_of(host)} {host}"]
        directory = _ETC_NETNS / namespace
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "hosts").write_text("\n".join(lines) + "\n", encoding="utf-8")

    def _shape(self, netns: list[str], dev: str) -> None:
        """One htb class at the link rate; its burst covers at least two 64 KiB GSO packets."""
        assert self.rate_bits_per_s is not None
        rate = f"{self.rate_bits_per_s}bit"
        burst = str(max(_MIN_BURST_BYTES, self.rate_bits_per_s // 8 // 1000))  # >= 1 ms at line rate
        _run(["tc", *netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"])
        _run(["tc", *netns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate,
              "ceil", rate, "burst", burst, "cburst", burst, "quantum", "65536"])

    def _write_launcher(self) -> None:
        mapping = {"interface": self.interface, "env": {k: v for k, v in self.launcher_env().items()
                                                         if k.startswith("UCX_")},
                   "hosts": {host: self.namespace_of(host) for host in self.nodes}}
        _write_new(self.map_file, json.dumps(mapping, indent=1), 0o600)
        _write_new(self.launcher,
                   "#!/bin/sh\n# ssh stand-in for mpich hydra: runs the command in an emulated node's namespace\n"
                   f"export {netns_launch.MAP_ENV}={shlex.quote(self.map_file)}\n"
                   f"exec {shlex.quote(sys.executable)} {shlex.quote(netns_launch.__file__)} \"$@\"\n", 0o700)

    def stop(self) -> None:
        """Kill what still runs in our namespaces; delete the namespaces, veths and bridge made. Idempotent.

        Only what this instance created is touched (veths go before their namespaces: a namespace that a
        process still pins would otherwise keep its veth alive).
        """
        if not self._started:
            return
        self._started = False
        atexit.unregister(self.stop)
        errors = []
        for kind, name in self._made:
            if kind == "netns":
                _kill_namespace_processes(name)
        while self._made:
            kind, name = self._made.pop()
            result = _ip(kind, "del", name, check=False)
            missing = re.search(r"(Cannot find device|No such file|does not exist)", result.stderr)
            if result.returncode != 0 and not missing:
                errors.append(f"ip {kind} del {name}: {result.stderr.strip()}")
            if kind == "netns":
                shutil.rmtree(_ETC_NETNS / name, ignore_errors=True)
        try:
            _ETC_NETNS.rmdir()  # only when empty: other namespaces' files stay
        except OSError:
            pass
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        if errors:
            raise RuntimeError("could not remove all of the emulated cluster: " + "; ".join(errors))

    @property
    def made(self) -> list[tuple[str, str]]:
        """What :meth:`start` created and :meth:`stop` removes: ``("link" | "netns", name)`` in creation order."""
        return list(self._made)

    def detach(self) -> None:
        """Let this started set outlive this process (no stop at exit): its state was saved (see
        :mod:`~taco_notebook.emulate.saved`), and whoever loads it calls :meth:`stop`."""
        atexit.unregister(self.stop)

    @classmethod
    def restore(cls, num_nodes: int, rate: int | None, interface: str, *, prefix: str,
                subnet: ipaddress.IPv4Network, workdir: Path, made: list[tuple[str, str]]) -> EmulatedNodes:
        """A started set rebuilt from saved state (checked by the caller); not stopped when this process exits."""
        nodes = cls(num_nodes, rate=rate, interface=interface, subnet=str(subnet))
        nodes.prefix, nodes.bridge = prefix, f"{prefix}-br"
        nodes._subnet, nodes._workdir, nodes._made = subnet, workdir, list(made)
        nodes._started = True
        return nodes

    def __repr__(self) -> str:
        rate = "unlimited" if self.rate_bits_per_s is None else f"{self.rate_bits_per_s / 1e9:g} Gbit/s"
        state = f"subnet {self._subnet}" if self._started else "stopped"
        return f"<EmulatedNodes {self.prefix}: {self._num_nodes} nodes, {rate}, {state}>"


def _write_new(path: str, text: str, mode: int) -> None:
    """Create ``path`` with ``mode`` from the start (private to this user: never chmod-ed after)."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode), "w") as f:
        f.write(text)


def _check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise PermissionError(f"emulated nodes need root to create network namespaces (running as uid "
                              f"{os.geteuid()}); run as root")
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"emulated nodes need {', '.join(missing)} on PATH "
                           "(packages iproute2, util-linux, hostname)")


def _kill_namespace_processes(namespace: str, grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL, whatever still runs in ``namespace``: it would keep the namespace alive."""
    def pids() -> list[int]:
        result = _ip("netns", "pids", namespace, check=False)
        return [int(p) for p in result.stdout.split() if p.isdigit() and int(p) != os.getpid()]

    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = pids()
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids() and time.monotonic() < deadline:
            time.sleep(0.05)
