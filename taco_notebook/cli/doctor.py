"""``taco-notebook doctor``: this machine's node report (huge pages, GPUs, NICs, CPUs, MPI, torch) with
each problem's remedy, as a text table; ``--json`` for the raw facts and findings.

``--hosts n0,n1`` (or ``--hostfile FILE``, or ``--profile NAME``) reports those nodes and the links between them
instead, read through a temporary cluster of one engine per node (as ``%taco_doctor --hosts`` does; progress on
stderr), stopped before the report is printed.

The logic lives in :mod:`taco_notebook.cluster.doctor.report` (and :mod:`taco_notebook.plan.doctor` for nodes
where no cluster runs); ``%taco_doctor`` shows the same report for every node of a cluster. Exit codes: 0 no
errors (warnings may remain), 1 a finding of severity error, 2 bad arguments, 3 ``--require-hugepages N`` not
met, 4 the nodes could not be examined (a host unreachable, no MPI).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..cluster.doctor.report import DoctorReport
    from ..cluster.launch.profiles import Profile

__all__ = ["add_parser", "command"]

HUGEPAGES_MISSING = 3
NOT_EXAMINED = 4


def _nodes_report(profile: Profile, mpiexec: str | None) -> DoctorReport | None:
    """The nodes of ``profile`` through a temporary cluster (progress on stderr); None, with the reason on
    stderr, when they could not be examined."""
    from ..errors import TacoError
    from ..plan.doctor import examine_nodes
    from ..plan.output import RankOutput

    try:
        return examine_nodes(profile, RankOutput(stdout=sys.stderr), mpiexec)
    except TacoError as exc:
        print(f"taco doctor: {exc}", file=sys.stderr)
        return None


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """``doctor [--json] [--require-hugepages N] [--hosts SPEC | --hostfile FILE | --profile NAME]``."""
    parser = subparsers.add_parser("doctor", help="what the nodes offer a taco_notebook job (huge pages, GPUs, NICs, "
                                   "MPI, torch), and what to fix", description="What this node offers a "
                                   "taco_notebook job, and what to fix.")
    parser.add_argument("--json", action="store_true", help="print facts and findings as JSON")
    parser.add_argument("--require-hugepages", type=int, metavar="N",
                        help="exit 3 unless N huge pages of --page-size are free")
    parser.add_argument("--page-size", default="default", choices=("default", "2M", "1G"),
                        help="huge page size for --require-hugepages (default: the kernel's default size)")
    parser.add_argument("--hosts", metavar="SPEC", help="examine these hosts (HOST[:SLOTS],…) over ssh instead")
    parser.add_argument("--hostfile", metavar="FILE", help="examine the hosts of this file (HOST[:SLOTS] per line)")
    parser.add_argument("--profile", metavar="NAME", help="examine the nodes of this profile: local, hosts, slurm")
    parser.add_argument("--mpiexec", metavar="PATH", help="with --hosts: mpich's hydra mpiexec to start them with")
    parser.set_defaults(run_command=lambda args: command(args, parser))
    return parser


def command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print the report; see the module docstring for the exit codes."""
    if args.require_hugepages is not None and args.require_hugepages < 1:
        parser.error(f"--require-hugepages must be a positive integer, got {args.require_hugepages}")
    from ..cluster.launch.profiles import ProfileError, profile_for

    try:
        profile = profile_for(args.profile, args.hosts, args.hostfile)
    except ProfileError as exc:
        parser.error(str(exc))
    from ..cluster.doctor.collect import local_report  # imports torch: after the checks
    from ..cluster.doctor.report import HugePagesError, require_hugepages

    report = local_report() if profile.single_host else _nodes_report(profile, args.mpiexec)
    if report is None:
        return NOT_EXAMINED
    print(json.dumps(report.to_dict(), indent=1) if args.json else report)
    if args.require_hugepages is not None:
        try:
            require_hugepages(report, args.require_hugepages, args.page_size)
        except HugePagesError as exc:
            print(f"\n{exc}", file=sys.stderr)
            return HUGEPAGES_MISSING
    return 0 if report.ok else 1

