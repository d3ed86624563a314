"""What the live dashboard costs a training step: the ranks' publishing, and a whole training cell with and without.

Two measurements on one running cluster, in one real IPython shell with the widget dashboard forced on
(``TACO_DASHBOARD=widget``: the client builds the widgets and sends every bokeh patch, as under JupyterLab):

1. on the ranks, the microseconds of one ``taco.metrics.send()`` (snapshot + ipyparallel datapub send) and of one
   ``taco.progress`` iteration, turned into a cost per training step at the default send interval (``engine.SEND_S``);
2. the same training cell (``taco.progress`` + ``DistributedOptimizer``), alternately with the dashboard and with
   ``--no-dashboard``, timed on rank 0 around the loop only, and in the notebook around the whole cell;
3. in the notebook, the end-of-cell static rendering of the final picture (``Dashboard.static_bundle``: a
   self-contained HTML page with inline BokehJS) that replaces the live view: its time and size.

    .venv/bin/python benchmarks/dashboard_cost.py --ranks 4 --repeats 5 --steps 200
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import time

from IPython.testing.globalipapp import start_ipython

from taco_notebook.engine.calls import SEND_S as PUBLISH_S

PUBLISH = """\
import time as _t
from taco_notebook.engine import calls as _e
_e.begin_cell(True)
for _ in range(50):
    taco.metrics.step(samples=1)            # something to report
_began = _t.perf_counter()
for _ in range({n}):
    taco.metrics.send()
_publish_s = (_t.perf_counter() - _began) / {n}
_began = _t.perf_counter()
for _ in range({n}):
    pass
_plain = _t.perf_counter() - _began
_began = _t.perf_counter()
for _ in taco.progress(range({n})):
    pass
_iter_s = (_t.perf_counter() - _began - _plain) / {n}
(_publish_s, _iter_s)
"""

TRAIN = """\
import time as _t
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
opt = taco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                samples_per_step=64)
x, y = torch.randn(64, 256), torch.randn(64, 1)
_began = _t.perf_counter()
for step in taco.progress(range({steps})):
    opt.zero_grad(); nn.functional.mse_loss(model(x), y).backward(); opt.step()
{steps} / (_t.perf_counter() - _began)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="training cells per variant, alternating")
    parser.add_argument("--steps", type=int, default=200, help="training steps per cell")
    parser.add_argument("--calls", type=int, default=2000, help="publishes / iterations timed on the ranks")
    args = parser.parse_args()
    os.environ["TACO_DASHBOARD"] = "widget"

    ip = start_ipython()
    ip.run_line_magic("load_ext", "taco_notebook")
    quiet = contextlib.redirect_stdout(io.StringIO())
    with quiet, contextlib.redirect_stderr(io.StringIO()):
        ip.run_line_magic("taco_cluster", f"start -n {args.ranks} --cluster bench")
        costs = ip.run_cell_magic("taco_run", "--cluster bench --gather --no-dashboard",
                                  PUBLISH.format(n=args.calls))
        rates: dict[str, list[float]] = {"dashboard": [], "--no-dashboard": []}
        cells: dict[str, list[float]] = {"dashboard": [], "--no-dashboard": []}
        ip.run_cell_magic("taco_run", "--cluster bench --no-dashboard", TRAIN.format(steps=20))  # warm-up
        for _ in range(args.repeats):
            for variant, line in (("dashboard", ""), ("--no-dashboard", "--no-dashboard")):
                began = time.perf_counter()
                rate = ip.run_cell_magic("taco_run", f"--cluster bench {line}", TRAIN.format(steps=args.steps))
                cells[variant].append(time.perf_counter() - began)
                rates[variant].append(rate)
        ip.run_line_magic("taco_cluster", "stop --cluster bench")

    publish_us = statistics.median(c[0] for c in costs) * 1e6
    iter_us = statistics.median(c[1] for c in costs) * 1e6
    print(f"### Dashboard cost on the ranks ({args.ranks} ranks, median over ranks of {args.calls} calls)\n")
    print("| step time | publishes per step | cost per step | share of the step |")
    print("|---|---|---|---|")
    for step_ms in (5, 20, 100, 1000):
        per_step = min(1.0, step_ms / (PUBLISH_S * 1000))  # at most one publish per PUBLISH_S
        cost_us = per_step * publish_us + iter_us
        print(f"| {step_ms} ms | {per_step:.2f} | {cost_us:.1f} µs | {cost_us / (step_ms * 10):.3f} % |")
    print(f"\none publish: {publish_us:.0f} µs; one taco.progress iteration: {iter_us:.2f} µs\n")

    on, off = statistics.median(rates["dashboard"]), statistics.median(rates["--no-dashboard"])
    print(f"### Training cell, {args.ranks} ranks, {args.steps} steps, {args.repeats} alternating repeats\n")
    print("| variant | steps/s (median) | all runs |")
    print("|---|---|---|")
    for variant, runs in rates.items():
        print(f"| {variant} | {statistics.median(runs):.1f} | {', '.join(f'{r:.1f}' for r in runs)} |")
    print(f"\ndashboard vs --no-dashboard: {100 * (on / off - 1):+.1f} % steps/s")
    whole = {variant: statistics.median(runs) for variant, runs in cells.items()}
    print(f"whole cell in the notebook (median): {whole['dashboard']:.2f} s with the dashboard, "
          f"{whole['--no-dashboard']:.2f} s without\n")
    render_s, size = _static_rendering_cost()
    print(f"end-of-cell static rendering: {render_s * 1e3:.0f} ms (median of 5), {size / 1e6:.2f} MB of HTML")


def _static_rendering_cost() -> tuple[float, int]:
    """Time ``static_bundle()`` of the last cell's dashboard, as the cell's end does once."""
    from taco_notebook.widgets.dashboard import last_dashboard

    board = last_dashboard()
    assert board is not None, "no dashboard: the training cells reported nothing"
    times, size = [], 0
    for _ in range(5):
        began = time.perf_counter()
        size = len(board.static_bundle()["text/html"])
        times.append(time.perf_counter() - began)
    return statistics.median(times), size


if __name__ == "__main__":
    main()
