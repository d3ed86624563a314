"""Tests of taco_notebook.comm.compression.spec: the compression spec as a value, parsed once and carried.

Single process, no ranks: the value's round trip, equality, hashing and pickling; every message a bad spec gets,
whichever way it was given; and that the value (not its text) is what ``configure``, the optimizer, the DDP hook
and the Horovod face hold.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import pytest
import torch

from taco_notebook.comm.compression.compressors import (
    BF16Compressor,
    FP16Compressor,
    NoneCompressor,
    PowerSGDCompressor,
    TopKCompressor,
    build,
)
from taco_notebook.comm.compression.spec import (
    DEFAULT_POWERSGD_MIN_SIZE,
    DEFAULT_POWERSGD_WARMUP,
    DEFAULT_TOPK_RATIO,
    DEFAULT_TOPK_THRESHOLD,
    CompressionSpec,
)
from taco_notebook.comm.config import compressor_for, configure, settings

# (text given, the canonical name, the fields after kind, the compressor class)
FORMS = [
    (None, "none", (None, None, None, None, None), NoneCompressor),
    (" None ", "none", (None, None, None, None, None), NoneCompressor),
    ("FP16", "fp16", (None, None, None, None, None), FP16Compressor),
    ("bf16", "bf16", (None, None, None, None, None), BF16Compressor),
    ("topk:0.01", "topk:0.01", (0.01, DEFAULT_TOPK_THRESHOLD, None, None, None), TopKCompressor),
    ("topk:1", "topk:1", (1.0, DEFAULT_TOPK_THRESHOLD, None, None, None), TopKCompressor),
    ("TopK:0.05:threshold=0", "topk:0.05:threshold=0", (0.05, 0, None, None, None), TopKCompressor),
    (f"topk:0.01:threshold={DEFAULT_TOPK_THRESHOLD}", "topk:0.01", (0.01, DEFAULT_TOPK_THRESHOLD, None, None, None),
     TopKCompressor),
    ("topk:0.0100000001", "topk:0.0100000001", (0.0100000001, DEFAULT_TOPK_THRESHOLD, None, None, None),
     TopKCompressor),
    ("powersgd:4", "powersgd:4", (None, None, 4, DEFAULT_POWERSGD_WARMUP, DEFAULT_POWERSGD_MIN_SIZE),
     PowerSGDCompressor),
    (" PowerSGD:1:min_size=0:warmup=0 ", "powersgd:1:warmup=0:min_size=0", (None, None, 1, 0, 0),
     PowerSGDCompressor),
    (f"powersgd:2:warmup={DEFAULT_POWERSGD_WARMUP}", "powersgd:2",
     (None, None, 2, DEFAULT_POWERSGD_WARMUP, DEFAULT_POWERSGD_MIN_SIZE), PowerSGDCompressor),
]
FIELDS = ("ratio", "threshold", "rank", "warmup", "min_size")


@pytest.fixture
def defaults() -> Iterator[None]:
    """This rank's settings back to the environment's after the test."""
    configure(reset=True)
    yield
    configure(reset=True)


@pytest.mark.parametrize(("text", "name", "fields", "cls"), FORMS)
def test_parse_and_name_round_trip(text: str | None, name: str, fields: tuple[object, ...], cls: type) -> None:
    spec = CompressionSpec.parse(text)
    assert spec.name == str(spec) == name
    assert tuple(getattr(spec, f) for f in FIELDS) == fields
    assert CompressionSpec.parse(name) == spec and CompressionSpec.parse(spec) is spec
    assert type(build(spec)) is cls and build(spec).name == name  # the compressor says the same name


def test_built_from_fields_with_defaults() -> None:
    assert CompressionSpec() == CompressionSpec("none") == CompressionSpec.parse(None)
    assert CompressionSpec("topk") == CompressionSpec.parse(f"topk:{DEFAULT_TOPK_RATIO}")
    assert CompressionSpec("topk", 0.05, 7) == CompressionSpec.parse("topk:0.05:threshold=7")
    assert CompressionSpec("topk", 1).ratio == 1.0 and isinstance(CompressionSpec("topk", 1).ratio, float)
    assert CompressionSpec("powersgd", rank=4) == CompressionSpec.parse("powersgd:4")


def test_equal_specs_hash_alike_and_differ_from_others() -> None:
    specs = [CompressionSpec.parse(text) for text, *_ in FORMS]
    assert len(set(specs)) == len({name for _, name, *_ in FORMS})
    assert hash(CompressionSpec.parse("TopK:0.01")) == hash(CompressionSpec("topk", 0.01))
    assert CompressionSpec.parse("topk:0.01") != CompressionSpec.parse("topk:0.01:threshold=0")
    assert CompressionSpec.parse("fp16") != "fp16"  # a value, not its text
    with pytest.raises(AttributeError):
        CompressionSpec.parse("fp16").kind = "bf16"  # type: ignore[misc]


@pytest.mark.parametrize("text", [text for text, *_ in FORMS])
def test_pickles_to_an_equal_value(text: str | None) -> None:
    spec = CompressionSpec.parse(text)
    back = pickle.loads(pickle.dumps(spec))
    assert back == spec and back.name == spec.name and hash(back) == hash(spec)


@pytest.mark.parametrize(("text", "message"), [
    ("gzip", "unknown compression 'gzip'; use none, fp16, bf16 or topk:RATIO (e.g. topk:0.01), or powersgd:RANK"),
    ("", "unknown compression ''; use none"),
    ("topk", "topk needs a ratio in (0, 1], got 'topk'; use topk:RATIO (e.g. topk:0.01)"),
    ("topk:0", "topk ratio in 'topk:0' must be a number in (0, 1], got '0'"),
    ("topk:0.01:threshold=-5", "topk threshold in 'topk:0.01:threshold=-5' must be a non-negative integer"),
    ("topk:0.01:limit=5", "unknown topk option 'limit=5' in 'topk:0.01:limit=5'; use topk:RATIO or "
                          "topk:RATIO:threshold=N"),
    ("powersgd", "powersgd needs a rank (a positive integer), got 'powersgd'; use powersgd:RANK"),
    ("powersgd:0", "powersgd rank in 'powersgd:0' must be an integer >= 1, got '0'"),
    ("powersgd:4:speed=2", "unknown powersgd option 'speed=2' in 'powersgd:4:speed=2'"),
])
def test_bad_text_gets_the_users_message(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        CompressionSpec.parse(text)
    assert message in str(info.value)


@pytest.mark.parametrize("given", [0.01, 4, b"fp16", ["topk:0.01"]])
def test_parse_rejects_other_types(given: object) -> None:
    with pytest.raises(TypeError, match=f"compression spec must be a string or None, got {type(given).__name__}"):
        CompressionSpec.parse(given)  # type: ignore[arg-type]


@pytest.mark.parametrize(("fields", "message"), [
    ({"kind": "gzip"}, "unknown compression kind 'gzip'; use one of none, fp16, bf16, topk, powersgd"),
    ({"kind": "fp16", "ratio": 0.1}, "fp16 compression takes no ratio, got ratio=0.1"),
    ({"kind": "topk", "rank": 2}, "topk compression takes no rank, got rank=2"),
    ({"kind": "topk", "ratio": 2}, "topk ratio must be a number in (0, 1], got 2"),
    ({"kind": "topk", "ratio": True}, "topk ratio must be a number in (0, 1], got True"),
    ({"kind": "topk", "ratio": 0.1, "threshold": 1.5}, "topk threshold must be a non-negative integer"),
    ({"kind": "powersgd"}, "powersgd needs a rank (a positive integer); use powersgd:RANK"),
    ({"kind": "powersgd", "rank": 0}, "powersgd rank must be an integer >= 1, got 0"),
])
def test_bad_fields_are_refused_when_built(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        CompressionSpec(**fields)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_from_env_is_the_lightcc_form() -> None:
    assert CompressionSpec.from_env({}) == CompressionSpec()
    assert CompressionSpec.from_env({"LIGHT_TOPK_ALLREDUCE": "1"}) == CompressionSpec.parse("topk:0.01")
    env = {"LIGHT_TOPK_ALLREDUCE": "on", "LIGHT_TOPK_RATIO": "0.1", "LIGHT_TOPK_THRESHOLD": "0"}
    assert CompressionSpec.from_env(env).name == "topk:0.1:threshold=0"
    with pytest.raises(ValueError, match=r"LIGHT_TOPK_THRESHOLD must be a non-negative integer \(elements\)"):
        CompressionSpec.from_env({"LIGHT_TOPK_ALLREDUCE": "1", "LIGHT_TOPK_THRESHOLD": "-1"})


def test_configure_stores_the_value_it_was_given_or_parsed(defaults: None) -> None:
    """What crosses to a rank (``%%taco_run`` sends ``configure(compression=spec)``) is held as that value."""
    spec = CompressionSpec.parse("topk:0.05:threshold=0")
    assert configure(compression=spec).compression is spec and settings().compression is spec
    assert configure(compression=" TopK:0.05:threshold=0").compression == spec
    received = pickle.loads(pickle.dumps({"compression": spec}))  # as ipyparallel ships a cell's settings
    assert configure(**received).compression == spec
    assert configure(reset=True).compression == CompressionSpec.from_env()
    with pytest.raises(ValueError, match="unknown compression 'gzip'"):
        configure(compression="gzip")


def test_one_compressor_per_spec_on_a_rank(defaults: None) -> None:
    spec = CompressionSpec.parse("topk:0.05:threshold=0")
    assert compressor_for(spec) is compressor_for("TopK:0.05:threshold=0") is compressor_for(CompressionSpec(
        "topk", 0.05, 0))
    assert build(spec) is not compressor_for(spec)  # build() always makes a new one
    configure(compression=spec)
    assert compressor_for(None) is compressor_for(spec)  # None: the rank's default


def test_optimizer_and_hook_hold_the_value(defaults: None) -> None:
    from taco_notebook.comm.training.hooks import TacoHookState
    from taco_notebook.comm.training.optimizer import DistributedOptimizer

    model = torch.nn.Linear(3, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), 0.1), model.named_parameters(),
                               compression="FP16")
    assert opt.compression == CompressionSpec("fp16") and "compression='fp16'" in repr(opt)
    configure(compression="bf16")
    assert DistributedOptimizer(torch.optim.SGD(model.parameters(), 0.1)).compression == CompressionSpec("bf16")
    assert TacoHookState(compression="powersgd:2").compression == CompressionSpec("powersgd", rank=2)
    assert TacoHookState().compression is None  # the rank's default, looked up at each allreduce
    with pytest.raises(ValueError, match="unknown compression 'gzip'"):
        TacoHookState(compression="gzip")


def test_horovod_compression_carries_the_value() -> None:
    import taco_notebook.horovod as hvd
    from taco_notebook.horovod.compression import spec_of

    assert hvd.Compression.fp16.spec == CompressionSpec("fp16")
    assert hvd.Compression.topk(0.05, threshold=0).spec == CompressionSpec("topk", 0.05, 0)
    assert hvd.Compression.from_spec(CompressionSpec("powersgd", rank=2)).spec.name == "powersgd:2"
    assert spec_of(None) == CompressionSpec() and spec_of("TopK:0.01") == CompressionSpec.parse("topk:0.01")
    assert spec_of(CompressionSpec("bf16")) == hvd.Compression.bf16.spec
    assert repr(hvd.Compression.topk) == "<hvd.Compression 'topk:0.01'>"
