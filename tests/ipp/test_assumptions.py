"""The one door to ipyparallel: the installed upstream still has every name an override relies on, a missing
one is reported with the override and the behaviour it replaces, and versions outside the range are refused."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import tomllib

from taco_notebook.ipp import SUPPORTED, check_versions
from taco_notebook.ipp.assumptions import ASSUMPTIONS, Assumption, broken

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("assumption", ASSUMPTIONS, ids=lambda a: f"{a.owner}.{a.name}")
def test_upstream_still_has_what_the_override_relies_on(assumption: Assumption) -> None:
    assert broken(assumption) is None, broken(assumption)


class _Upstream:
    def method(self) -> None:
        self.assigned = 1


def test_a_missing_name_is_reported_with_its_override_and_what_it_replaces() -> None:
    owner = f"{__name__}:_Upstream"
    assert broken(Assumption(owner, "method", "method", "x", "y")) is None
    assert broken(Assumption(owner, "assigned", "attribute", "x", "y")) is None  # set on self by a method
    gone = broken(Assumption(owner, "_send", "method", "client.LeanClient._send", "sending a request"))
    assert gone == (f"{owner}._send (method), used by client.LeanClient._send: sending a request: no longer there")
    moved = broken(Assumption("ipyparallel.client.client:NoSuchClient", "_send", "method", "x", "y"))
    assert moved is not None and "ipyparallel.client.client:NoSuchClient cannot be found" in moved


def test_every_override_module_is_covered() -> None:
    """Each module of ipp/ that overrides upstream internals has rows in the table."""
    used = {a.used_by.split(".")[0].split(" ")[0] for a in ASSUMPTIONS}
    assert {"client", "hub", "quiet_kernel", "stdstreams", "comm_pump"} <= used


@pytest.mark.parametrize("package", sorted(SUPPORTED))
def test_a_version_outside_the_range_is_refused_naming_the_range(package: str) -> None:
    lowest, above = SUPPORTED[package]
    found = {name: low for name, (low, _) in SUPPORTED.items()}
    check_versions(found)  # the lowest supported passes
    with pytest.raises(ImportError, match=re.escape(f"supports {package}>={lowest},<{above}; {above}.0 is installed")):
        check_versions({**found, package: f"{above}.0"})
    with pytest.raises(ImportError, match=re.escape(f"needs {package}>={lowest},<{above}, which is not installed")):
        check_versions({name: v for name, v in found.items() if name != package})


def test_pyproject_pins_the_range_the_check_names() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for package, (lowest, above) in SUPPORTED.items():
        assert f"{package}>={lowest},<{above}" in dependencies, dependencies


def test_nothing_outside_the_adapter_imports_ipyparallel() -> None:
    """The check as a user would run it: grep lists only taco_notebook/ipp/."""
    found = subprocess.run(["grep", "-rln", "--include=*.py", r"import ipyparallel\|from ipyparallel", "taco_notebook"],
                           cwd=ROOT, capture_output=True, text=True, check=False).stdout.split()
    assert found and all(path.startswith("taco_notebook/ipp/") for path in found), found
