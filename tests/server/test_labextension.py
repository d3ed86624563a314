"""The JupyterLab sidebar (labextension/): its TypeScript unit tests, its packaging and its installation."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import taco_notebook

ROOT = Path(__file__).resolve().parents[2]
EXTENSION_NAME = "taco-notebook"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _tool(name: str) -> str | None:
    """``name`` from this interpreter's environment first (the venv need not be activated), then PATH."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


def _package_json() -> dict:
    return json.loads((ROOT / "package.json").read_text())


def test_typescript_unit_tests_pass() -> None:
    if not (ROOT / "node_modules").is_dir():
        pytest.skip("node_modules is absent: run `jlpm install --immutable` (or `pip install -e .`) to run `jlpm test`")
    jlpm = _tool("jlpm")
    if jlpm is None or shutil.which("node") is None:
        pytest.skip("`jlpm test` needs jlpm (pip install jupyter-builder or jupyterlab) and node on PATH")
    result = subprocess.run([jlpm, "test"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"`jlpm test` failed:\n{output[-6000:]}"
    passed = re.search(r"^\S*\s*pass (\d+)$", output, re.MULTILINE)
    failed = re.search(r"^\S*\s*fail (\d+)$", output, re.MULTILINE)
    assert passed and int(passed.group(1)) > 0, f"no TypeScript test ran:\n{output[-3000:]}"
    assert failed and int(failed.group(1)) == 0, output[-6000:]


def test_names_and_versions_agree() -> None:
    """package.json, the Python package and pyproject's shared-data must name the same extension."""
    package = _package_json()
    assert package["name"] == EXTENSION_NAME
    assert package["version"] == taco_notebook.__version__
    assert package["jupyterlab"]["outputDir"] == "taco_notebook/labextension"
    assert taco_notebook._jupyter_labextension_paths() == [{"src": "labextension", "dest": EXTENSION_NAME}]
    # Python 3.10 has no tomllib: the shared-data line is checked as text.
    shared_data = f'"taco_notebook/labextension" = "share/jupyter/labextensions/{EXTENSION_NAME}"'
    assert shared_data in (ROOT / "pyproject.toml").read_text()


@pytest.mark.server
def test_labextension_is_installed_and_enabled() -> None:
    jupyter = _tool("jupyter")
    assert jupyter is not None, "the `jupyter` command is missing: install jupyterlab"
    result = subprocess.run([jupyter, "labextension", "list"], capture_output=True, text=True, timeout=120, check=False)
    output = ANSI.sub("", result.stdout + result.stderr)
    assert result.returncode == 0, output
    line = next((line for line in output.splitlines() if line.split()[:1] == [EXTENSION_NAME]), None)
    assert line is not None, (
        f"{EXTENSION_NAME} is not installed; `pip install -e .` builds and installs it (needs node):\n{output}"
    )
    assert re.search(r"\benabled\s+OK\b", line), f"{EXTENSION_NAME} is not enabled and OK: {line.strip()!r}"
