"""benchmarks/perf_model.py: docs/performance-model.md's tables are its output, and its link model holds on
the emulated-node runs it is checked against (the page says it does)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import perf_model  # noqa: E402


def test_the_page_tables_are_the_scripts_output():
    page = perf_model.page_blocks(perf_model.PAGE.read_text(encoding="utf-8"))
    assert page == perf_model.generated_blocks(), "run: python benchmarks/perf_model.py and paste its blocks"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "perf_model.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "matches" in result.stdout, result.stdout + result.stderr


def test_the_link_model_predicts_dense_and_fp16_2d_within_five_percent():
    rows = perf_model.emulated_rows()
    alpha, beta = perf_model.fit_link(rows)
    assert 0.9 < beta * 1000 / 125e6 < 1.0, "gloo's fitted rate is 90-100% of the 1 Gbit/s link"
    for row in rows:
        share = {"taco 2d": 1.0, "taco 2d+fp16": 0.5}.get(str(row["variant"]))
        if share is None or float(row["size_mib"]) < 16:
            continue
        predicted = alpha + share * float(row["size_mib"]) * 2**20 / beta
        assert 1.0 <= float(row["s"]) * 1000 / predicted < 1.05, row


def test_resnet50_and_the_transformer_have_their_published_sizes():
    import math

    assert sum(math.prod(s) for s in perf_model.resnet50_shapes()) == 25_557_032  # torchvision's resnet50
    assert abs(sum(math.prod(s) for s in perf_model.transformer_shapes()) - 354.8e6) < 0.1e6  # GPT-2 medium


def test_where_taco_loses_is_where_the_page_says():
    resnet = perf_model.models()[0]
    fast = perf_model.step_ms(resnet, "DDP", 32, 100)
    assert perf_model.step_ms(resnet, "taco 2d", 32, 100) > fast  # fast link, small model
    slow = perf_model.step_ms(resnet, "DDP", 2, 25)
    assert perf_model.step_ms(resnet, "taco 2d", 2, 25) < slow / 1.5  # slow link, 2 nodes: half the NIC bytes
