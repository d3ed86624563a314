"""Where a cluster's engines run: the ``local``, ``hosts``, ``slurm`` and ``mpijob`` profiles (``--profile NAME``).

A :class:`Profile` says how the engines launch (the mpiexec arguments and environment ipyparallel's
``MPIEngineSetLauncher`` runs them with) and where the controller listens. No process management of its own:

* ``local`` (default): every rank on this machine, MPICH's gforker (or hydra) on one host, the controller on
  loopback, MPI kept off the network (``UCX_TLS=self,sm``, gloo on ``lo``).
* ``hosts``: ``--hosts n0:2,n1:2`` or ``--hostfile FILE`` (``HOST[:SLOTS]`` per line, ``#`` comments); mpich
  hydra starts the ranks over ssh (``-launcher ssh``, the user's ssh or ``launcher_exec``), ``SLOTS`` ranks per
  node in order, and ``-np`` must fit the slots. The controller listens on the address the hosts reach: the
  given ``controller_ip``, else for emulated hosts (``taco-notebook emulate up``, found through the
  launch overlay they publish, :mod:`.overlay`) the bridge's address, else this machine's address on the route
  to the first host. Never 0.0.0.0.
* ``slurm``: the engines are a Slurm job (sbatch outside an allocation, an srun step inside one), through
  :mod:`~taco_notebook.cluster.launch.slurm.launchers`; the controller listens on ``controller_ip``, else on the
  address this machine's name resolves to (where the job's nodes reach it). The job's partition, time limit,
  nodes, GPUs per node and queue timeout are a :class:`~.slurm.options.SlurmOptions` (``--partition``,
  ``--time``, … on the magics).
* ``mpijob``: a notebook in the launcher pod of a Kubeflow MPIJob attaches to the job's worker pods: the
  ``hosts`` profile over the hosts of the job's hostfile (:mod:`.hostfiles`), hydra over the ssh the operator
  set up, the controller on this pod's address on the route to the first worker.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from ...errors import MPINotFoundError
from .hostfiles import ProfileError, parse_hosts, read_hostfile, read_mpijob_hosts
from .mpi import MPIInfo, find_mpi, for_one_host
from .overlay import overlay_for
from .slurm.options import SlurmOptions

__all__ = ["Profile", "ProfileError", "PROFILES", "LOCAL", "parse_hosts", "read_hostfile", "hosts_profile",
           "profile_for", "route_address", "mpi_for", "mpijob_profile"]

PROFILES = ("local", "hosts", "slurm", "mpijob")


@dataclass(frozen=True)
class Profile:
    """How a cluster's engines launch. ``hosts``: ``(host, slots)`` in rank order (empty for ``local``)."""

    name: str = "local"
    hosts: tuple[tuple[str, int], ...] = ()
    launcher_exec: str | None = None  # stands in for ssh (hydra's -launcher-exec); None: ssh on PATH
    controller_ip: str = "127.0.0.1"
    environment: dict[str, str] = field(default_factory=dict)  # for mpiexec, which copies it to every rank
    slurm: SlurmOptions | None = None  # the slurm profile's job (engines through slurm_launchers)

    @property
    def single_host(self) -> bool:
        return self.name == "local"

    @property
    def slots(self) -> int:
        return sum(slots for _, slots in self.hosts)

    @property
    def hosts_string(self) -> str:
        return ",".join(f"{host}:{slots}" for host, slots in self.hosts)

    def check_size(self, size: int, option: str = "-np") -> None:
        """ProfileError when ``size`` ranks do not fit the hosts' slots."""
        if self.hosts and size > self.slots:
            raise ProfileError(f"{option} {size} does not fit the hosts' {self.slots} slots ({self.hosts_string}): "
                               f"use {option} {self.slots} or fewer, or give more hosts or slots")

    def mpiexec_args(self) -> list[str]:
        """hydra's arguments for this profile (none for ``local`` and ``slurm``)."""
        if self.single_host or self.slurm is not None:
            return []
        launcher = ["-launcher-exec", self.launcher_exec] if self.launcher_exec else []
        return ["-launcher", "ssh", *launcher, "-localhost", self.controller_ip, "-hosts", self.hosts_string]

    def ranks_per_node(self, size: int) -> int:
        """The most ranks any node runs (for the engines' thread count)."""
        return size if not self.hosts else min(size, max(slots for _, slots in self.hosts))


LOCAL = Profile()


def route_address(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP socket's source address; nothing is sent)."""
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            source = str(probe.getsockname()[0])
    except OSError as exc:
        raise ProfileError(f"cannot find this machine's address towards host {host!r} ({exc}): check the name, or "
                           f"set the controller's address (TacoMagics.controller_ip)") from None
    if ipaddress.ip_address(source).is_unspecified:
        raise ProfileError(f"no route to host {host!r}: set the controller's address (TacoMagics.controller_ip)")
    return source


def _checked(controller_ip: str) -> str:
    try:
        if not ipaddress.ip_address(controller_ip).is_unspecified:
            return controller_ip
    except ValueError:
        pass
    raise ProfileError(f"controller address {controller_ip!r} is not one address the hosts can reach: give "
                       f"this machine's address on their network (never 0.0.0.0)")


def hosts_profile(hosts: str | None = None, hostfile: str | None = None, launcher_exec: str | None = None,
                  controller_ip: str | None = None) -> Profile:
    """The ``hosts`` profile from a spec or a hostfile (exactly one of them)."""
    if (hosts is None) == (hostfile is None):
        raise ProfileError("--profile hosts needs --hosts HOST:SLOTS,… or --hostfile FILE (one of them)")
    parsed = parse_hosts(hosts) if hosts is not None else read_hostfile(str(hostfile))
    return _over_ssh("hosts", parsed, launcher_exec, controller_ip)


def _over_ssh(name: str, hosts: tuple[tuple[str, int], ...], launcher_exec: str | None,
              controller_ip: str | None) -> Profile:
    """A profile whose ranks hydra starts over ssh on ``hosts``; hosts with a published launch overlay (emulated
    nodes) bring their ssh stand-in, the address they reach us on and their environment."""
    overlay = overlay_for(host for host, _ in hosts)
    if overlay is not None:
        launcher_exec = launcher_exec or overlay.launcher_exec
        controller_ip = controller_ip or overlay.controller_ip
    controller_ip = _checked(controller_ip or route_address(hosts[0][0]))
    env = dict(overlay.environment) if overlay is not None else {}
    return Profile(name, hosts, launcher_exec, controller_ip, env)


def mpijob_profile(launcher_exec: str | None = None, controller_ip: str | None = None,
                   environ: Mapping[str, str] | None = None) -> Profile:
    """The ``mpijob`` profile: the ``hosts`` profile over the hosts of the MPIJob's hostfile (:mod:`.hostfiles`)."""
    return _over_ssh("mpijob", read_mpijob_hosts(environ), launcher_exec, controller_ip)


def profile_for(name: str | None, hosts: str | None = None, hostfile: str | None = None,
                launcher_exec: str | None = None, controller_ip: str | None = None,
                slurm: SlurmOptions | None = None) -> Profile:
    """The profile ``name`` (None: ``local``, or ``hosts`` when hosts are given) with its settings checked;
    ``slurm``: the slurm profile's job (None: Slurm's defaults), refused for the other profiles."""
    chosen = (name or ("hosts" if hosts or hostfile else "local")).strip().lower()
    if chosen not in PROFILES:
        raise ProfileError(f"--profile {name!r} is not a profile: choose one of {', '.join(PROFILES)}")
    if slurm is not None and chosen != "slurm":
        raise ProfileError(f"the Slurm job's options ({slurm.flags() or 'partition, time, ...'}) are for "
                           f"--profile slurm, not {chosen}")
    if chosen == "slurm":
        if hosts is not None or hostfile is not None:
            raise ProfileError("--hosts/--hostfile are for --profile hosts; Slurm chooses the slurm profile's nodes")
        return Profile("slurm", (), None, _checked(controller_ip or socket.gethostbyname(socket.gethostname())),
                       slurm=slurm or SlurmOptions())
    if chosen == "mpijob":
        if hosts is not None or hostfile is not None:
            raise ProfileError("--hosts/--hostfile are for --profile hosts; --profile mpijob takes the MPIJob's "
                               "hosts from its hostfile")
        return mpijob_profile(launcher_exec, controller_ip)
    if chosen == "local":
        if hosts is not None or hostfile is not None:
            raise ProfileError("--hosts/--hostfile need --profile hosts (the local profile runs on this machine)")
        return LOCAL
    return hosts_profile(hosts, hostfile, launcher_exec, controller_ip)


def mpi_for(profile: Profile, mpi: MPIInfo | None, mpiexec: str | None) -> MPIInfo:
    """The MPI a cluster of ``profile`` launches with (``mpi``: one already chosen, ``mpiexec``: the user's).

    ``local`` takes the one-host launcher (gforker); ``hosts`` and ``mpijob`` need mpich's hydra (its ssh
    launcher places the ranks), an MPINotFoundError otherwise; ``slurm`` uses only its mpi4py environment (srun
    starts the ranks).
    """
    explicit = mpiexec is not None  # --mpiexec PATH: exactly that program
    if profile.slurm is not None:
        return mpi or find_mpi(mpiexec)
    if profile.single_host:
        return for_one_host(mpi, explicit) if mpi else find_mpi(mpiexec, single_host=True)
    mpi = mpi if mpi is not None and mpi.launcher == "hydra" else find_mpi(mpiexec)
    if mpi.launcher != "hydra":
        raise MPINotFoundError(f"--profile {profile.name} starts ranks with mpich's hydra over ssh, but "
                               f"{mpi.description} is not hydra: pass --mpiexec PATH/TO/mpich/mpiexec")
    return mpi
