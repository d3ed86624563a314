"""Where a benchmark's result goes, and what it records of how it was made.

New results go to ``benchmarks/results/<machine>/<benchmark>/<UTC timestamp>.json``. ``machine`` is a short slug of
this host (``h100``, ``h200``, ``cpu2``, ``cpu16``), so figures from different machines never mix; each file carries
the command line and the git revision that made it, so a figure in benchmarks/README.md can be traced and rerun.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["RESULTS_DIR", "add_json_option", "machine", "provenance", "result_path", "write"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = RESULTS_DIR.parent.parent


def machine() -> str:
    """``h100`` for an "NVIDIA H100 80GB HBM3" (the first GPU's model), else ``cpu<N>`` for N CPUs."""
    gpu = _gpu_name()
    if not gpu:
        return f"cpu{os.cpu_count()}"
    model = re.search(r"\b[A-Z]{1,2}\d{2,4}[A-Z]?\b", gpu)  # H100, A100, GH200, L40S, V100
    if model:
        return model.group(0).lower()
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower().removeprefix("nvidia")).strip("-")


def _gpu_name() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = done.stdout.strip().splitlines() if done.returncode == 0 else []
    return names[0].strip() if names else None


def result_path(benchmark: str) -> Path:
    """``benchmarks/results/<machine>/<benchmark>/<UTC timestamp>.json`` for a result taken now."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return RESULTS_DIR / machine() / benchmark / f"{stamp}.json"


def provenance() -> dict[str, Any]:
    """The command line as typed, the git revision (and whether the tree had uncommitted changes), machine, date."""
    return {"command": shlex.join(sys.orig_argv), "revision": _git("rev-parse", "--short", "HEAD"),
            "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "machine": machine(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def write(path: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as JSON with :func:`provenance` first, creating the folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**provenance(), **payload}, indent=1) + "\n", encoding="utf-8")
    return path


class _JsonPath(argparse.Action):
    """``--json PATH``: that path; a bare ``--json``: :func:`result_path`, named once when the option is parsed."""

    def __init__(self, option_strings: list[str], dest: str, benchmark: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **{**kwargs, "nargs": "?"})
        self.benchmark = benchmark

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, Path(values) if values else result_path(self.benchmark))


def add_json_option(parser: argparse.ArgumentParser, benchmark: str) -> None:
    parser.add_argument("--json", action=_JsonPath, benchmark=benchmark, metavar="PATH",
                        help=f"write every figure as JSON to PATH (bare --json: "
                             f"benchmarks/results/MACHINE/{benchmark}/UTC-TIMESTAMP.json)")
