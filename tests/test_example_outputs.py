"""The check that runs on every cell of the example notebooks (examples/conftest.py) fails on what a reader should
not be shown: NaN or inf, a traceback, a warning nobody announced, a loss that does not fall."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

CHECKER = Path(__file__).parents[1] / "examples" / "conftest.py"
_spec = importlib.util.spec_from_file_location("example_outputs", CHECKER)
assert _spec is not None and _spec.loader is not None
checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checks)


def stream(name: str, text: str) -> dict:
    return {"output_type": "stream", "name": name, "text": text}


def test_a_clean_training_cell_passes() -> None:
    checks.check_outputs("%%taco_run", {}, [stream("stdout", "[rank 0] step   0  loss 0.9123\n"),
                                            stream("stdout", "[rank 0] step 119  loss 0.0456\n"),
                                            {"output_type": "execute_result", "data": {"text/plain": "0.0456"}}])


@pytest.mark.parametrize("outputs, said", [
    ([stream("stdout", "[rank 0] loss after 3 steps: nan\n")], "non-finite number (nan)"),
    ([{"output_type": "execute_result", "data": {"text/plain": "tensor([inf, 1.])"}}], "non-finite number (inf)"),
    ([stream("stderr", "[taco] replicas differ: rank 1 holds other values\n")], "warns"),
    ([stream("stderr", "[rank 1] /x.py:3: UserWarning: deprecated\n")], "warns"),
    ([stream("stderr", "Traceback (most recent call last):\n  File ...\n")], "prints a traceback"),
    ([stream("stdout", "step 0 loss 0.5\nstep 9 loss 0.7\n")], "the loss does not fall: [0.5, 0.7]"),
])
def test_what_a_reader_should_not_see_fails_the_cell(outputs, said) -> None:
    with pytest.raises(AssertionError) as failed:
        checks.check_outputs("%%taco_run -np 4\ntrain()", {}, outputs)
    assert said in str(failed.value) and "cell `%%taco_run -np 4`" in str(failed.value)


def test_an_announced_warning_must_come_and_be_the_one_announced() -> None:
    announced = {"taco": {"warns": "replicas differ"}}
    checks.check_outputs("%%taco_run", announced, [stream("stderr", "[taco] replicas differ: rank 1 ...\n")])
    with pytest.raises(AssertionError, match="should warn"):
        checks.check_outputs("%%taco_run", announced, [stream("stdout", "quiet\n")])
    with pytest.raises(AssertionError, match="warns other than"):
        checks.check_outputs("%%taco_run", announced, [stream("stderr", "[taco] rank 2 died: SIGKILL\n")])
