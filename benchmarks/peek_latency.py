"""How long ``%taco_peek`` takes to read an expression from N ranks (default 4) of a local cluster while each
rank trains in a cell (a small MLP's forward, backward and SGD step in a loop, counting ``step``), and what the
peeks cost that loop: its steps per second in a run with a peek every ``--every`` seconds against a run without.
Prints a table row for benchmarks/README.md.

    python -m benchmarks peek_latency -n 4
    TACO_MAX_RANKS=16 python -m benchmarks peek_latency -n 16
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from taco_notebook.cluster.debug.peek import peek
from taco_notebook.cluster.session import TacoCluster

MARK = 50  # steps before the measured part: the loop is warm
CELL = """\
import os, time
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.01)
x = torch.randn(64, 256)
step = 0
while not os.path.exists({flag!r}):
    opt.zero_grad()
    loss = net(x).pow(2).mean()
    loss.backward()
    opt.step()
    step += 1
    if step == {mark}:
        marked = time.monotonic()
steps_per_s = (step - {mark}) / (time.monotonic() - marked)
"""


def _run(cluster: TacoCluster, flag: Path, peeks: int, every: float) -> tuple[list[float], float]:
    """One training cell, with ``peeks`` peeks (else as long without) once warm: the peek times, and the
    ranks' mean steps per second over that time."""
    result = cluster.client[cluster.engine_ids()].execute(CELL.format(flag=str(flag), mark=MARK), block=False)
    deadline = time.monotonic() + 300
    while set(peek(cluster.ranks, f"step > {MARK}").values().values()) != {"True"}:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ranks did not reach step {MARK} in 300 s")
        time.sleep(0.5)
    took = []
    for _ in range(peeks):
        began = time.monotonic()
        report = peek(cluster.ranks, "step, loss.item()")
        took.append(time.monotonic() - began)
        if len(report.values()) != cluster.size:
            raise RuntimeError(f"not every rank answered:\n{report.text()}")
        time.sleep(every)
    if not peeks:
        time.sleep(20 * every)
    flag.touch()
    result.get(120)
    flag.unlink()
    rates = cluster.client[cluster.engine_ids()].pull("steps_per_s", block=True)
    return took, statistics.mean(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--peeks", type=int, default=20)
    parser.add_argument("--every", type=float, default=0.25, help="seconds between peeks")
    parser.add_argument("--rounds", type=int, default=2, help="runs without and with peeks, alternating")
    args = parser.parse_args()
    flag = Path(tempfile.mkdtemp()) / "release"
    cluster = TacoCluster("peek-bench", args.n, start_timeout=600).start()
    took: list[float] = []
    quiet_rates, peeked_rates = [], []
    try:
        for _ in range(args.rounds):
            quiet_rates.append(_run(cluster, flag, 0, args.every)[1])
            times, rate = _run(cluster, flag, args.peeks, args.every)
            took += times
            peeked_rates.append(rate)
    finally:
        flag.touch()
        cluster.stop()
    quiet, peeked = statistics.mean(quiet_rates), statistics.mean(peeked_rates)
    ordered = sorted(took)
    print("| ranks | peeks | median (s) | p90 (s) | slowest (s) | loop steps/s without, with peeks |")
    print(f"| {args.n} | {len(took)} | {statistics.median(took):.4f} | {ordered[int(0.9 * (len(took) - 1))]:.4f} | "
          f"{max(took):.4f} | {quiet:.1f}, {peeked:.1f} |")


if __name__ == "__main__":
    main()
