"""How long the hang autopsy takes for N ranks (default 16) of a local cluster, or of a cluster on ``--hosts``
(read over one ssh per host): rank N-1 hangs in plain Python while the others wait in an allreduce, and the
stacks of every rank are read REPEATS times from this process (as ``%taco_cluster stacks`` and the REST endpoint
do). Prints a table row for benchmarks/README.md.

    TACO_MAX_RANKS=16 python benchmarks/autopsy_ranks.py -n 16
    python -m taco_notebook emulate up 2x8 && python benchmarks/autopsy_ranks.py -n 16 --hosts n0:8,n1:8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from taco_notebook.cluster.cells.autopsy import collect, launcher_of
from taco_notebook.cluster.launch.profiles import LOCAL, hosts_profile
from taco_notebook.cluster.session import TacoCluster

CELL = """\
import os, time
t = torch.ones(2)
taco.allreduce(t)
def load_batch(flag):
    while not os.path.exists(flag):
        time.sleep(0.05)
if taco.rank() == taco.size() - 1:
    load_batch({flag!r})
taco.allreduce(t, name='step')
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--hosts", help="HOST:SLOTS,... (the hosts profile): ranks read over ssh, one per host")
    args = parser.parse_args()
    flag = Path(tempfile.mkdtemp()) / "release"
    profile = hosts_profile(args.hosts) if args.hosts else LOCAL
    cluster = TacoCluster("autopsy-bench", args.n, start_timeout=600, profile=profile).start()
    ssh = launcher_of(cluster)
    try:
        result = cluster.client[cluster.engine_ids()].execute(CELL.format(flag=str(flag)), block=False)
        deadline = time.monotonic() + 120
        while collect(cluster.ranks, launcher_exec=ssh).suspects != [args.n - 1] and time.monotonic() < deadline:
            time.sleep(0.5)
        took, answered, named = [], [], []
        for _ in range(args.repeats):
            began = time.monotonic()
            report = collect(cluster.ranks, launcher_exec=ssh)
            took.append(time.monotonic() - began)
            answered.append(sum(r.snapshot is not None for r in report.ranks))
            named.append(report.suspects == [args.n - 1])
        flag.touch()
        result.get(120)
    finally:
        flag.touch()
        cluster.stop()
    print("| ranks | hosts | median (s) | slowest (s) | ranks that answered (worst) | suspect named |")
    print(f"| {args.n} | {args.hosts or 'this one'} | {statistics.median(took):.3f} | {max(took):.3f} | "
          f"{min(answered)}/{args.n} | {sum(named)}/{len(named)} |")
    print(report.text(stacks=False))


if __name__ == "__main__":
    main()
