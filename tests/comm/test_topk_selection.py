"""TopK's selection on large tensors: exact (the same set as ``torch.topk``), whatever path it takes.

The sampled threshold only narrows the candidates (first to ~1.25·k, then ~4·k, then a full topk), the word-wise
``nonzero`` finds them, and the ranking keeps them in ascending order; these tests hold each of those to the
plain ``torch.topk`` answer, on data that sends the sample right, low and far off, and with the reused scratch
buffers shrinking between calls.
"""

from __future__ import annotations

import math

import pytest
import torch

from taco_notebook.comm.compression.compressors import TopKCompressor, TopKState
from taco_notebook.comm.compression.selection import (
    _device_top,
    _sampled_top,
    _sparse_nonzero,
    selection_for,
    top_indices,
)


def _data(layout: str, n: int, seed: int = 7) -> torch.Tensor:
    """``n`` distinct magnitudes (a shuffled 1..n, exact in float32 below 2**24) with random signs."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    t = (torch.randperm(n, generator=g) + 1).to(torch.float32)
    if layout == "boosted_every_4th":  # the strided sample sees more large values than there are: retries
        t[::4] += 2 * n
    elif layout == "boosted_every_6th":  # further off still: may need the full topk
        t[::6] += 2 * n
    elif layout == "ascending":
        t = t.sort().values
    return t * signs


@pytest.mark.parametrize("layout", ["iid", "boosted_every_4th", "boosted_every_6th", "ascending"])
@pytest.mark.parametrize(("n", "ratio"), [(600_000, 0.01), (2_100_003, 0.01), (700_001, 0.2), (1_000_000, 0.1)])
def test_selection_equals_torch_topk(layout: str, n: int, ratio: float) -> None:
    t = _data(layout, n)
    k = math.ceil(ratio * n)
    assert torch.unique(t.abs()).numel() == n, "ties-free data, so the top-k set is unique"
    got = top_indices(t, k, TopKState(ratio, 0, True))
    want = torch.topk(t.abs(), k, sorted=False).indices
    assert got.numel() == k
    assert torch.equal(got.sort().values, want.sort().values)


def test_scratch_buffers_shrink_between_calls_without_stale_entries() -> None:
    # A large call leaves True bytes in the mask's tail; a smaller length that is not a multiple of 8 must
    # not see them (the padding is cleared), and a dtype change gets new buffers.
    state = TopKState(0.01, 0, True)
    for n, dtype in ((3_000_000, torch.float32), (700_001, torch.float32), (900_005, torch.float64),
                     (600_003, torch.float32)):
        t = _data("iid", n, seed=n).to(dtype)
        k = math.ceil(0.01 * n)
        got = top_indices(t, k, state)
        assert torch.equal(got.sort().values, torch.topk(t.abs(), k).indices.sort().values), (n, dtype)


def test_ties_at_the_kth_magnitude_go_to_the_lowest_indices() -> None:
    n, k = 800_000, 8_100
    t = -torch.ones(n)
    threes = torch.arange(5, n, 97)[:8_000]
    t[threes] = 3.0  # all 8,000 of them in, then 100 of the tied ones, from the lowest index up
    got = top_indices(t, k, TopKState(0.01, 0, True))
    assert got.numel() == k and bool((got.diff() > 0).all())
    ones = torch.tensor([i for i in range(200) if i not in set(threes[:3].tolist())][:100])
    assert torch.equal(got, torch.cat([threes, ones]).sort().values)


@pytest.mark.parametrize("density", [0.0, 0.003, 0.05, 0.5, 1.0])
def test_sparse_nonzero_equals_nonzero(density: float) -> None:
    g = torch.Generator().manual_seed(int(density * 1000))
    mask = torch.rand(80_008, generator=g) < density
    assert torch.equal(_sparse_nonzero(mask), mask.nonzero().view(-1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_precision_selection_picks_top_magnitudes(dtype: torch.dtype) -> None:
    # Half precision has ties: compare the magnitudes chosen, which are unique as a multiset.
    t = _data("iid", 1_000_000).to(dtype)
    got = top_indices(t, 10_000, TopKState(0.01, 0, True))
    want = torch.topk(t.abs(), 10_000).indices
    assert torch.equal(t.abs()[got].sort().values, t.abs()[want].sort().values)


def test_error_feedback_on_the_large_path_delivers_every_step_in_full() -> None:
    # What was sent over the steps plus what is left in the residual is exactly the sum of the inputs:
    # nothing is lost or counted twice by the in-place residual update (index_fill of the sent entries).
    n, steps = 1_200_000, 5
    c = TopKCompressor(0.01, threshold=0)
    sent = torch.zeros(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    for step in range(steps):
        grad = _data("iid", n, seed=100 + step)
        total += grad.double()
        (values, indices), _ = c.compress(grad, key="g")
        assert values.numel() == indices.numel() == 12_000
        assert torch.unique(indices).numel() == 12_000
        sent.index_add_(0, indices.long(), values.double())
    torch.testing.assert_close(sent + c.state.residuals["g"].double(), total, rtol=0, atol=1e-5)


# --- the selection by device type: torch.topk on accelerators, the sampled passes on CPU ---------------------


def test_the_selection_is_chosen_by_the_device_type_alone() -> None:
    # No GPU needed: the choice looks at the device, never at a tensor's values (which would sync a GPU).
    assert selection_for(torch.device("cpu")) is _sampled_top
    for device in ("cuda", "cuda:1", "meta"):
        assert selection_for(torch.device(device)) is _device_top


@pytest.mark.parametrize("layout", ["iid", "boosted_every_4th", "ascending"])
def test_device_selection_equals_the_sampled_one_on_cpu(layout: str) -> None:
    # The GPU's path, run on CPU tensors: the same set as the CPU-tuned one (ties-free data, so the set is unique).
    n = 1_300_007
    t = _data(layout, n, seed=3)
    k = math.ceil(0.01 * n)
    state = TopKState(0.01, 0, True)
    got = _device_top(t, k, state)
    assert got.dtype == torch.int64 and got.numel() == k
    assert torch.equal(got.sort().values, _sampled_top(t, k, TopKState(0.01, 0, True)).sort().values)
    assert state._mask is None, "the device selection needs no bool mask"


def test_device_selection_keeps_the_same_error_feedback(monkeypatch: pytest.MonkeyPatch) -> None:
    # Five steps of a compressor forced onto the device selection against one on the CPU's: the same entries
    # sent (as sets), the same values, the same residual left, bit for bit.
    from taco_notebook.comm.compression import selection

    n = 900_001
    sampled = TopKCompressor(0.01, threshold=0)
    steps = [_data("iid", n, seed=40 + s) for s in range(5)]
    sent_sampled = [sampled.compress(g, key="w")[0] for g in steps]
    monkeypatch.setattr(selection, "selection_for", lambda device: _device_top)
    device = TopKCompressor(0.01, threshold=0)
    sent_device = [device.compress(g, key="w")[0] for g in steps]
    for (v1, i1), (v2, i2) in zip(sent_sampled, sent_device, strict=True):
        o1, o2 = i1.argsort(), i2.argsort()
        assert torch.equal(i1[o1], i2[o2]) and torch.equal(v1[o1], v2[o2])
    assert torch.equal(sampled.state.residuals["w"], device.state.residuals["w"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs the CUDA selection for real)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_compress_and_merge_without_host_syncs(dtype: torch.dtype) -> None:
    n = 2_000_003
    g = torch.Generator().manual_seed(9)
    grads = [torch.randn(n, generator=g).to(dtype) for _ in range(4)]  # continuous values: ties improbable
    on_gpu = [grad.to("cuda") for grad in grads]
    c, reference = TopKCompressor(0.01, threshold=0), TopKCompressor(0.01, threshold=0)
    c.compress(on_gpu[0], key="g")  # the first call allocates the residual and scratch buffers
    reference.compress(grads[0], key="g")
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call from here on raises
    try:
        for grad in on_gpu[1:]:
            payload, ctx = c.compress(grad, key="g")
            merged = TopKCompressor.merge([payload, payload], ctx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for grad in grads[1:]:
        want, _ = reference.compress(grad, key="g")
    values, indices = payload
    assert values.device == on_gpu[0].device and merged.device == on_gpu[0].device
    assert values.numel() == indices.numel() == math.ceil(0.01 * n)
    assert torch.equal(merged, 2 * c.decompress(payload, ctx))
    if dtype == torch.float32:  # no ties (half precision has them, and the kernels may break them differently)
        assert torch.equal(values.abs().cpu().sort().values, want[0].abs().sort().values)
        assert torch.equal(indices.cpu().sort().values, want[1].sort().values)
        torch.testing.assert_close(c.state.residuals["g"].cpu(), reference.state.residuals["g"], rtol=0, atol=0)
