"""PowerSGD (``powersgd:RANK``): the compressor on real tensors, on 4 real mpiexec ranks, and in ``%%taco_run``."""

from __future__ import annotations

import re

import pytest
import torch

from taco_notebook.comm.compression.compressors import PowerSGDCompressor, parse_compression
from taco_notebook.comm.compression.powersgd import (
    DEFAULT_POWERSGD_MIN_SIZE,
    DEFAULT_POWERSGD_WARMUP,
    PowerSGDContext,
    matrix_shape,
)
from taco_notebook.comm.compression.spec import CompressionSpec
from taco_notebook.comm.config import compressor_for

from ..support.mpirun import run_mpi


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _psgd(rank: int = 4, **options: int) -> PowerSGDCompressor:
    return PowerSGDCompressor(rank, **{"warmup": 0, "min_size": 0, **options})


def _round_trip(c: PowerSGDCompressor, t: torch.Tensor, key: str = "g") -> torch.Tensor:
    payload, ctx = c.compress(t, key)
    return c.decompress(payload, ctx)


# --- the factorisation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(64, 48), (64, 8, 6)])
def test_rank1_gradient_is_exact_and_leaves_no_residual(shape: tuple[int, ...]) -> None:
    t = torch.outer(_randn(shape[0], seed=1), _randn(48, seed=2)).reshape(shape)
    c = _psgd(4)
    payload, ctx = c.compress(t, "g")
    p, q = payload
    assert (p.shape, q.shape) == ((64, 4), (48, 4)) and ctx.lowrank
    torch.testing.assert_close(c.decompress(payload, ctx), t, rtol=1e-5, atol=1e-5)
    assert float(c.state.residuals["g"].abs().max()) < 1e-5
    assert c.stats.wire_bytes == (64 + 48) * 4 * 4 and c.stats.raw_bytes == 64 * 48 * 4


def test_flat_buffer_is_viewed_as_a_near_square_matrix() -> None:
    assert [matrix_shape(torch.Size([n])) for n in (1, 4, 5, 99, 100, 101)] == [
        (1, 1), (2, 2), (2, 3), (10, 10), (10, 10), (10, 11)]
    assert matrix_shape(torch.Size([6, 5, 4])) == (6, 20)
    square = torch.outer(_randn(50, seed=3), _randn(50, seed=4))
    torch.testing.assert_close(_round_trip(_psgd(2), square.reshape(-1)), square.reshape(-1), rtol=1e-5, atol=1e-5)


def test_error_feedback_keeps_what_was_not_sent() -> None:
    g = _randn(40, 30, seed=5)
    c = _psgd(2)
    applied = torch.zeros_like(g)
    held: list[float] = []
    for step in range(1, 121):
        applied += _round_trip(c, g)
        residual = c.state.residuals["g"].view(40, 30)
        # sent + residual = every gradient seen so far
        torch.testing.assert_close(applied + residual, step * g, rtol=1e-4, atol=1e-3)
        held.append(float(residual.norm() / g.norm()))
    # The residual stays bounded (rank 2 of a random 40x30 holds ~8 steps' worth back), so its share shrinks.
    assert max(held[60:]) < 10 and max(held[60:]) < 1.2 * max(held[:60]), held[::10]
    assert float((applied - 120 * g).norm() / (120 * g).norm()) < 0.1
    plain = PowerSGDCompressor(2, warmup=0, min_size=0, error_feedback=False)
    lost = sum(_round_trip(plain, g) for _ in range(120))
    assert float((lost - 120 * g).norm() / (120 * g).norm()) > 0.5 and plain.state.residuals == {}


def test_warm_start_converges_to_the_best_rank_r_approximation() -> None:
    u, s, v = torch.linalg.svd(_randn(60, 40, seed=6), full_matrices=False)
    m = u @ torch.diag(s * torch.logspace(0, -2, 40)) @ v  # a decaying spectrum
    best = float((m - u[:, :3] @ torch.diag((s * torch.logspace(0, -2, 40))[:3]) @ v[:3]).norm())
    c = PowerSGDCompressor(3, warmup=0, min_size=0, error_feedback=False)
    errors = [float((_round_trip(c, m) - m).norm()) for _ in range(15)]
    assert errors[-1] <= 1.01 * best < errors[0], (errors, best)
    assert c.state.qs["g"].shape == (40, 3)


def test_first_q_is_the_same_on_every_rank() -> None:
    t = _randn(30, 20, seed=7)
    a, b = _round_trip(_psgd(2), t), _round_trip(_psgd(2), t)
    assert torch.equal(a, b)
    assert not torch.equal(a, _round_trip(PowerSGDCompressor(2, warmup=0, min_size=0, seed=1), t))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes_compute_in_float32_or_float64_and_come_back(dtype: torch.dtype) -> None:
    t = torch.outer(_randn(32, seed=8), _randn(32, seed=9)).to(dtype)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    c = _psgd(2)
    payload, _ = c.compress(t, "g")
    assert payload[0].dtype == payload[1].dtype == c.state.residuals["g"].dtype == compute
    plain = PowerSGDCompressor(2, warmup=0, min_size=0, error_feedback=False)
    for _ in range(3):  # the seeded first Q is nearly orthogonal to this t's rows: warm start fixes that
        payload, ctx = plain.compress(t, "g")
    out = plain.decompress(payload, ctx)
    assert out.dtype == dtype and out.shape == t.shape
    torch.testing.assert_close(out, t, rtol=1e-2, atol=1e-2)


def test_small_warming_up_integer_and_incompressible_tensors_travel_dense() -> None:
    c = PowerSGDCompressor(4)
    assert (c.state.warmup, c.state.min_size) == (DEFAULT_POWERSGD_WARMUP, DEFAULT_POWERSGD_MIN_SIZE)
    small = _randn(100, 100)
    payload, ctx = c.compress(small, "small")
    assert payload is small and ctx == PowerSGDContext(small.shape, small.dtype, 100, 100, lowrank=False)
    assert c.decompress(payload, ctx) is small
    big = _randn(300, 300)
    for step in range(DEFAULT_POWERSGD_WARMUP):
        assert c.compress(big, "big")[0] is big, step
    assert isinstance(c.compress(big, "big")[0], list)  # warm-up over
    ints = torch.arange(100_000)
    assert _psgd().compress(ints, "i")[0] is ints
    thin = _randn(1000, 7)  # (1000 + 7) * 4 * 2 > 7000: factors would not halve the bytes
    assert _psgd(4).compress(thin, "thin")[0] is thin


def test_does_not_modify_its_input_and_reset_forgets() -> None:
    t = _randn(20, 20, seed=10)
    before = t.clone()
    c = _psgd(2)
    for _ in range(3):
        _round_trip(c, t)
    assert torch.equal(t, before)
    assert set(c.state.residuals) == set(c.state.qs) == set(c.state.steps) == {"g"}
    c.state.reset("g")
    assert c.state.residuals == c.state.qs == c.state.steps == {}


def test_bad_use_is_a_clear_error_and_a_changed_key_starts_over() -> None:
    c = _psgd(2)
    with pytest.raises(ValueError, match="needs a key naming the tensor"):
        c.compress(_randn(20, 20))
    c.compress(_randn(20, 20), "g")
    c.compress(_randn(20, 20), "g")
    assert c.state.steps["g"] == 2
    # A key whose tensor changed size (DDP's rebuilt buckets, a new model in a re-run cell) starts over.
    t = torch.outer(_randn(30, seed=1), _randn(30, seed=2))
    torch.testing.assert_close(_round_trip(c, t), t, rtol=1e-5, atol=1e-5)
    assert c.state.steps["g"] == 1 and c.state.residuals["g"].numel() == 900 and c.state.qs["g"].shape == (30, 2)
    payload, ctx = c.compress(_randn(20, 20), "h")
    with pytest.raises(TypeError, match="needs a PowerSGDContext"):
        c.decompress(payload, None)
    with pytest.raises(ValueError, match=r"payload is \[P, Q\]"):
        c.decompress(_randn(3), ctx)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="powersgd rank must be an integer >= 1"):
            PowerSGDCompressor(bad)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (checks device placement and host syncs)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_stays_on_the_device_without_host_syncs(dtype: torch.dtype) -> None:
    t = torch.outer(_randn(512, seed=11), _randn(256, seed=12)).to("cuda", dtype)
    c = _psgd(4)
    c.compress(t, "g")  # the first call makes the seeded Q on the host and copies it over, once
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call from here on raises
    try:
        for _ in range(3):
            payload, ctx = c.compress(t, "g")
            out = c.decompress(payload, ctx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.device == t.device and out.dtype == dtype
    assert c.state.residuals["g"].device == t.device and c.state.residuals["g"].dtype == torch.float32
    torch.testing.assert_close(out.float(), t.float(), rtol=2e-2, atol=2e-2)


# --- specs ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "name", "state"), [
    ("powersgd:4", "powersgd:4", (4, DEFAULT_POWERSGD_WARMUP, DEFAULT_POWERSGD_MIN_SIZE)),
    (" PowerSGD:1:warmup=0 ", "powersgd:1:warmup=0", (1, 0, DEFAULT_POWERSGD_MIN_SIZE)),
    ("powersgd:2:min_size=0:warmup=5", "powersgd:2:warmup=5:min_size=0", (2, 5, 0)),
])
def test_spec_round_trip(spec: str, name: str, state: tuple[int, int, int]) -> None:
    c = parse_compression(spec)
    assert isinstance(c, PowerSGDCompressor) and c.name == name
    assert (c.state.rank, c.state.warmup, c.state.min_size) == state
    assert parse_compression(c.name).name == name
    assert compressor_for(spec) is compressor_for(name)  # one instance, so residuals persist
    assert compressor_for(CompressionSpec.parse(spec)) is compressor_for(name)  # for the text and the value


@pytest.mark.parametrize(("spec", "message"), [
    ("powersgd", "powersgd needs a rank (a positive integer), got 'powersgd'; use powersgd:RANK"),
    ("powersgd:", "powersgd needs a rank"),
    ("powersgd:0", "powersgd rank in 'powersgd:0' must be an integer >= 1, got '0'; use powersgd:RANK"),
    ("powersgd:x", "powersgd rank in 'powersgd:x' must be an integer >= 1, got 'x'"),
    ("powersgd:2.5", "must be an integer >= 1, got '2.5'"),
    ("powersgd:4:warmup=-1", "powersgd warmup in 'powersgd:4:warmup=-1' must be an integer >= 0"),
    ("powersgd:4:min_size=big", "powersgd min_size in 'powersgd:4:min_size=big' must be an integer >= 0"),
    ("powersgd:4:speed=2", "unknown powersgd option 'speed=2' in 'powersgd:4:speed=2'; use "
                           "powersgd:RANK[:warmup=N][:min_size=N] (e.g. powersgd:4)"),
    ("powersgd:4:warmup", "unknown powersgd option 'warmup'"),
    ("gzip", "unknown compression 'gzip'; use none, fp16, bf16 or topk:RATIO (e.g. topk:0.01), or "
             "powersgd:RANK (e.g. powersgd:4)"),
])
def test_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_compression(spec)
    assert message in str(info.value)


# --- real ranks -------------------------------------------------------------------------------------------


def test_powersgd_on_four_ranks_flat_and_2d(mpiexec):
    """Identical replicas, rank-1 exactness, half precision, error feedback, per-tensor layouts,
    DistributedOptimizer and DDP training (the checks are in tests/mpi/powersgd.py; ~60 s on 2 busy cores)."""
    result = run_mpi(mpiexec, 4, "powersgd.py", {"LIGHT_INTRA_SIZE": "2"}, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # mpiexec may run two ranks' lines together ("OK 0OK 1"): find each mark, not each line
    assert sorted(re.findall(r"OK (\d+)", result.stdout)) == [str(r) for r in range(4)]
    for line in ("flat: loss after 300 steps", "2d: loss after 300 steps", "momentum 0.9, per-tensor layout",
                 "2d shm=True, per-row layout", "2d shm=False, per-row layout"):
        assert line in result.stdout, result.stdout


@pytest.mark.cluster
def test_taco_run_compression_powersgd(ip):
    """``%%taco_run --compression powersgd:4`` reaches the ranks and a rank-1 cell comes through exactly."""
    cell = ("u = torch.linspace(-1, 1, 256)\n"
            "g = torch.outer(u, u.flip(0) * (taco.rank() + 1)).reshape(-1)\n"
            "want = torch.outer(u, u.flip(0) * 3).reshape(-1)\n"
            "taco.metrics.reset()\ntaco.allreduce(g)\n"
            "(taco.settings().compression, round(taco.metrics.snapshot()['compression_ratio']), "
            "float((g - want).abs().max()))")
    value = ip.run_cell_magic("taco_run", "-np 2 --cluster powersgd --compression powersgd:4:warmup=0", cell)
    assert value[0] == CompressionSpec.parse("powersgd:4:warmup=0")  # the ranks' setting, a value both ways
    assert value[1] == 256 * 256 // ((256 + 256) * 4)  # 32x fewer bytes crossed
    assert value[2] < 1e-4


# --- 2D shards cut on rows (taco_notebook/comm/compression/layout.py)


def test_row_cuts_round_equal_shares_to_row_boundaries() -> None:
    from taco_notebook.comm.compression.layout import pieces, row_cuts

    # a bucket as DistributedOptimizer packs an MLP (reversed): fc2.bias, fc2.weight, fc1.bias, fc1.weight
    shapes = [(1,), (1, 64), (64,), (64, 32)]
    assert row_cuts(shapes, 2) == [0, 1089, 2177]  # the share 1088 is 30.0 rows into fc1.weight
    assert pieces(shapes, 0, 1089) == (torch.Size([1]), torch.Size([1, 64]), torch.Size([64]), torch.Size([30, 32]))
    assert pieces(shapes, 1089, 2177) == (torch.Size([34, 32]),)
    assert pieces(shapes, 0, 1090) is None  # splits a row: not a cut of these shapes
    assert pieces(shapes, 0, 9999) is None
    # 4 parts, conv weights (rows of 3*3*16), a cut inside a 1-D tensor stays where the share is
    conv = [(32, 16, 3, 3), (32,), (5000,)]
    cuts = row_cuts(conv, 4)
    assert cuts == [0, 2448, 4820, 7230, 9640]  # 2410 is 16.7 rows of 144: 17; 4820 and 7230 fall in the 1-D
    parts = [pieces(conv, a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
    assert parts[0] == (torch.Size([17, 16, 3, 3]),) and parts[1][0] == torch.Size([15, 16, 3, 3])
    assert sum(torch.Size(s).numel() for part in parts for s in part) == 9640
    # one row larger than a share: parts may be empty, never out of order
    assert row_cuts([(2, 100)], 4) == [0, 0, 100, 200, 200]
    assert row_cuts([(3, 4)], 1) == [0, 12]
    with pytest.raises(ValueError, match="parts must be >= 1"):
        row_cuts([(3, 4)], 0)


def test_powersgd_asks_for_row_cuts_only_for_a_described_buffer() -> None:
    c = _psgd(2)
    assert c.shard_cuts("bucket", 2177, 2) is None
    c.describe_buffer("bucket", [(1,), (1, 64), (64,), (64, 32)])
    assert c.shard_cuts("bucket", 2177, 2) == [0, 1089, 2177]
    assert c.shard_cuts("bucket", 2000, 2) is None  # not the described size
    assert parse_compression("topk:0.01").shard_cuts("bucket", 2177, 2) is None


def test_batched_orthonormalisation_equals_one_qr_per_matrix() -> None:
    # One QR per distinct (shape, dtype) instead of one per weight: the same Q on CPU, to the bit.
    from taco_notebook.comm.compression.powersgd import orthonormal

    g = torch.Generator().manual_seed(3)
    ps = [torch.randn(64, 4, generator=g) for _ in range(5)] + [torch.randn(32, 4, generator=g),
                                                                  torch.randn(64, 4, generator=g, dtype=torch.float64)]
    ps.insert(2, torch.zeros(64, 4))  # a zero factor (a gradient of lower rank) still comes out orthonormal
    got = orthonormal(ps)
    assert all(torch.equal(a, torch.linalg.qr(p).Q) for a, p in zip(got, ps, strict=True))
    eye = torch.eye(4)
    assert all(torch.allclose(q.t() @ q, eye.to(q.dtype), atol=1e-5) for q in got)
