"""Tests of taco_notebook.comm.compression.compressors on real torch tensors (single process, no ranks needed)."""

from __future__ import annotations

import math

import pytest
import torch

from taco_notebook.comm.compression.compressors import (
    DEFAULT_TOPK_THRESHOLD,
    BF16Compressor,
    CompressionStats,
    Compressor,
    FP16Compressor,
    NoneCompressor,
    TopKCompressor,
    TopKContext,
    build,
    parse_compression,
)
from taco_notebook.comm.compression.spec import CompressionSpec
from taco_notebook.comm.config import configure, settings
from taco_notebook.comm.specs import (
    algorithm_from_env,
    fusion_mb_from_env,
    parse_flag,
    shm_from_env,
    timeout_from_env,
)

FLOAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _round_trip(c: Compressor, t: torch.Tensor, key: str = "g") -> torch.Tensor:
    payload, ctx = c.compress(t, key)
    return c.decompress(payload, ctx)


# --- none, fp16, bf16 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + [torch.int64])
def test_none_round_trip_is_exact(dtype: torch.dtype) -> None:
    t = _randn(7, 3, dtype=torch.float64).mul(100).to(dtype)
    out = _round_trip(NoneCompressor(), t)
    assert out.dtype == dtype and torch.equal(out, t)


@pytest.mark.parametrize(("cls", "wire", "rtol"),
                         [(FP16Compressor, torch.float16, 1e-3), (BF16Compressor, torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cast_round_trip_within_tolerance_and_dtype_restored(
        cls: type[Compressor], wire: torch.dtype, rtol: float, dtype: torch.dtype) -> None:
    t = _randn(1001, dtype=dtype)
    c = cls()
    payload, ctx = c.compress(t)
    assert isinstance(payload, torch.Tensor) and payload.dtype == wire
    assert c.wire_bytes(payload) == 1001 * 2
    out = c.decompress(payload, ctx)
    assert out.dtype == dtype and out.shape == t.shape
    torch.testing.assert_close(out, t, rtol=rtol, atol=1e-6)
    assert c.stats.raw_bytes == 1001 * t.element_size() and c.stats.wire_bytes == 2002


@pytest.mark.parametrize("cls", [FP16Compressor, BF16Compressor])
def test_cast_leaves_integer_tensors_untouched(cls: type[Compressor]) -> None:
    t = torch.arange(10, dtype=torch.int32)
    payload, ctx = cls().compress(t)
    assert payload is t and ctx is None
    assert cls().decompress(payload, ctx) is t


def test_bf16_keeps_range_fp16_overflows() -> None:
    t = torch.tensor([1e6, -3e38], dtype=torch.float32)
    assert torch.isinf(_round_trip(FP16Compressor(), t)).all()
    torch.testing.assert_close(_round_trip(BF16Compressor(), t), t, rtol=8e-3, atol=0)


# --- TopK -------------------------------------------------------------------------------------------------


def test_topk_sends_k_largest_magnitudes() -> None:
    t = _randn(1000)
    c = TopKCompressor(0.013, threshold=0)
    payload, ctx = c.compress(t, "g")
    values, indices = payload
    k = math.ceil(0.013 * 1000)
    assert values.numel() == indices.numel() == k == c.num_selected(1000)
    assert not indices.is_floating_point()
    expected = set(torch.topk(t.abs(), k).indices.tolist())
    assert set(indices.tolist()) == expected
    torch.testing.assert_close(values, t[indices.long()], rtol=0, atol=0)
    assert ctx == TopKContext(t.shape, t.dtype, sparse=True)
    assert c.wire_bytes(payload) == k * (4 + 4) < t.numel() * 4
    assert c.stats.ratio == pytest.approx(4000 / (k * 8))


def test_topk_decompress_scatters_into_zeros() -> None:
    t = _randn(6, 50)
    c = TopKCompressor(0.1, threshold=0, error_feedback=False)
    out = _round_trip(c, t)
    assert out.shape == t.shape and out.dtype == t.dtype
    sent = out != 0
    assert int(sent.sum()) == 30
    torch.testing.assert_close(out[sent], t[sent], rtol=0, atol=0)
    assert t[~sent].abs().max() <= t[sent].abs().min()


def test_topk_k_is_at_least_one() -> None:
    values, indices = TopKCompressor(1e-6, threshold=0).compress(_randn(10), "g")[0]
    assert values.numel() == indices.numel() == 1


def test_topk_below_threshold_passes_dense_unchanged() -> None:
    t = _randn(999)
    c = TopKCompressor(0.01, threshold=1000)
    payload, ctx = c.compress(t, "g")
    assert payload is t and ctx.sparse is False
    assert c.decompress(payload, ctx) is t
    assert c.state.residuals == {}
    assert c.stats.ratio == 1.0
    assert TopKCompressor(0.01).state.threshold == DEFAULT_TOPK_THRESHOLD == 2_097_152


def test_topk_error_feedback_carries_the_residual() -> None:
    g = _randn(200)
    steps = 400
    with_ef = TopKCompressor(0.05, threshold=0)
    without_ef = TopKCompressor(0.05, threshold=0, error_feedback=False)
    sum_ef, sum_plain = torch.zeros(200), torch.zeros(200)
    for _ in range(steps):
        sum_ef += _round_trip(with_ef, g)
        sum_plain += _round_trip(without_ef, g)
    truth = steps * g
    # Nothing is lost: what was applied plus what is still held back equals every gradient seen.
    torch.testing.assert_close(sum_ef + with_ef.state.residuals["g"], truth, rtol=1e-4, atol=1e-3)
    rel_ef = float((sum_ef - truth).norm() / truth.norm())
    rel_plain = float((sum_plain - truth).norm() / truth.norm())
    assert rel_ef < 0.05, rel_ef
    assert rel_plain > 0.5, rel_plain
    assert without_ef.state.residuals == {}


def test_topk_residual_is_per_key_and_resettable() -> None:
    c = TopKCompressor(0.1, threshold=0)
    a, b = _randn(100, seed=1), _randn(30, seed=2)
    c.compress(a, "a")
    c.compress(b, "b")
    assert set(c.state.residuals) == {"a", "b"}
    assert c.state.residuals["a"].numel() == 100 and c.state.residuals["b"].numel() == 30
    c.state.reset("a")
    assert set(c.state.residuals) == {"b"}
    c.state.reset()
    assert c.state.residuals == {}
    # After a reset the next step sends the plain top-k again, as on the first step.
    values, _ = c.compress(a, "a")[0]
    torch.testing.assert_close(values.abs().sort().values, torch.topk(a.abs(), 10).values.sort().values)


def test_topk_merge_equals_dense_sum_of_ranks() -> None:
    c = TopKCompressor(0.05, threshold=0, error_feedback=False)
    grads = [_randn(4, 25, seed=r) for r in range(4)]
    compressed = [c.compress(g, "g") for g in grads]
    payloads = [p for p, _ in compressed]
    ctx = compressed[0][1]
    merged = TopKCompressor.merge(payloads, ctx)
    dense_sum = sum(c.decompress(p, x) for p, x in compressed)
    assert merged.shape == (4, 25)
    torch.testing.assert_close(merged, dense_sum, rtol=0, atol=0)
    # Overlapping indices add up: all ranks sending the same tensor give 4x its top-k.
    same = [c.compress(grads[0], "g")[0] for _ in range(4)]
    torch.testing.assert_close(TopKCompressor.merge(same, ctx), 4 * c.decompress(same[0], ctx))


def test_topk_merge_of_dense_payloads() -> None:
    c = TopKCompressor(0.05)
    grads = [_randn(3, 5, seed=r) for r in range(3)]
    compressed = [c.compress(g, "g") for g in grads]
    merged = TopKCompressor.merge([p for p, _ in compressed], compressed[0][1])
    torch.testing.assert_close(merged, grads[0] + grads[1] + grads[2])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_topk_all_float_dtypes(dtype: torch.dtype) -> None:
    t = _randn(2, 501, dtype=dtype)
    c = TopKCompressor(0.01, threshold=0)
    payload, ctx = c.compress(t, "g")
    assert payload[0].dtype == dtype and ctx.dtype == dtype
    out = c.decompress(payload, ctx)
    assert out.dtype == dtype and out.shape == t.shape and int((out != 0).sum()) == 11
    assert c.state.residuals["g"].dtype == dtype


def test_topk_non_contiguous_input() -> None:
    base = _randn(40, 30)
    t = base.t()[:, ::2]
    assert not t.is_contiguous()
    before = t.clone()
    c = TopKCompressor(0.1, threshold=0)
    out = _round_trip(c, t)
    assert torch.equal(t, before), "compress must not modify its input"
    assert out.shape == t.shape
    sent = out != 0
    assert int(sent.sum()) == 60
    torch.testing.assert_close(out[sent], t[sent], rtol=0, atol=0)
    torch.testing.assert_close(out + c.state.residuals["g"].reshape(t.shape), t)


def test_topk_does_not_modify_contiguous_input_across_steps() -> None:
    t = _randn(100)
    before = t.clone()
    c = TopKCompressor(0.05, threshold=0)
    for _ in range(3):
        _round_trip(c, t)
    assert torch.equal(t, before)


@pytest.mark.parametrize("cls", [NoneCompressor, FP16Compressor, BF16Compressor])
@pytest.mark.parametrize("shape", [(0,), (3, 0), (), (1,), (7,), (3, 5, 7)])
def test_edge_shapes_for_dense_compressors(cls: type[Compressor], shape: tuple[int, ...]) -> None:
    t = torch.rand(shape, generator=torch.Generator().manual_seed(3))
    out = _round_trip(cls(), t)
    assert out.shape == t.shape and out.dtype == t.dtype
    torch.testing.assert_close(out, t, rtol=8e-3, atol=0)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (), (1,), (7,), (3, 5, 7)])
def test_edge_shapes_for_topk(shape: tuple[int, ...]) -> None:
    t = torch.rand(shape, generator=torch.Generator().manual_seed(3)) + 0.5
    c = TopKCompressor(0.2, threshold=0)
    payload, ctx = c.compress(t, "g")
    out = c.decompress(payload, ctx)
    assert out.shape == t.shape and out.dtype == t.dtype
    if t.numel() == 0:
        assert ctx.sparse is False and c.wire_bytes(payload) == 0
    else:
        assert int((out != 0).sum()) == max(1, math.ceil(0.2 * t.numel()))


def test_topk_integer_tensor_travels_dense() -> None:
    t = torch.arange(100)
    payload, ctx = TopKCompressor(0.01, threshold=0).compress(t, "g")
    assert payload is t and ctx.sparse is False


def test_stats_accumulate_and_reset() -> None:
    c = FP16Compressor()
    c.compress(torch.zeros(100))
    c.compress(torch.zeros(50, dtype=torch.float64))
    assert (c.stats.tensors, c.stats.raw_bytes, c.stats.wire_bytes) == (2, 800, 300)
    assert c.stats.ratio == pytest.approx(800 / 300)
    assert c.stats.as_dict()["ratio"] == pytest.approx(800 / 300)
    c.stats.reset()
    assert c.stats == CompressionStats() and c.stats.ratio == 1.0


# --- bad input --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0, 0.0, -0.1, 1.5, float("nan"), "0.1", True])
def test_topk_bad_ratio(ratio: object) -> None:
    with pytest.raises(ValueError, match=r"topk ratio must be a number in \(0, 1\], got"):
        TopKCompressor(ratio)  # type: ignore[arg-type]


@pytest.mark.parametrize("threshold", [-1, 1.5, "10"])
def test_topk_bad_threshold(threshold: object) -> None:
    with pytest.raises(ValueError, match="topk threshold must be a non-negative integer"):
        TopKCompressor(0.1, threshold)  # type: ignore[arg-type]


@pytest.mark.parametrize("c", [NoneCompressor(), FP16Compressor(), TopKCompressor(0.1)])
def test_non_tensor_input(c: Compressor) -> None:
    with pytest.raises(TypeError, match=r"compress needs a torch.Tensor, got list"):
        c.compress([1.0, 2.0], "g")  # type: ignore[arg-type]


def test_topk_error_feedback_needs_key_and_stable_shape() -> None:
    c = TopKCompressor(0.1, threshold=0)
    with pytest.raises(ValueError, match="needs a key naming the tensor"):
        c.compress(_randn(10))
    c.compress(_randn(10), "g")
    with pytest.raises(ValueError, match=r"key 'g' was a 10-element .* now 20 elements .*reset\('g'\)"):
        c.compress(_randn(20), "g")
    payload, _ = TopKCompressor(0.1, threshold=0, error_feedback=False).compress(_randn(10))
    assert payload[0].numel() == 1


def test_topk_merge_rejects_mismatched_input() -> None:
    c = TopKCompressor(0.1, threshold=0)
    payload, ctx = c.compress(_randn(10), "g")
    with pytest.raises(ValueError, match="at least one payload"):
        TopKCompressor.merge([], ctx)
    with pytest.raises(TypeError, match="needs a TopKContext"):
        TopKCompressor.merge([payload], None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[values, indices\]"):
        TopKCompressor.merge([_randn(10)], ctx)


# --- parse_compression (taco.parse_compression) and the LightCC environment ----------------------------------


@pytest.mark.parametrize(("spec", "cls", "name"), [
    (None, NoneCompressor, "none"), ("none", NoneCompressor, "none"), ("fp16", FP16Compressor, "fp16"),
    (" BF16 ", BF16Compressor, "bf16"), ("topk:0.01", TopKCompressor, "topk:0.01"),
    ("topk:1", TopKCompressor, "topk:1"),
    ("topk:0.05:threshold=1000", TopKCompressor, "topk:0.05:threshold=1000"),
])
def test_parse_compression_accepted_forms(spec: str | None, cls: type[Compressor], name: str) -> None:
    c = parse_compression(spec)
    assert type(c) is cls and c.name == name
    assert type(parse_compression(c.name)) is cls and parse_compression(c.name).name == name


def test_parse_compression_topk_values() -> None:
    c = parse_compression("topk:0.05:threshold=1000")
    assert isinstance(c, TopKCompressor)
    assert (c.state.ratio, c.state.threshold, c.state.error_feedback) == (0.05, 1000, True)
    assert parse_compression("topk:0.01").state.threshold == 2_097_152  # type: ignore[attr-defined]


@pytest.mark.parametrize(("spec", "message"), [
    ("gzip", "unknown compression 'gzip'; use none, fp16, bf16 or topk:RATIO (e.g. topk:0.01)"),
    ("", "unknown compression ''; use none, fp16, bf16 or topk:RATIO"),
    ("fp32", "unknown compression 'fp32'"),
    ("topk", "topk needs a ratio in (0, 1], got 'topk'; use topk:RATIO (e.g. topk:0.01)"),
    ("topk:", "topk needs a ratio in (0, 1], got 'topk:'"),
    ("topk:abc", "topk ratio in 'topk:abc' must be a number in (0, 1], got 'abc'"),
    ("topk:0", "topk ratio in 'topk:0' must be a number in (0, 1], got '0'"),
    ("topk:1.5", "must be a number in (0, 1], got '1.5'"),
    ("topk:nan", "must be a number in (0, 1], got 'nan'"),
    ("topk:0.01:threshold=-5", "topk threshold in 'topk:0.01:threshold=-5' must be a non-negative integer"),
    ("topk:0.01:threshold=lots", "must be a non-negative integer (elements), got 'lots'"),
    ("topk:0.01:limit=5", "unknown topk option 'limit=5' in 'topk:0.01:limit=5'; use topk:RATIO or "
                          "topk:RATIO:threshold=N"),
    ("topk:0.01:threshold", "unknown topk option 'threshold'"),
])
def test_parse_compression_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_compression(spec)
    assert message in str(info.value)


def test_parse_compression_non_string() -> None:
    with pytest.raises(TypeError, match="compression spec must be a string or None, got float"):
        parse_compression(0.01)  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", [None, "", "0", "false", "OFF"])
def test_env_topk_disabled(flag: str | None) -> None:
    env = {"LIGHT_TOPK_RATIO": "garbage"}  # not read when TopK is off
    if flag is not None:
        env["LIGHT_TOPK_ALLREDUCE"] = flag
    assert type(build(CompressionSpec.from_env(env))) is NoneCompressor


@pytest.mark.parametrize("flag", ["1", "true", "True", "yes"])
def test_env_topk_enabled_with_defaults(flag: str) -> None:
    c = build(CompressionSpec.from_env({"LIGHT_TOPK_ALLREDUCE": flag}))
    assert isinstance(c, TopKCompressor)
    assert (c.state.ratio, c.state.threshold) == (0.01, 2_097_152)


def test_env_topk_values_from_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHT_TOPK_ALLREDUCE", "1")
    monkeypatch.setenv("LIGHT_TOPK_RATIO", "0.1")
    monkeypatch.setenv("LIGHT_TOPK_THRESHOLD", "4096")
    c = build(CompressionSpec.from_env())
    assert isinstance(c, TopKCompressor)
    assert (c.state.ratio, c.state.threshold) == (0.1, 4096)


@pytest.mark.parametrize(("env", "message"), [
    ({"LIGHT_TOPK_ALLREDUCE": "maybe"},
     "LIGHT_TOPK_ALLREDUCE must be 1/true/yes/on or 0/false/no/off, got 'maybe'"),
    ({"LIGHT_TOPK_ALLREDUCE": "1", "LIGHT_TOPK_RATIO": "abc"},
     "LIGHT_TOPK_RATIO must be a number in (0, 1], got 'abc'"),
    ({"LIGHT_TOPK_ALLREDUCE": "1", "LIGHT_TOPK_RATIO": "2"},
     "LIGHT_TOPK_RATIO must be a number in (0, 1], got '2'"),
    ({"LIGHT_TOPK_ALLREDUCE": "1", "LIGHT_TOPK_THRESHOLD": "1.5"},
     "LIGHT_TOPK_THRESHOLD must be a non-negative integer (elements), got '1.5'"),
    ({"LIGHT_TOPK_ALLREDUCE": "1", "LIGHT_TOPK_THRESHOLD": "-1"},
     "LIGHT_TOPK_THRESHOLD must be a non-negative integer (elements), got '-1'"),
])
def test_env_bad_values(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        CompressionSpec.from_env(env)
    assert message in str(info.value)


# --- training -----------------------------------------------------------------------------------------------


def _train_linear_regression(compressor: Compressor | None, steps: int = 300) -> float:
    """Full-batch SGD on a seeded least-squares problem, the gradient optionally through ``compressor``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 200, generator=g)
    y = x @ torch.randn(200, 1, generator=g) + 0.1 * torch.randn(256, 1, generator=g)
    w = torch.zeros(200, 1, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        ((x @ w - y) ** 2).mean().backward()
        if compressor is not None:
            assert w.grad is not None
            payload, ctx = compressor.compress(w.grad, "w")
            w.grad.copy_(compressor.decompress(payload, ctx))
        opt.step()
    with torch.no_grad():
        return float(((x @ w - y) ** 2).mean())


def test_topk_with_error_feedback_trains_like_uncompressed() -> None:
    baseline = _train_linear_regression(None)
    topk = TopKCompressor(0.05, threshold=0)
    compressed = _train_linear_regression(topk)
    assert abs(compressed - baseline) <= 0.05 * baseline, (compressed, baseline)
    assert topk.stats.ratio == pytest.approx(200 * 4 / (10 * 8))
    # The residual is what makes this work: plain top-k, same steps, stays far behind.
    plain = _train_linear_regression(TopKCompressor(0.05, threshold=0, error_feedback=False))
    assert plain > 10 * baseline, (plain, baseline)


@pytest.mark.parametrize("layout", ["iid", "skewed"])
def test_topk_large_tensor_selects_exact_top_k(layout: str) -> None:
    # Large enough for the sampled-threshold path; "skewed" makes the strided sample overestimate the
    # threshold (large values only at the sampled positions), which must fall back to a full topk.
    n = 600_000
    t = torch.rand(n, generator=torch.Generator().manual_seed(5))
    if layout == "skewed":
        t[::4] *= 10
    c = TopKCompressor(0.1, threshold=0, error_feedback=False)
    (values, indices), _ = c.compress(t)
    expected = torch.topk(t, 60_000).indices
    assert indices.numel() == 60_000
    assert torch.equal(indices.long().sort().values, expected.sort().values)
    torch.testing.assert_close(values, t[indices.long()], rtol=0, atol=0)


# --- settings parsed in one place (comm/specs.py) ------------------------------------------------------------


@pytest.mark.parametrize(("raw", "expected"), [
    (None, None), ("", None), ("  ", None), ("1", True), ("Yes", True), (" on ", True), ("TRUE", True),
    ("0", False), ("no", False), ("Off", False), ("false", False),
])
def test_parse_flag(raw: str | None, expected: bool | None) -> None:
    assert parse_flag("SOME_FLAG", raw) is expected


def test_parse_flag_names_the_setting() -> None:
    with pytest.raises(ValueError, match=r"LIGHT_2D_ALLREDUCE must be 1/true/yes/on or 0/false/no/off, got 'maybe'"):
        algorithm_from_env({"LIGHT_2D_ALLREDUCE": "maybe"})


@pytest.mark.parametrize(("env", "algorithm", "shm", "timeout"), [
    ({}, "auto", True, 1800.0),
    ({"LIGHT_2D_ALLREDUCE": "1", "TACO_SHM": "0", "TACO_COLLECTIVE_TIMEOUT": "45"}, "2d", False, 45.0),
    ({"LIGHT_2D_ALLREDUCE": "off", "TACO_SHM": "yes", "TACO_COLLECTIVE_TIMEOUT": " "}, "flat", True, 1800.0),
])
def test_settings_from_env(env: dict[str, str], algorithm: str, shm: bool, timeout: float) -> None:
    assert (algorithm_from_env(env), shm_from_env(env), timeout_from_env(env)) == (algorithm, shm, timeout)


@pytest.mark.parametrize(("env", "message"), [
    ({"TACO_SHM": "maybe"}, "TACO_SHM must be 1/true/yes/on or 0/false/no/off, got 'maybe'"),
    ({"TACO_COLLECTIVE_TIMEOUT": "soon"}, "TACO_COLLECTIVE_TIMEOUT must be a number of seconds > 0, got 'soon'"),
    ({"TACO_COLLECTIVE_TIMEOUT": "-3"}, "TACO_COLLECTIVE_TIMEOUT must be a number of seconds > 0, got -3.0"),
    ({"TACO_FUSION_MB": "lots"}, "TACO_FUSION_MB must be a number of megabytes >= 0, got 'lots'"),
])
def test_settings_env_bad_values(env: dict[str, str], message: str) -> None:
    readers = (shm_from_env, timeout_from_env, fusion_mb_from_env)
    with pytest.raises(ValueError) as info:
        for read in readers:
            read(env)
    assert message in str(info.value)


def test_configure_shm_and_timeout_default_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TACO_SHM", "off")
    monkeypatch.setenv("TACO_COLLECTIVE_TIMEOUT", "90")
    try:
        s = configure(reset=True)  # read when used: the environment set after import counts
        assert (s.shm, s.collective_timeout) == (False, 90.0)
        s = configure(shm=True, collective_timeout=12.5)
        assert (s.shm, s.collective_timeout, settings().shm) == (True, 12.5, True)
        with pytest.raises(ValueError, match="collective timeout must be a number of seconds > 0, got 0"):
            configure(collective_timeout=0)
        with pytest.raises(TypeError, match="shm must be True or False, got 'no'"):
            configure(shm="no")  # type: ignore[arg-type]
    finally:
        monkeypatch.delenv("TACO_SHM")
        monkeypatch.delenv("TACO_COLLECTIVE_TIMEOUT")
        configure(reset=True)


def test_parse_compression_builds_through_the_spec() -> None:
    """``taco.parse_compression`` (public) gives a new compressor of the spec it parsed, or of a spec value."""
    spec = CompressionSpec.parse("TopK:0.05:threshold=7")
    assert parse_compression("topk:0.05:threshold=7").name == spec.name == "topk:0.05:threshold=7"
    assert parse_compression(spec).name == spec.name and parse_compression(spec) is not parse_compression(spec)
