"""Which cluster a magic runs on: the running one when it fits, one started from the sidebar (attached), or a
new one started here with the chosen profile, MPI and environment; and the checks made right after a start
(huge pages). The policy shared by the magics and the command line, which parse their options and call these;
a user's mistake is an :class:`~taco_notebook.errors.OptionError`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from ..cluster.launch.mpi import LAUNCHER_ENV, MPIInfo, find_mpi, for_one_host
from ..cluster.launch.profiles import LOCAL, Profile, profile_for
from ..cluster.launch.slurm.options import SlurmOptions
from ..cluster.registry.writer import track
from ..cluster.session import TacoCluster, clusters
from ..comm.group.placement import check_gpus
from ..comm.specs import shm_from_env, timeout_from_env
from ..errors import ClusterStartError, MPINotFoundError, OptionError
from .gpus import sharing_line
from .output import RankOutput
from .resolve import DEFAULT_NP, cluster_size, option_errors
from .settings import CLUSTER_ENV, SLURM_SETTINGS, TacoSettings

__all__ = ["LOST", "chosen_profile", "slurm_options", "profile_change", "check_reachable",
           "start_cluster", "ensure_cluster", "restart_reason", "check_hugepages",
           "format_status", "shared_size", "cluster_gpu_mode"]

START_WAIT_S = 150.0  # how long a cell waits for a cluster the sidebar is starting (its start timeout is 120 s)
LOST = "the engines' variables are lost"  # said whenever a cluster is restarted under the user's feet


def mpi_for_launcher(mpiexec: str | None, launcher: str | None) -> MPIInfo:
    """The MPI for a cluster on this host; ``launcher`` (``--mpi-launcher`` or its trait) in place of
    ``TACO_MPI_LAUNCHER`` when given."""
    if launcher is None:
        return find_mpi(mpiexec, single_host=True)
    return for_one_host(find_mpi(mpiexec), explicit=mpiexec is not None, environ={LAUNCHER_ENV: launcher})


def slurm_options(config: TacoSettings, args: Any, profile: str | None) -> SlurmOptions | None:
    """The slurm profile's job from ``--partition/--time/--nodes/--gpus-per-node/--queue-timeout`` (else their
    traits), checked; None for another profile, where any of these options is a OptionError naming it."""
    if (profile or "").strip().lower() != "slurm":
        for name in SLURM_SETTINGS:
            if getattr(args, name, None) is not None:
                flag = "--" + name.replace("_", "-")
                raise OptionError(f"{flag} is for --profile slurm (the Slurm job's options), but this cluster's "
                                 f"profile is {profile or 'local'}: add --profile slurm, or leave {flag} out")
        return None
    chosen = {name: config.chosen(name, getattr(args, name, None), "--" + name.replace("_", "-"))
              for name in SLURM_SETTINGS}
    return SlurmOptions(**{name: value for name, value in chosen.items() if value is not None})


def chosen_profile(config: TacoSettings, args: Any, size: int) -> Profile:
    """``--profile/--hosts/--hostfile`` (else their traits) as a checked :class:`Profile` that fits ``size`` ranks.
    ``--hosts``/``--hostfile`` replace both traits; another ``--profile`` than hosts ignores the hosts traits; the slurm
    profile's job comes from :func:`slurm_options`."""
    with option_errors():
        name = config.chosen("profile", args.profile, "--profile")
        if args.hosts is not None or args.hostfile is not None:
            hosts = config.chosen("hosts", args.hosts, "--hosts") if args.hosts is not None else None
            hostfile = args.hostfile
        elif args.profile in ("local", "slurm", "mpijob"):  # the hosts traits are the hosts profile's
            hosts = hostfile = None
        else:
            hosts, hostfile = config.hosts, config.hostfile
        slurm = slurm_options(config, args, name or ("hosts" if hosts or hostfile else None))
        profile = profile_for(name, hosts, hostfile, controller_ip=config.controller_ip, slurm=slurm)
        profile.check_size(size)
    return profile


def check_reachable(profile: Profile) -> None:
    """A ClusterStartError naming the hosts of ``profile`` that ssh cannot reach, before anything starts: hydra
    names only an address, and the ranks it already started on the other hosts die without cleaning up."""
    from ..cluster.launch.sshcheck import unreachable_hosts

    failed = unreachable_hosts(profile) if profile.hosts and profile.slurm is None else {}
    if failed:
        named = "; ".join(f"host {host}: {why}" for host, why in failed.items())
        raise ClusterStartError(f"cannot reach {', '.join(failed)} over ssh ({named}): check that the host is up "
                                f"and that `ssh {next(iter(failed))} true` works without a prompt; nothing was "
                                f"started")


def start_cluster(name: str, size: int, mpiexec: str | None, say: RankOutput, env: Mapping[str, str] | None = None,
           launcher: str | None = None, limit: int | None = None, profile: Profile = LOCAL) -> TacoCluster:
    cluster_size(str(size), "-np", limit)  # the limit, once more where every start goes through
    check_reachable(profile)  # names the host ssh cannot reach: hydra names only an address, and leaves segments
    try:
        mpi = mpi_for_launcher(mpiexec, launcher) if profile.single_host else find_mpi(mpiexec)
    except MPINotFoundError as exc:
        raise OptionError(str(exc)) from None
    # TacoCluster.start() picks the one-host launcher again from TACO_MPI_LAUNCHER unless its mpiexec was named:
    # a launcher chosen here names the program it resolved to (gforker is kept as it is)
    chosen = mpi.mpiexec if launcher is not None and mpi.launcher == "hydra" else mpiexec
    cluster = TacoCluster(name, size, mpiexec=chosen, env=dict(env or {}), profile=profile, mpi=mpi,
                          progress=say.notice)  # the slurm profile's job id and queue state go to progress
    track(cluster)  # the sidebar lists it
    say.notice(f"starting cluster {name!r}: {size} ranks with {mpi.description}…")
    began = time.monotonic()
    cluster.start()
    clusters[name] = cluster
    hosts = ", ".join(sorted({r.host for r in cluster.ranks}))
    say.notice(f"cluster {name!r} ready in {time.monotonic() - began:.1f} s: {size} ranks on {hosts}")
    sharing = sharing_line(cluster_gpu_mode(cluster), cluster.ranks)  # once per start: the ranks cannot say it
    if sharing is not None:
        say.notice(sharing)
    return cluster


def cluster_gpu_mode(cluster: TacoCluster) -> str:
    """The ``--gpus`` mode ``cluster``'s engines placed themselves with: its environment's, else what they read
    from the kernel's (``TACO_GPUS``, else auto), as :func:`~taco_notebook.comm.group.placement.gpu_mode` reads it."""
    return check_gpus(cluster.env.get(CLUSTER_ENV["gpus"]))


def environment_default(key: str) -> str | None:
    """What the engines of a cluster started without ``key`` in its env read for it (the kernel's environment)."""
    if key == CLUSTER_ENV["gpus"]:
        return (os.environ.get(key) or "auto").strip().lower()
    if key == CLUSTER_ENV["shm"]:
        return "1" if shm_from_env() else "0"
    if key == CLUSTER_ENV["collective_timeout"]:
        return repr(timeout_from_env())
    return None


def restart_reason(cluster: TacoCluster, env: Mapping[str, str]) -> str | None:
    """Why the running ``cluster`` cannot serve a cell that wants ``env`` in its engines' environment, if so."""
    for key, wanted in env.items():
        with option_errors():
            current = cluster.env.get(key) or environment_default(key)
        if current == wanted:
            continue
        if key == "LIGHT_INTRA_SIZE":
            return f"has another node layout; restarting it with --intra-size {wanted}"
        if key == CLUSTER_ENV["gpus"]:
            return f"places GPUs otherwise; restarting it with --gpus {wanted}"
        if key == CLUSTER_ENV["shm"]:
            return f"uses shared memory otherwise; restarting it with {'--shm' if wanted == '1' else '--no-shm'}"
        return f"has another collective timeout; restarting it with --collective-timeout {float(wanted):g}"
    return None


def profile_change(running: Profile, wanted: Profile) -> str:
    """Why a cluster of profile ``running`` is restarted for ``wanted`` (another Slurm job, or elsewhere)."""
    if running.slurm is not None and wanted.slurm is not None and running.slurm != wanted.slurm:
        flags = wanted.slurm.flags() or "Slurm's defaults"
        return f"asks Slurm for another job; restarting it with {flags}"
    return f"runs elsewhere; restarting it with --profile {wanted.name}"


def ensure_cluster(name: str, size: int | None, mpiexec: str | None, say: RankOutput,
                   env: Mapping[str, str] | None = None, launcher: str | None = None, limit: int | None = None,
                   default_size: int = DEFAULT_NP, profile: Profile = LOCAL) -> TacoCluster:
    """The running cluster ``name`` with ``size`` ranks and ``env`` (``LIGHT_INTRA_SIZE``, ``TACO_GPUS``, …) in
    its engines' environment, reusing, repairing, resizing or restarting it as needed."""
    env = dict(env or {})
    cluster = clusters.get(name)
    if cluster is not None and cluster.error:
        say.warn(f"cluster {name!r} is unusable ({cluster.error}); starting a fresh one: {LOST}")
        clusters.pop(name).stop()
        cluster = None
    if cluster is not None and cluster.ipp_cluster is None:
        clusters.pop(name)
        cluster = None
    if cluster is not None and size is not None and size != cluster.size:
        say.warn(f"cluster {name!r} has {cluster.size} ranks; restarting it with -np {size}: {LOST}")
        clusters.pop(name).stop()
        cluster = None
    if cluster is not None and cluster.profile != profile:
        say.warn(f"cluster {name!r} {profile_change(cluster.profile, profile)}: {LOST}")
        clusters.pop(name).stop()
        cluster = None
    reason = restart_reason(cluster, env) if cluster is not None else None
    if reason is not None:
        say.warn(f"cluster {name!r} {reason}: {LOST}")
        clusters.pop(name).stop()
        cluster = None
    if cluster is None:
        shared = attach_shared(name, size, say) if profile.single_host else None  # the sidebar's clusters are local
        return shared or start_cluster(name, size or default_size, mpiexec, say, env, launcher, limit, profile)
    return cluster


def attach_shared(name: str, size: int | None, say: RankOutput) -> TacoCluster | None:
    """The cluster ``name`` started from the sidebar (owned by the Jupyter server), if there is one."""
    from ..cluster.registry.attach import attach, find_shared

    model = find_shared(name, wait=START_WAIT_S,
                        on_wait=lambda: say.notice(f"waiting for cluster {name!r}, which the sidebar is starting…"))
    if model is None:
        return None
    if size is not None and size != model["size"]:
        raise OptionError(f"cluster {name!r} was started from the sidebar with {model['size']} ranks: scale it "
                         f"there, or use -np {model['size']} or another --cluster name")
    cluster = clusters[name] = attach(model)
    say.notice(f"using cluster {name!r} started from the sidebar: {model['size']} ranks")
    return cluster


def check_hugepages(cluster: TacoCluster, need: int | None, started: bool) -> None:
    """``--require-hugepages N``: every node of ``cluster`` has ``N`` free huge pages of its default size, else a
    OptionError naming the nodes and the remedy, after stopping the cluster when this magic ``started`` it (one
    it found running, or attached from the sidebar, is left as it was)."""
    if need is None:
        return
    from ..cluster.doctor.engines import hugepage_nodes
    from ..cluster.doctor.report import HugePagesError, require_hugepages
    from ..cluster.registry.attach import AttachedCluster

    try:
        require_hugepages(hugepage_nodes(cluster), need)
    except HugePagesError as exc:
        if started and not isinstance(cluster, AttachedCluster):
            if clusters.get(cluster.name) is cluster:
                clusters.pop(cluster.name)
            cluster.stop()
            raise OptionError(f"cluster {cluster.name!r} stopped: --require-hugepages {need}: {exc}") from None
        raise OptionError(f"cluster {cluster.name!r} (left running) does not meet --require-hugepages {need}: "
                         f"{exc}") from None


def format_status(cluster: TacoCluster) -> str:
    status = cluster.model()
    lines = [f"cluster {status['name']!r}: {status['state']}, {status['engines_up']}/{status['size']} engines up"]
    if status["mpi"]:
        lines.append(f"  MPI: {status['mpi']}")
    if status["started_at"]:
        hosts = ", ".join(sorted({n["host"] for n in status["nodes"]}))
        lines.append(f"  up for {time.time() - status['started_at']:.0f} s; hosts: {hosts}")
    if status["membership"] is not None:
        from ..cluster.elastic.recovery import membership_text

        lines.append(f"  membership: {membership_text(status['membership'])}")
    if cluster.ranks:
        lines.append("  rank  node  local  host                 pid")
        lines += [f"  {r.rank:>4}  {r.node:>4}  {r.local_rank:>5}  {r.host:<20} {r.pid:>6}" for r in cluster.ranks]
    return "\n".join(lines)


def shared_size(name: str, say: RankOutput | None = None) -> int | None:
    """The size of the sidebar's cluster ``name`` (waiting while the sidebar starts it), or None."""
    from ..cluster.registry.attach import find_shared

    model = find_shared(name, wait=START_WAIT_S, on_wait=None if say is None else lambda: say.notice(
        f"waiting for cluster {name!r}, which the sidebar is starting…"))
    return model["size"] if model is not None else None


