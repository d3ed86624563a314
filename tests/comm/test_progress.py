"""``taco.progress`` and the metrics sender on the rank side, without a cluster (pure Python)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from taco_notebook.comm.diagnostics import metrics
from taco_notebook.comm.diagnostics.progress import progress

from ..support.waiting import wait_until

INTERVAL = 0.05


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    sent: list[dict[str, Any]] = []
    metrics.reset()
    metrics.set_sender(sent.append, interval=INTERVAL)
    yield sent
    metrics.set_sender(None)
    metrics.reset()


@pytest.fixture
def published_at() -> Iterator[list[tuple[float, dict[str, Any]]]]:
    """Each send with the clock read when it arrived (the same ``perf_counter`` the throttle reads)."""
    sent: list[tuple[float, dict[str, Any]]] = []
    metrics.reset()
    metrics.set_sender(lambda payload: sent.append((time.perf_counter(), payload)), interval=INTERVAL)
    yield sent
    metrics.set_sender(None)
    metrics.reset()


def test_progress_within_one_interval_sends_once_at_the_end(published):
    """Throttled by count, not by the machine's speed: with the interval far longer than the loop, 40 iterations
    (and 40 ``step()`` calls) send nothing until the loop ends, then exactly once, with the final count."""
    metrics.set_sender(published.append, interval=3600.0)
    metrics.send()  # the interval starts now (set_sender's clock starts at 0, the machine's uptime decides)
    assert len(published) == 1
    for _ in progress(range(40), desc="train"):
        metrics.step(samples=8)
    assert len(published) == 2, [p["progress"] for p in published]
    last = published[-1]
    assert {k: last["progress"][k] for k in ("n", "total", "desc")} == {"n": 40, "total": 40, "desc": "train"}
    assert last["metrics"]["steps"] == 40 and last["metrics"]["samples"] == 320


def test_progress_sends_the_count_once_the_interval_has_passed(published_at):
    """The throttle lets a send through on the first iteration after an interval has passed since the last one,
    carrying that iteration's count: the loop waits for that event (the interval elapsed since the last send
    arrived) at iterations 10 and 25, instead of sleeping a fixed time per iteration and counting sends."""

    def interval_passed() -> bool:
        return time.perf_counter() - published_at[-1][0] >= INTERVAL

    metrics.send()
    began = time.perf_counter()
    for i in progress(range(40), desc="train"):
        metrics.step(samples=8)  # may send too (step() is throttled by the same clock), with the count so far
        if i + 1 in (10, 25):
            wait_until(interval_passed, 10, f"an interval of {INTERVAL} s after the last send")
    ended = time.perf_counter()
    counts = [p["progress"]["n"] for _, p in published_at if p["progress"]]
    assert 10 in counts and 25 in counts, counts
    assert counts == sorted(counts) and counts[-1] == 40
    last = published_at[-1][1]
    assert last["metrics"]["steps"] == 40 and last["metrics"]["samples"] == 320
    elapsed = [p["progress"]["elapsed_seconds"] for _, p in published_at if p["progress"]]
    assert elapsed == sorted(elapsed) and 0 < elapsed[-1] <= ended - began, (elapsed, ended - began)


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


def test_the_series_records_the_counters_at_a_fixed_cadence_and_the_moment_of_a_snapshot():
    metrics.reset()
    time.sleep(0.2)  # building the model: the first step's samples must not be spread back over this
    for _ in progress(range(60)):
        time.sleep(0.01)
        metrics.record(0.001, 1000, 250, {1: 250})
        metrics.step(samples=8)
    snap = metrics.snapshot()
    series = snap["series"]
    assert tuple(series["fields"]) == metrics.SERIES_FIELDS
    records = series["records"]
    assert len(records) <= metrics.SERIES_SENT and series["first"] + len(records) >= 12  # >= 0.6 s at 20/s
    times = [r[0] for r in records]
    assert times == sorted(times) and all(b - a < 0.2 for a, b in zip(times[1:], times[2:], strict=False))
    assert records[-1][1:] == [60, 60, 480, 0, 60_000, 15_000]  # the moment of the snapshot: every counter
    if series["first"] == 0:
        first_step = next(r for r in records if r[1] > 0)
        idle = records[records.index(first_step) - 1]
        assert idle[0] >= 0.19 and idle[1] == 0  # "nothing happened until the first step began"
    metrics.reset()
    assert metrics.snapshot()["series"]["records"] == [[0.0, 0, 0, 0, 0, 0, 0]]
