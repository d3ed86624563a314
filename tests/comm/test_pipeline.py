"""The pipelined 2D allreduce's pure parts: chunk geometry, the chunk size from measured speeds, its setting.

The pipeline itself runs under mpiexec in ``tests/mpi/training.py`` (forced small chunks: exact for none,
tolerance for casts, identical replicas for TopK and PowerSGD).
"""

from __future__ import annotations

import time

import pytest

from taco_notebook.comm.config import configure, settings
from taco_notebook.comm.specs import check_chunk_mb, chunk_mb_from_env
from taco_notebook.comm.transport.pipeline import Calibration, _timed, chunk_bounds


def test_chunks_cover_the_buffer_in_multiples_of_the_local_size() -> None:
    assert chunk_bounds(10, 4, 2) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(10, 5, 2) == [(0, 4), (4, 8), (8, 10)]  # rounded down to a multiple of 2
    assert chunk_bounds(3, 1, 4) == [(0, 3)]  # at least one element per local rank
    assert chunk_bounds(0, 8, 2) == [(0, 0)]
    # a buffer its chunk covers goes whole, not as 2176 elements and a tail of 1 (an odd-sized bucket went
    # in two chunks: two cross-node rounds, and PowerSGD/TopK state keyed per chunk)
    assert chunk_bounds(2177, 2177, 2) == [(0, 2177)]
    assert chunk_bounds(7, 100, 4) == [(0, 7)]
    bounds = chunk_bounds(1_000_003, 65_536, 3)
    assert bounds[0] == (0, 65_535) and bounds[-1][1] == 1_000_003
    assert all(a[1] == b[0] for a, b in zip(bounds[:-1], bounds[1:], strict=True))


def test_chunk_size_grows_with_the_buffer_and_the_overhead() -> None:
    calibration = Calibration(pass_bytes_per_s=4e9, chunk_overhead_s=1e-3, link_bytes_per_s=1.2e8)
    mib = 1 << 20
    small, mid, large = (calibration.chunk_bytes(n * mib) for n in (3, 16, 100))
    assert small == 3 * mib  # under two chunks' worth (at least 2 MiB each): whole
    assert mid < 16 * mib and large > mid  # C = sqrt(S * overhead * speed / 2)
    assert abs(large - (100 * mib * 1e-3 * 4e9 / 2) ** 0.5) < 1
    slower = Calibration(4e9, 1e-2, 1.2e8)
    assert slower.chunk_bytes(100 * mib) > large  # a costlier chunk: fewer, larger chunks
    assert Calibration(1e12, 1.0, 1e8).chunk_bytes(1 << 40) == 64 * mib  # capped


def test_calibration_takes_the_best_of_its_runs() -> None:
    """A fixed cost read on a loaded host: the late runs (a peer arriving late, a descheduled thread) must not
    be what sizes the chunks; the fastest run is the cost itself."""
    delays = iter([0.08, 0.01, 0.05, 0.06, 0.07])
    assert 0.01 <= _timed(lambda: time.sleep(next(delays)), 5) < 0.04


@pytest.mark.parametrize("raw, want", [(None, None), ("auto", None), (" AUTO ", None), (0, 0.0), ("2.5", 2.5)])
def test_chunk_mb_accepts_auto_zero_and_sizes(raw: object, want: float | None) -> None:
    assert check_chunk_mb(raw) == want  # type: ignore[arg-type]


@pytest.mark.parametrize("raw", [-1, "big", "nan", float("inf"), True])
def test_chunk_mb_refuses_the_rest_naming_the_setting(raw: object) -> None:
    with pytest.raises(ValueError, match="pipeline chunk size must be 'auto' or a number of MiB >= 0"):
        check_chunk_mb(raw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="TACO_CHUNK_MB must be 'auto'"):
        chunk_mb_from_env({"TACO_CHUNK_MB": str(raw)})


def test_configure_sets_and_resets_the_chunk_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TACO_CHUNK_MB", "8")
    try:
        assert configure(reset=True).chunk_mb == 8.0
        assert configure(chunk_mb=0).chunk_mb == 0.0
        assert configure(chunk_mb="auto").chunk_mb is None
        assert settings().chunk_mb is None
    finally:
        monkeypatch.delenv("TACO_CHUNK_MB")
        configure(reset=True)


def test_a_dropped_optimizer_is_freed(mpiexec: str) -> None:
    """Rebuilding a DistributedOptimizer in a notebook cell must not keep the old one's buffers (the train
    benchmark's ranks grew ~450 MB per variant until one was OOM-killed)."""
    from tests.support.mpirun import run_mpi

    result = run_mpi(mpiexec, 1, "optimizer_release.py", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK 0" in result.stdout, result.stdout
