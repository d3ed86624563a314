"""``taco.tune`` from a notebook cell and ``%%taco_run --compression auto`` on a real 4-rank cluster: auto runs
uncompressed (saying so) before any tune, the tune's result comes back drawn as a table, and later auto cells
use its choice."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.cluster

SETUP = """
import torch, torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
opt = taco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
state = taco.elastic.State(model=model, optimizer=opt, step=0)
gen = torch.Generator().manual_seed(taco.rank())
data = [(torch.randn(8, 16, generator=gen), torch.randint(0, 2, (8,), generator=gen)) for _ in range(4)]
def step():
    x, y = data[state.step % 4]
    opt.zero_grad(); loss = F.cross_entropy(model(x), y); loss.backward(); opt.step(); state.step += 1
    return loss
before = [p.detach().clone() for p in model.parameters()]
"""
FORGET = "from taco_notebook.comm.training import advisor\nadvisor.forget()"


def test_auto_before_and_after_a_tune(ip: Any, shared_cluster: Any, capfd: pytest.CaptureFixture[str]) -> None:
    run = ip.run_cell_magic
    try:
        run("taco_run", "--no-dashboard", FORGET)
        capfd.readouterr()
        assert run("taco_run", "--no-dashboard --compression auto", "taco.settings().compression.name") == "none"
        out = capfd.readouterr().out
        assert "[taco] --compression auto: none (no taco.tune result on this cluster yet" in out
        assert out.count("[taco] --compression auto") == 1, out  # rank 0 says it, once

        run("taco_run", "--no-dashboard", SETUP)
        result = run("taco_run", "--no-dashboard",
                     "taco.tune(step, state, candidates=['fp16', 'bf16'], steps=2)")
        assert type(result).__name__ == "TuneResult"
        assert [row["candidate"] for row in result.rows()] == ["none", "fp16", "bf16"]
        assert result.best in ("none", "fp16", "bf16") and result.ranks == 4
        html = ip.display_formatter.formatters["text/html"].lookup(result)(result)  # what a notebook shows
        assert html.count("<tr") == 4 and f"uses <b>{result.best}</b>" in html
        # every rank is back at the commit
        assert run("taco_run", "--no-dashboard --gather",
                   "all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and state.step == 0"
                   ) == [True] * 4

        capfd.readouterr()
        assert run("taco_run", "--no-dashboard --compression auto",
                   "taco.settings().compression.name") == result.best
        assert f"[taco] --compression auto: {result.best} (taco.tune's choice" in capfd.readouterr().out
        assert run("taco_run", "--no-dashboard", "taco.settings().compression.name") != "auto"  # reset after
    finally:
        run("taco_run", "--no-dashboard", FORGET)
