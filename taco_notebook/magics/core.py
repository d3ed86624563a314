"""``%%taco_run`` runs a cell on every MPI rank; ``%taco_cluster`` starts, stops and inspects clusters (and writes
Kubernetes manifests, :mod:`.manifest`); ``%taco_doctor`` reports on the nodes.

The IPython face of the run-plan layer (:mod:`taco_notebook.plan`), which checks the options and picks or starts
the cluster; its :class:`~taco_notebook.errors.OptionError` is shown here as a ``UsageError``. Their defaults are
:class:`TacoMagics`'s traits, then the environment (:mod:`taco_notebook.plan.settings`).
"""

from __future__ import annotations

import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..cluster.cells.run import run_cell, run_script
from ..cluster.session import clusters
from ..plan.clusters import (
    LOST,
    check_hugepages,
    chosen_profile,
    ensure_cluster,
    format_status,
    restart_reason,
    start_cluster,
)
from ..plan.resolve import cluster_settings, cluster_size, option_errors, positive_int, required_hugepages
from ..plan.runplan import dashboard_mode, link_capacity, new_size, plan_run, script_of
from ..plan.settings import TacoSettings
from .args import cluster_args, run_args, run_wants_help, usage, usage_errors, wants_help
from .output import NotebookOutput, show_report
from .registry import registry_cluster

__all__ = ["TacoMagics"]


@magics_class
class TacoMagics(Magics, TacoSettings):
    """Registered by ``%load_ext taco_notebook``. Its traits (``%config TacoMagics``) are the magics' defaults:
    see :mod:`taco_notebook.plan.settings`."""

    def __init__(self, shell: Any = None, **kwargs: Any) -> None:
        super().__init__(shell=shell, **kwargs)
        self._last_targets: dict[str, list[int] | None] = {}  # by cluster: the ranks of its last run (None: all)

    @magic_arguments()
    @run_args
    @line_cell_magic
    @usage_errors()
    def taco_run(self, line: str, cell: str | None = None) -> Any:
        """Run the cell on every MPI rank of a cluster (started on first use); ``taco`` is the rank's API
        (``taco_notebook.comm``; in the notebook itself ``taco`` is the package, for ``taco.dashboard()``).
        The line form runs a script on every rank as ``python SCRIPT ARGS`` would: options first, then the
        script (relative to the notebook's directory), then its arguments, all of them the script's.

        Example::

            %%taco_run -np 4
            t = torch.full((3,), float(taco.rank())); taco.allreduce(t); print(t)

            %taco_run -np 4 --compression fp16 train.py --epochs 1

        Each option's default is its trait when set (``%config TacoMagics.compression = "fp16"``, or
        ``c.TacoMagics.compression`` in ipython_config.py; ``%config TacoMagics`` lists them), else the
        environment variable named with it.
        """
        if run_wants_help(self.taco_run, line):
            print(usage(self.taco_run, "%%taco_run" if cell is not None else "%taco_run"))
            return None
        args = parse_argstring(self.taco_run, line)
        say = NotebookOutput(live=args.stream, quiet=args.quiet)
        if cell is None:  # the line form: a script
            if not args.script:
                raise UsageError("%taco_run needs a script: %taco_run -np 4 train.py --epochs 1 runs train.py on "
                                 "every rank; to run code instead, put %%taco_run (two %) and its options on a "
                                 "cell's first line and the code below it; %taco_run --help lists the options")
            script = script_of(args, "%taco_run")  # read before anything starts
            plan = plan_run(self, args, say)
            self._last_targets[plan.cluster.name] = plan.options.targets
            return run_script(plan.cluster, script, plan.options, say)
        if args.horovod:
            raise UsageError("--horovod runs a Horovod script with no edit (%taco_run --horovod train.py); in a "
                             "cell, `import taco_notebook.horovod as hvd` gives the same API")
        if args.script:
            command = shlex.join([args.script, *args.script_args])
            raise UsageError(f"%%taco_run runs the cell below it and takes no script (got {args.script!r}): to "
                             f"run a script, use the line form, %taco_run {command}")
        plan = plan_run(self, args, say)
        self._last_targets[plan.cluster.name] = plan.options.targets  # what %taco_cluster undo restores
        return run_cell(plan.cluster, cell, plan.options, say)

    def _new_size(self) -> int:
        """Ranks of a cluster started without ``-np``: ``TacoMagics.np`` when set, else 4."""
        return new_size(self)

    def _dashboard_mode(self, option: str | None) -> str:
        return dashboard_mode(self, option)

    def _link_capacity(self, option: str | None) -> float | None:
        return link_capacity(self, option)

    @magic_arguments()
    @argument("action", choices=["start", "stop", "restart", "scale", "status", "list", "manifest", "stacks", "undo",
                                 "keep", "adopt"],
              help="what to do (manifest: a Kubernetes MPIJob; %%taco_cluster manifest --help; scale N: on a "
                   "cluster that ran an --elastic cell, add engines that join at the next commit; stacks: every "
                   "rank's stacks and collective, read without stopping them; undo: put the parameters and "
                   "optimizer state taco trains, on every rank the last %%taco_run cell ran on, back to what they "
                   "were before that cell, from a copy in host memory (docs/undo.md); keep: the cluster outlives "
                   "this kernel's exit, restart or death, for another kernel to adopt; adopt [NAME]: take over a "
                   "kept cluster whose kernel ended, every rank's variables intact)")
    @argument("count", nargs="?", default=None, metavar="N", help="scale: the new number of ranks; adopt: the "
              "kept cluster's name or id (default: --cluster)")
    @argument("-n", "-np", dest="np", default=None, metavar="N", help="ranks for start/restart")
    @argument("--all", action="store_true", help="with stop: stop every cluster of this kernel; with stacks: every "
              "thread with every frame (the kernel's, zmq's and taco's idle ones too)")
    @cluster_args
    @line_magic
    @usage_errors()
    def taco_cluster(self, line: str) -> None:
        """Manage clusters: ``%taco_cluster start -n 4 | stop | restart | scale N | status | list [--cluster NAME]``;
        ``%taco_cluster stacks [--cluster NAME]``: the hang autopsy (also of another kernel's cluster);
        ``%taco_cluster undo [--cluster NAME]``: back to the state before the last ``%%taco_run`` cell;
        ``%taco_cluster manifest --k8s -np 16 --gpus-per-node 8 …`` prints a Kubernetes MPIJob."""
        words = line.split(None, 1)
        if words and words[0] == "manifest":  # its own options: see magics/manifest.py
            from .manifest import run_manifest

            run_manifest(words[1] if len(words) > 1 else "")
            return
        if wants_help(line):
            print(usage(self.taco_cluster, "%taco_cluster"))
            return
        args = parse_argstring(self.taco_cluster, line)
        size = cluster_size(args.np, "-n", self.max_ranks)
        action = getattr(self, f"_cluster_{args.action}")
        action(args.cluster, size, args)

    def _cluster_list(self, name: str, size: int | None, args: Any) -> None:
        if not clusters:
            print("no clusters running in this kernel")
        for cluster in clusters.values():
            status = cluster.model()
            print(f"{status['name']}: {status['state']}, {status['engines_up']}/{status['size']} engines, "
                  f"{status['mpi']}")

    def _cluster_status(self, name: str, size: int | None, args: Any) -> None:
        cluster = clusters.get(name)
        if cluster is None:
            print(f"cluster {name!r}: stopped (start it with %taco_cluster start -n N)")
        else:
            print(format_status(cluster))

    def _cluster_stacks(self, name: str, size: int | None, args: Any) -> None:
        from ..cluster.cells.autopsy import collect, launcher_of

        cluster = clusters.get(name)
        if cluster is not None and cluster.running:
            print(collect(cluster.ranks, launcher_exec=launcher_of(cluster)).text(full=args.all))
            return
        # another kernel's cluster (this one may be stuck in a cell): its ranks from the registry
        with registry_cluster(name, "%taco_cluster stacks") as (manager, model):
            print(manager.stacks(model["id"], full=args.all)["text"])

    def _cluster_undo(self, name: str, size: int | None, args: Any) -> None:
        from ..cluster.cells.undo import UndoRefused, undo

        cluster = clusters.get(name)
        if cluster is None or not cluster.running:
            raise UsageError(f"%taco_cluster undo needs a running cluster; no cluster named {name!r} runs in this "
                             f"kernel (running: {sorted(clusters) or 'none'}; --cluster NAME picks another)")
        try:
            NotebookOutput().notice(undo(cluster, self._last_targets.get(name)))
        except UndoRefused as exc:
            raise UsageError(str(exc)) from None

    def _cluster_keep(self, name: str, size: int | None, args: Any) -> None:
        from ..cluster.registry.keep import AdoptError, keep

        cluster = clusters.get(name)
        if cluster is None:
            raise UsageError(f"%taco_cluster keep needs a running cluster of this kernel; none is named {name!r} "
                             f"(running: {sorted(clusters) or 'none'}; --cluster NAME picks another)")
        try:
            idle = keep(cluster)
        except AdoptError as exc:
            raise UsageError(str(exc)) from None
        NotebookOutput().notice(f"cluster {name!r} is kept: it outlives this kernel; in a new kernel, "
                                f"%taco_cluster adopt {name} takes it over with every rank's variables (stopped "
                                f"{idle / 60:g} min after this kernel ends, unless adopted)")

    def _cluster_adopt(self, name: str, size: int | None, args: Any) -> None:
        from ..cluster.registry.keep import AdoptError, adopt

        try:
            cluster = adopt(args.count or name)
        except AdoptError as exc:
            raise UsageError(str(exc)) from None
        NotebookOutput().notice(f"adopted cluster {cluster.name!r}: {len(cluster.ranks)} ranks, their variables "
                                "as they were; it is this kernel's now")

    def _cluster_stop(self, name: str, size: int | None, args: Any) -> None:
        names = list(clusters) if args.all else [name]
        for stopping in names:
            if stopping not in clusters:
                raise UsageError(f"no cluster named {stopping!r} is running; running: {sorted(clusters) or 'none'}")
            clusters.pop(stopping).stop()
            NotebookOutput().notice(f"cluster {stopping!r} stopped")

    def _cluster_start(self, name: str, size: int | None, args: Any) -> None:
        running = clusters.get(name)
        ranks = size or (running.size if running else self._new_size())
        env, launcher = self._cluster_options(args, ranks)
        need = required_hugepages(self, args)
        profile = chosen_profile(self, args, ranks)
        if (running is not None and running.running and size in (None, running.size)
                and running.profile == profile and restart_reason(running, env) is None):
            NotebookOutput().notice(f"cluster {name!r} is already running with {running.size} ranks")
            cluster = running
        else:
            cluster = ensure_cluster(name, size, args.mpiexec, NotebookOutput(), env, launcher, self.max_ranks,
                                     self._new_size(), profile)
        check_hugepages(cluster, need, started=cluster is not running)

    def _cluster_scale(self, name: str, size: int | None, args: Any) -> None:
        size = size or cluster_size(args.count, "scale N", self.max_ranks)
        cluster = clusters.get(name)
        if cluster is None or size is None:
            raise UsageError(f"%taco_cluster scale N needs a running cluster and N; running: "
                             f"{sorted(clusters) or 'none'}")
        if cluster.elastic is None or size <= len(cluster.ranks):
            NotebookOutput().warn(f"restarting cluster {name!r} with {size} ranks: {LOST} (only a cluster that ran an "
                              "--elastic cell grows without a restart)")
            cluster.scale(size)
            return
        from ..cluster.elastic.recovery import wait_for_joiners

        cluster.scale(size)
        pending = wait_for_joiners(cluster)
        NotebookOutput().notice(f"{len(pending)} engine{'s' if len(pending) != 1 else ''} ready on cluster {name!r}: "
                            f"they join at the next commit of an --elastic cell (up to its MAX)")

    def _cluster_restart(self, name: str, size: int | None, args: Any) -> None:
        previous = clusters.get(name)
        ranks = size or (previous.size if previous else self._new_size())
        env, launcher = self._cluster_options(args, ranks)  # checked before the running cluster is stopped
        need = required_hugepages(self, args)
        profile = chosen_profile(self, args, ranks)
        previous = clusters.pop(name, None)
        if previous is not None:
            NotebookOutput().warn(f"restarting cluster {name!r}: {LOST}")
            previous.stop()
        started = start_cluster(name, ranks, args.mpiexec, NotebookOutput(), env, launcher, self.max_ranks, profile)
        check_hugepages(started, need, started=True)

    @magic_arguments()
    @argument("--cluster", default=None, metavar="NAME",
              help="read the nodes of this running cluster through its engines (default: 'default' when it runs, "
                   "else this machine alone)")
    @argument("--hosts", default=None, metavar="SPEC",
              help="examine these hosts (HOST[:SLOTS],…, slots ignored) through a temporary cluster of one engine "
                   "per host, started over ssh and stopped afterwards")
    @argument("--hostfile", default=None, metavar="FILE", help="... the hosts of this file (HOST[:SLOTS] per line)")
    @argument("--profile", default=None, metavar="NAME",
              help="... the nodes of this profile (hosts: with TacoMagics.hosts/hostfile; slurm: a job with one "
                   "task per node of the allocation this kernel runs in, else one task; local: this machine)")
    @argument("--json", action="store_true", help="return the report as a dict instead of showing it")
    @argument("--require-hugepages", dest="require_hugepages", default=None, metavar="N",
              help="a UsageError naming the nodes with fewer than N free huge pages of their default size")
    @line_magic
    @usage_errors()
    def taco_doctor(self, line: str) -> Any:
        """One table, a row per node: huge pages, GPUs, NICs, CPUs/NUMA, MPI, torch and NCCL, the measured links;
        then each problem with its remedy. Problems are shown, not raised (but see --require-hugepages).

        Example: ``%taco_doctor --hosts n0,n1`` examines two hosts where no cluster runs yet."""
        if wants_help(line):
            print(usage(self.taco_doctor, "%taco_doctor"))
            return None
        args = parse_argstring(self.taco_doctor, line)
        need = positive_int(args.require_hugepages, "--require-hugepages")
        from ..plan.doctor import chosen_report

        report = chosen_report(self, args, NotebookOutput(quiet=args.json))  # --json prints nothing
        if not args.json:
            show_report(report)
        if need is not None:
            from ..cluster.doctor.report import HugePagesError, require_hugepages

            try:
                require_hugepages(report, need)
            except HugePagesError as exc:
                raise UsageError(f"--require-hugepages {need}: {exc}") from None
        return report.to_dict() if args.json else None

    def _cluster_options(self, args: Any, size: int) -> tuple[dict[str, str], str | None]:
        """The engines' environment (``--gpus``, ``--shm``, ``--collective-timeout``) and the MPI launcher."""
        env = cluster_settings(self, args, size)
        with option_errors():
            return env, self.chosen("mpi_launcher", args.mpi_launcher, "--mpi-launcher")
