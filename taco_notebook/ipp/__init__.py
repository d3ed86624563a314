"""The one door to ipyparallel and ipykernel: their public names that taco uses (:mod:`.upstream`), and every
override of their internals (the lean client, the hub, the quiet kernel, the streams, the signals, the comm pump), each
listed with what it relies on in :mod:`.assumptions`. No other module of the package imports ipyparallel or
ipykernel.

Importing this package checks that the installed versions are ones these overrides were written for; it imports
neither (the server's manager and every rank import it without tornado).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

__all__ = ["SUPPORTED", "check_versions"]

SUPPORTED = {"ipyparallel": ("9", "10"), "ipykernel": ("6.29", "8")}  # [lowest, first unsupported)


def check_versions(found: dict[str, str] | None = None) -> None:
    """Raise ImportError naming the supported range when an installed ipyparallel or ipykernel is outside it
    (``found`` maps a package to its version; the installed ones by default)."""
    for package, (lowest, above) in SUPPORTED.items():
        try:
            installed = found[package] if found is not None else version(package)
        except (KeyError, PackageNotFoundError):
            raise ImportError(f"taco_notebook needs {package}>={lowest},<{above}, which is not installed") from None
        if not Version(lowest) <= Version(installed) < Version(above):
            raise ImportError(f"taco_notebook supports {package}>={lowest},<{above}; {installed} is installed "
                              f"(pip install '{package}>={lowest},<{above}')")


check_versions()
