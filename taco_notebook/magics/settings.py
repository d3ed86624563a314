"""The settings of ``%%taco_run`` and ``%taco_cluster``: each one an option, a traitlets trait and (mostly) an
environment variable, checked in one place.

``TacoMagics`` is an IPython ``Magics``, so a traitlets ``Configurable``: ``c.TacoMagics.compression = "fp16"``
in ``ipython_config.py`` or ``%config TacoMagics.compression = "fp16"`` in a notebook sets the trait, and
``%config TacoMagics`` lists them. For each cell the magic's option wins, then the trait when set, then the
environment (read when the cell runs, so a kernel started with ``LIGHT_TOPK_ALLREDUCE=1`` behaves as a plain
``mpiexec`` job would), then the built-in default. Unset traits are None: they defer to the environment.

============================  =========================  ==========================  ===========================
option                        trait (``TacoMagics.…``)   environment                 default
============================  =========================  ==========================  ===========================
``-np N``                     ``np``                     -                           the running cluster's, else 4
``--intra-size N``            ``intra_size``             ``LIGHT_INTRA_SIZE``        the job's real layout
``--timeout S``               ``timeout``                -                           none
``--algorithm``               ``algorithm``              ``LIGHT_2D_ALLREDUCE``      auto
``--compression``             ``compression``            ``LIGHT_TOPK_ALLREDUCE`` …  none
``--fusion-mb MB``            ``fusion_mb``              ``TACO_FUSION_MB``          64
``--shm`` / ``--no-shm``      ``shm``                    ``TACO_SHM``                on
``--collective-timeout S``    ``collective_timeout``     ``TACO_COLLECTIVE_TIMEOUT`` 1800
``--stall-timeout S|off``     ``stall_timeout``          ``TACO_STALL_TIMEOUT``      300 (0 = off)
``--gpus``                    ``gpus``                   ``TACO_GPUS``               auto
``--mpi-launcher``            ``mpi_launcher``           ``TACO_MPI_LAUNCHER``       auto
``--dashboard``               ``dashboard``              ``TACO_DASHBOARD``          auto
``--link-gbits G``            ``link_gbits``             ``TACO_LINK_GBITS``         unknown (heatmaps self-scale)
``--require-hugepages N``     ``require_hugepages``      ``TACO_REQUIRE_HUGEPAGES``  none required
-                             ``max_ranks``              ``TACO_MAX_RANKS``          4 × cores, at least 8
``--profile NAME``            ``profile``                -                           local (hosts if given)
``--hosts SPEC``              ``hosts``                  -                           none
``--hostfile FILE``           ``hostfile``               -                           none
-                             ``controller_ip``          -                           route to the first host
``--partition NAME``          ``partition``              -                           Slurm's default partition
``--time LIMIT``              ``time``                   -                           the partition's limit
``--nodes N``                 ``nodes``                  -                           as Slurm places the ranks
``--gpus-per-node N``         ``gpus_per_node``          -                           0 (no ``--gres``)
``--queue-timeout S``         ``queue_timeout``          -                           none (wait in the queue)
============================  =========================  ==========================  ===========================

Where each takes effect: ``algorithm``, ``compression``, ``fusion_mb`` and ``stall_timeout`` are the ranks'
``taco.configure()`` for the cell; ``shm``, ``collective_timeout`` and ``gpus`` are fixed when the ranks build
their process group, so they travel in the cluster's environment and a change restarts the cluster (as
``--gpus`` always did); ``require_hugepages`` is checked against every node once its cluster has started (a
shortfall stops it); ``partition`` … ``queue_timeout`` are the slurm profile's job (given with another profile,
the options are a UsageError and the traits are not used; a change restarts a slurm cluster); the rest are the
kernel's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from traitlets import Bool, Float, Int, TraitError, Unicode, validate
from traitlets.config import Configurable

from ..cluster.launch.mpi import LAUNCHERS
from ..cluster.launch.profiles import PROFILES
from ..cluster.launch.slurm.options import check_count, check_partition, check_time
from ..comm.placement import GPU_MODES

__all__ = ["TacoSettings", "RANK_SETTINGS", "CLUSTER_ENV", "KERNEL_ENV", "SLURM_SETTINGS", "check_setting",
           "setting_from_env"]

RANK_SETTINGS = ("algorithm", "compression", "fusion_mb", "stall_timeout")  # the ranks' taco.configure() per cell
CLUSTER_ENV = {"gpus": "TACO_GPUS", "shm": "TACO_SHM", "collective_timeout": "TACO_COLLECTIVE_TIMEOUT"}
# read by the kernel itself (setting_from_env) when neither the option nor the trait gives them
KERNEL_ENV = {"link_gbits": "TACO_LINK_GBITS", "require_hugepages": "TACO_REQUIRE_HUGEPAGES"}


def _algorithm(value: Any, what: str) -> str:
    from ..comm.specs import check_algorithm

    return check_algorithm(value.strip().lower() if isinstance(value, str) else value)


def _compression(value: Any, what: str) -> str:
    """The spec's canonical text (a trait holds text), checked by parsing it; its message names the spec and
    what is accepted. :func:`.args.comm_settings` sends the ranks the parsed value."""
    from ..comm.compression.spec import CompressionSpec

    return CompressionSpec.parse(value).name


def _fusion_mb(value: Any, what: str) -> float:
    from ..comm.specs import check_fusion_mb

    try:
        return check_fusion_mb(float(value))
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of megabytes >= 0, got {value!r}") from None


def _stall_timeout(value: Any, what: str) -> float:
    from ..comm.specs import check_stall_timeout

    return check_stall_timeout(value, what)


def _choice(choices: tuple[str, ...] | Callable[[], tuple[str, ...]]) -> Callable[[Any, str], str]:
    """A check that the value is one of ``choices`` (or of what ``choices()`` gives, for a module imported late)."""
    def check(value: Any, what: str) -> str:
        from ..comm.specs import check_choice

        return check_choice(value, choices if isinstance(choices, tuple) else choices(), what)

    return check


def _dashboard_modes() -> tuple[str, ...]:
    from ..widgets.dashboard import DASHBOARD_MODES  # imports bokeh: only when a dashboard mode is checked

    return DASHBOARD_MODES


def _hosts(value: Any, what: str) -> str:
    from ..cluster.launch.profiles import parse_hosts

    parse_hosts(str(value), what)  # a ProfileError (a ValueError) naming the entry and the form
    return str(value)


def _address(value: Any, what: str) -> str:
    import ipaddress

    try:
        if not ipaddress.ip_address(str(value)).is_unspecified:
            return str(value)
    except ValueError:
        pass
    raise ValueError(f"{what} must be this machine's address that the hosts reach, got {value!r}")


def _positive(unit: str, convert: Callable[[Any], Any] = float) -> Callable[[Any, str], Any]:
    def check(value: Any, what: str) -> Any:
        from ..comm.specs import check_positive

        return check_positive(value, what, unit, convert)

    return check


def _flag(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    from ..comm.specs import parse_flag

    flag = parse_flag(what, str(value))
    if flag is None:
        raise ValueError(f"{what} must be 1/true/yes/on or 0/false/no/off, got {value!r}")
    return flag


_CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "np": _positive("ranks", int),
    "max_ranks": _positive("ranks", int),
    "intra_size": _positive("ranks per node", int),
    "timeout": _positive("seconds"),
    "algorithm": _algorithm,
    "compression": _compression,
    "fusion_mb": _fusion_mb,
    "shm": _flag,
    "collective_timeout": _positive("seconds"),
    "stall_timeout": _stall_timeout,
    "gpus": _choice(GPU_MODES),
    "mpi_launcher": _choice(LAUNCHERS),
    "dashboard": _choice(_dashboard_modes),
    "link_gbits": _positive("Gbit/s"),
    "require_hugepages": _positive("free huge pages per node", int),
    "profile": _choice(PROFILES),
    "hosts": _hosts,
    "hostfile": lambda value, what: str(value),
    "controller_ip": _address,
    "partition": check_partition,
    "time": check_time,
    "nodes": _positive("nodes", int),
    "gpus_per_node": check_count,
    "queue_timeout": _positive("seconds"),
}
SLURM_SETTINGS = ("partition", "time", "nodes", "gpus_per_node", "queue_timeout")  # the slurm profile's job


def check_setting(name: str, value: Any, what: str) -> Any:
    """``value`` of setting ``name`` checked and made canonical; a ValueError naming ``what`` (the option, trait
    or variable it came from) and what is accepted."""
    return _CHECKS[name](value, what)


def setting_from_env(name: str) -> Any:
    """Setting ``name`` from its variable in :data:`KERNEL_ENV` (``TACO_LINK_GBITS=25``), checked as the option
    and the trait are; None when unset or blank, a ValueError naming the variable when bad."""
    variable = KERNEL_ENV[name]
    raw = os.environ.get(variable, "").strip()
    return check_setting(name, raw, variable) if raw else None


class TacoSettings(Configurable):
    """The traits of the table in this module's docstring; ``TacoMagics`` inherits them."""

    np = Int(None, allow_none=True, help="ranks of a cluster started without -np (a running one keeps its "
                                         "size); default 4").tag(config=True)
    max_ranks = Int(None, allow_none=True, help="the most ranks a local cluster may have; default "
                                                "TACO_MAX_RANKS, else 4 x cores (at least 8)").tag(config=True)
    intra_size = Int(None, allow_none=True, help="ranks per node, to emulate several nodes on one machine; "
                                                 "default LIGHT_INTRA_SIZE (read by the ranks)").tag(config=True)
    timeout = Float(None, allow_none=True, help="seconds after which a cell is stopped; default none").tag(
        config=True)
    algorithm = Unicode(None, allow_none=True, help="allreduce: auto, flat or 2d; default LIGHT_2D_ALLREDUCE, "
                                                    "else auto").tag(config=True)
    compression = Unicode(None, allow_none=True, help="none, fp16, bf16 or topk:RATIO[:threshold=N]; default "
                                                      "LIGHT_TOPK_ALLREDUCE/_RATIO/_THRESHOLD, else none").tag(
        config=True)
    fusion_mb = Float(None, allow_none=True, help="gradient fusion buckets in MB (0 = none); default "
                                                  "TACO_FUSION_MB, else 64").tag(config=True)
    shm = Bool(None, allow_none=True, help="2D allreduce's intra-node steps through shared memory; default "
                                           "TACO_SHM, else on").tag(config=True)
    collective_timeout = Float(None, allow_none=True, help="seconds a collective waits for its peers; default "
                                                           "TACO_COLLECTIVE_TIMEOUT, else 1800").tag(config=True)
    stall_timeout = Float(None, allow_none=True, help="seconds a collective waits for ranks that have not entered "
                                                      "it before the cell fails naming them (0 = never); default "
                                                      "TACO_STALL_TIMEOUT, else 300").tag(config=True)
    gpus = Unicode(None, allow_none=True, help="auto, shared or none; default TACO_GPUS, else auto").tag(
        config=True)
    mpi_launcher = Unicode(None, allow_none=True, help="MPICH launcher of a one-host cluster: auto, hydra or "
                                                       "gforker; default TACO_MPI_LAUNCHER, else auto").tag(
        config=True)
    dashboard = Unicode(None, allow_none=True, help="auto, widget, text or off; default TACO_DASHBOARD, else "
                                                    "auto").tag(config=True)
    link_gbits = Float(None, allow_none=True, help="a node's link in Gbit/s, the scale of the link heatmaps; "
                                                   "default TACO_LINK_GBITS").tag(config=True)
    require_hugepages = Int(None, allow_none=True, help="free huge pages (each node's default size) every node "
                                                        "must have, else the cluster is stopped; default "
                                                        "TACO_REQUIRE_HUGEPAGES, else none").tag(config=True)

    profile = Unicode(None, allow_none=True, help="where engines run: local, hosts or slurm").tag(config=True)
    hosts = Unicode(None, allow_none=True, help="the hosts profile's HOST:SLOTS,… (n0:2,n1:2)").tag(config=True)
    hostfile = Unicode(None, allow_none=True, help="the hosts profile's hostfile, HOST:SLOTS per line").tag(
        config=True)
    controller_ip = Unicode(None, allow_none=True, help="the hosts profile's controller address; default: "
                                                        "emulated nodes' bridge, else the route to the first host"
                            ).tag(config=True)
    partition = Unicode(None, allow_none=True, help="the slurm profile's partition; default Slurm's").tag(
        config=True)
    time = Unicode(None, allow_none=True, help="the slurm profile's time limit (MM, MM:SS, HH:MM:SS, D-HH, "
                                               "D-HH:MM, D-HH:MM:SS); default the partition's").tag(config=True)
    nodes = Int(None, allow_none=True, help="nodes of the slurm profile's job; default Slurm's").tag(config=True)
    gpus_per_node = Int(None, allow_none=True, help="GPUs per node of the slurm profile's job (--gres=gpu:N); "
                                                    "default 0").tag(config=True)
    queue_timeout = Float(None, allow_none=True, help="seconds the slurm profile's job may wait in the queue "
                                                      "before it is cancelled; default no limit").tag(config=True)

    @validate(*_CHECKS)
    def _check_trait(self, proposal: Any) -> Any:
        value, name = proposal["value"], proposal["trait"].name
        if value is None:
            return None
        what = f"TacoMagics.{name}"
        try:
            return check_setting(name, value, what)
        except ValueError as exc:
            message = str(exc)
            raise TraitError(message if what in message else f"{what}: {message}") from None

    def chosen(self, name: str, option: Any, flag: str) -> Any:
        """The option's value when given (checked, a ValueError naming ``flag``), else the trait (None: unset)."""
        if option is not None:
            return check_setting(name, option, flag)
        return getattr(self, name)
