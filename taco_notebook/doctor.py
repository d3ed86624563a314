"""``python -m taco_notebook.doctor``: this machine's node report (huge pages, GPUs, NICs, CPUs, MPI, torch) with
each problem's remedy, as a text table; ``--json`` for the raw facts and findings.

The logic lives in :mod:`taco_notebook.cluster.doctor`; ``%taco_doctor`` shows the same report for every node
of a cluster. Exit codes: 0 no errors (warnings may remain), 1 a finding of severity error, 2 bad arguments,
3 ``--require-hugepages N`` not met.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["main"]

HUGEPAGES_MISSING = 3


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report for this machine; see the module docstring for the exit codes."""
    parser = argparse.ArgumentParser(prog="python -m taco_notebook.doctor",
                                     description="What this node offers a taco_notebook job, and what to fix.")
    parser.add_argument("--json", action="store_true", help="print facts and findings as JSON")
    parser.add_argument("--require-hugepages", type=int, metavar="N",
                        help="exit 3 unless N huge pages of --page-size are free")
    parser.add_argument("--page-size", default="default", choices=("default", "2M", "1G"),
                        help="huge page size for --require-hugepages (default: the kernel's default size)")
    args = parser.parse_args(argv)
    if args.require_hugepages is not None and args.require_hugepages < 1:
        parser.error(f"--require-hugepages must be a positive integer, got {args.require_hugepages}")
    from .cluster.doctor import HugePagesError, local_report, require_hugepages  # imports torch: after the checks

    report = local_report()
    print(json.dumps(report.to_dict(), indent=1) if args.json else report)
    if args.require_hugepages is not None:
        try:
            require_hugepages(report, args.require_hugepages, args.page_size)
        except HugePagesError as exc:
            print(f"\n{exc}", file=sys.stderr)
            return HUGEPAGES_MISSING
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
