"""``taco.tune`` on 2 emulated nodes x 2 ranks behind 1 Gbit/s links (root; skipped with the reason otherwise):
benchmarks/advisor.py with a small MLP and few steps, so the run stays short on 2 cores. What it asserts is what the
links make true whatever the machine's speed: every candidate measured, the compressed ones sending fewer bytes,
the cross-node rate under the link's, the parameters back at the commit. Whether compression *pays* is a speed
question: benchmarks/README.md has the full 25M-parameter tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ..support.mpirun import run_in_session
from .test_emulated import needs_hydra

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.services
@needs_hydra
@pytest.mark.timeout(600, method="signal")
def test_the_advisor_measures_every_candidate_across_shaped_links(tmp_path: Path) -> None:
    out = tmp_path / "advisor.json"
    result = run_in_session(
        [sys.executable, str(BENCHMARKS / "advisor.py"), "--rate", "1gbit", "--hidden-layers", "0", "--steps", "2",
         "--candidates", "none", "fp16", "topk:0.01", "--timeout", "500", "--out", str(out)],
        timeout=560, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stdout + result.stderr
    saved = json.loads(out.read_text())
    assert saved["meta"]["emulated"] and saved["result"]["nodes"] == 2 and saved["result"]["restored"] is True
    rows = {row["candidate"]: row for row in saved["result"]["rows"]}
    assert list(rows) == ["none", "fp16", "topk:0.01"]
    none = rows["none"]["wire_bytes_per_step"]
    assert abs(rows["fp16"]["wire_bytes_per_step"] / none - 0.5) < 0.02
    assert rows["topk:0.01"]["wire_bytes_per_step"] < 0.1 * none
    link = 1e9 / 8
    for row in rows.values():  # bytes per second of communication cannot beat the shaped link
        assert 0 < row["link_bytes_per_s"] < 1.05 * link, row
    assert saved["result"]["best"] in rows and "| none |" in result.stdout
