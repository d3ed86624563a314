"""``taco.progress`` and the metrics sender on the rank side, without a cluster (pure Python)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from taco_notebook.comm import metrics
from taco_notebook.comm.progress import progress


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    sent: list[dict[str, Any]] = []
    metrics.reset()
    metrics.set_sender(sent.append, interval=0.05)
    yield sent
    metrics.set_sender(None)
    metrics.reset()


def test_progress_publishes_throttled_and_once_more_at_the_end(published):
    for _ in progress(range(40), desc="train"):
        time.sleep(0.005)  # 40 x 5 ms = 0.2 s: about 4 throttled sends, not 40
        metrics.step(samples=8)
    assert 2 <= len(published) <= 12, len(published)
    last = published[-1]
    assert last["progress"] == {"n": 40, "total": 40, "desc": "train", "elapsed_seconds": pytest.approx(0.2, abs=0.2)}
    assert last["metrics"]["steps"] == 40 and last["metrics"]["samples"] == 320
    counts = [p["progress"]["n"] for p in published if p["progress"]]
    assert counts == sorted(counts)


def test_progress_without_a_total_and_after_an_exception(published):
    def numbers() -> Iterator[int]:
        yield from range(3)
        raise RuntimeError("loader broke")

    seen = []
    with pytest.raises(RuntimeError, match="loader broke"):
        for i in progress(numbers()):
            seen.append(i)
    assert seen == [0, 1, 2]
    assert published[-1]["progress"]["n"] == 3 and published[-1]["progress"]["total"] is None


@pytest.mark.parametrize("total", [-1, 2.5, "10"])
def test_bad_total_is_a_clear_error(total):
    with pytest.raises(ValueError, match="total must be a non-negative integer"):
        progress([], total=total)


def test_without_a_publisher_rank_zero_prints_like_tqdm(capsys):
    metrics.set_sender(None)
    for _ in progress(range(3), desc="eval", print_every=0.0):
        pass
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("eval: 3/3 [") and err[-1].endswith("it/s]")


def test_bad_publish_interval_is_rejected():
    with pytest.raises(ValueError, match="interval must be a positive number of seconds"):
        metrics.set_sender(print, interval=0)


def test_snapshot_reports_tokens():
    metrics.reset()
    metrics.step(samples=4, tokens=512)
    assert metrics.snapshot()["tokens"] == 512
    metrics.reset()
