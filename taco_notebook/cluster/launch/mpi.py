"""Find ``mpiexec`` and tell MPICH from Open MPI, so each gets the flags it needs.

For a one-host cluster with MPICH, :func:`find_mpi` (``single_host=True``) picks ``mpiexec.gforker`` from the
same directory as the chosen ``mpiexec`` (the same MPICH): it forks the ranks itself and talks PMI over
inherited sockets, so the job opens no TCP port at all, where hydra's ``mpiexec`` listens on 0.0.0.0 for its
proxies whatever it is told. ``TACO_MPI_LAUNCHER=hydra|gforker|auto`` chooses; an explicit ``--mpiexec PATH``
is always used as given.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace

from ...errors import MPINotFoundError

__all__ = ["MPIInfo", "find_mpi", "single_host_env", "library_dir", "mpi4py_environment", "LAUNCHER_ENV",
           "LAUNCHERS", "launcher_choice", "gforker_beside", "for_one_host", "library_identity"]

LAUNCHER_ENV = "TACO_MPI_LAUNCHER"  # the user's choice of MPICH launcher for a one-host cluster
LAUNCHERS = ("auto", "hydra", "gforker")
GFORKER = "mpiexec.gforker"
INSTALL_HINT = "install one with `pip install mpich mpi4py` (or your system's Open MPI), or pass --mpiexec PATH"


@dataclass(frozen=True)
class MPIInfo:
    """An ``mpiexec`` and what it is."""

    mpiexec: str
    implementation: str  # "mpich", "openmpi" or "unknown"
    version: str
    extra_args: list[str] = field(default_factory=list)
    # What the ranks need so that mpi4py loads this mpiexec's library (MPI4PY_MPIABI, its lib dir on
    # LD_LIBRARY_PATH): a system Open MPI beside the mpich wheel otherwise gives every rank a world of one.
    environment: dict[str, str] = field(default_factory=dict)
    # MPICH's process manager: "hydra" (listens on 0.0.0.0) or "gforker" (one host, no port); "" otherwise.
    launcher: str = ""

    @property
    def description(self) -> str:
        how = f"{self.launcher}: " if self.launcher else ""
        return f"{self.implementation} {self.version} ({how}{self.mpiexec})"


def _candidates(explicit: str | None) -> list[str]:
    if explicit:
        return [explicit]
    found = []
    # The interpreter's own bin/ first: a venv's mpich wheel works even when the venv is not activated.
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(beside, os.X_OK):
        found.append(beside)
    on_path = shutil.which("mpiexec")
    if on_path:
        found.append(on_path)
    return found


def library_identity(text: str) -> tuple[str, str]:
    """(implementation, version) from an MPI's own words: ``mpiexec --version`` or ``MPI_Get_library_version``.

    >>> library_identity("MPICH Version:      5.0.2\\nMPICH Release date: ...")
    ('mpich', '5.0.2')
    >>> library_identity("Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4")
    ('openmpi', '4.1.4')
    """
    lowered = text.lower()
    if "open mpi" in lowered or "openrte" in lowered or "open-mpi" in lowered:
        impl = "openmpi"
    elif "mpich" in lowered or "hydra" in lowered:
        impl = "mpich"
    else:
        impl = "unknown"
    labelled = re.search(r"version:\s*v?(\d+(?:\.\d+)+)", text, re.IGNORECASE)
    first = labelled or re.search(r"\bv?(\d+\.\d+(?:\.\d+)*)", text)
    return impl, first.group(1) if first else "?"


def _implementation_args(impl: str) -> list[str]:
    if impl != "openmpi":
        return []
    args = ["--oversubscribe"]  # more ranks than cores is normal on a laptop or in CI
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--allow-run-as-root")
    return args


def single_host_env(info: MPIInfo) -> dict[str, str]:
    """Environment that keeps a one-host job's MPI traffic, and MPI's listeners, off the network.

    MPICH's default netmod (UCX) opens a listener per rank on the LAN address even when every rank is local;
    limited to ``self,sm`` it uses shared memory only and listens on nothing. Hydra's own control port is not
    affected (it listens on 0.0.0.0 whatever it is told; see :mod:`taco_notebook.comm.group.rendezvous`). For
    Open MPI nothing is set.
    """
    if info.implementation == "mpich":
        return {"UCX_TLS": "self,sm"}
    return {}


_LIBMPI = {"mpich": "libmpi.so.12", "openmpi": "libmpi.so.40"}


def library_dir(mpiexec: str, impl: str) -> str | None:
    """The directory holding ``mpiexec``'s own libmpi (PREFIX/lib, lib64 or lib/<triplet>), if found."""
    name = _LIBMPI.get(impl)
    if name is None:
        return None
    real = os.path.realpath(mpiexec)
    roots = []
    for path in (mpiexec, real):
        prefix = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        roots += [os.path.join(prefix, "lib"), os.path.join(prefix, "lib64")]
        roots += [os.path.join(prefix, "lib", d) for d in ("x86_64-linux-gnu", "aarch64-linux-gnu")]
    return next((d for d in roots if os.path.exists(os.path.join(d, name))), None)


def mpi4py_environment(mpiexec: str, impl: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """``MPI4PY_MPIABI`` and ``LD_LIBRARY_PATH`` that make the ranks' mpi4py load ``mpiexec``'s MPI.

    Empty for an unknown implementation or when its library is not found (the ranks then check their world
    size against the launcher's and fail clearly, see :mod:`taco_notebook.comm.group.mpicheck`).
    """
    libdir = library_dir(mpiexec, impl)
    if libdir is None:
        return {}
    # The mpich wheel keeps libmpi's own dependencies (libfabric, ucx) in lib/mpich, found through a RUNPATH
    # that LD_LIBRARY_PATH overrides: another MPI's libfabric on the path would replace them. So: first.
    private = os.path.join(libdir, impl)
    dirs = [libdir, private] if os.path.isdir(private) else [libdir]
    current = (os.environ if base is None else base).get("LD_LIBRARY_PATH", "")
    return {"MPI4PY_MPIABI": impl, "LD_LIBRARY_PATH": os.pathsep.join(p for p in (*dirs, current) if p)}


def launcher_choice(environ: dict[str, str] | None = None) -> str:
    """``TACO_MPI_LAUNCHER``, lower-cased (unset or empty: ``auto``); anything else is an error naming the choices."""
    given = (os.environ if environ is None else environ).get(LAUNCHER_ENV, "")
    chosen = given.strip().lower() or "auto"
    if chosen not in LAUNCHERS:
        raise MPINotFoundError(f"{LAUNCHER_ENV}={given!r} is not a launcher: set it to one of {', '.join(LAUNCHERS)}"
                               f" (or unset it)")
    return chosen


def gforker_beside(mpiexec: str) -> str | None:
    """``mpiexec.gforker`` of the same MPICH: in ``mpiexec``'s directory, or in the one its symlink points to."""
    for directory in dict.fromkeys((os.path.dirname(os.path.abspath(mpiexec)),
                                    os.path.dirname(os.path.realpath(mpiexec)))):
        candidate = os.path.join(directory, GFORKER)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def for_one_host(info: MPIInfo, explicit: bool, environ: dict[str, str] | None = None) -> MPIInfo:
    """The launcher for a job whose ranks all run here: MPICH's gforker when it is there, unless told otherwise.

    ``explicit`` (the user named the program with ``--mpiexec``) keeps ``info`` exactly. Open MPI and unknown
    implementations are kept too. ``TACO_MPI_LAUNCHER=gforker`` without a gforker beside ``mpiexec`` is an error.
    """
    if explicit or info.implementation != "mpich" or info.launcher == "gforker":
        return info
    choice = launcher_choice(environ)
    gforker = gforker_beside(info.mpiexec) if choice != "hydra" else None
    if gforker is None:
        if choice == "gforker":
            raise MPINotFoundError(f"{LAUNCHER_ENV}=gforker but there is no {GFORKER} beside {info.mpiexec}: "
                                   f"unset {LAUNCHER_ENV} (or set it to hydra), or pass --mpiexec PATH")
        return info
    return replace(info, mpiexec=gforker, launcher="gforker")


def find_mpi(mpiexec: str | None = None, single_host: bool = False) -> MPIInfo:
    """Locate a working ``mpiexec`` and mpi4py, or raise :class:`MPINotFoundError` naming the fix.

    ``single_host``: every rank runs on this machine (a :class:`~taco_notebook.cluster.session.TacoCluster`),
    so MPICH's network-free gforker is taken when it is there (:func:`for_one_host`).
    """
    candidates = _candidates(mpiexec)
    if not candidates:
        raise MPINotFoundError(f"no mpiexec found next to {sys.executable} or on PATH: {INSTALL_HINT}")
    path = candidates[0]
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MPINotFoundError(f"mpiexec {path!r} does not run ({exc}): {INSTALL_HINT}") from None
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        raise MPINotFoundError(f"mpi4py is not installed in {sys.executable}: {INSTALL_HINT}") from None
    impl, version = library_identity(out.stdout + out.stderr)
    launcher = ""
    if os.path.basename(path) == GFORKER:  # answers --version with its usage: the MPICH beside it says which
        impl, version, launcher = "mpich", _mpich_version(path), "gforker"
    elif impl == "mpich":
        launcher = "hydra"
    info = MPIInfo(path, impl, version, _implementation_args(impl), mpi4py_environment(path, impl), launcher)
    return for_one_host(info, explicit=mpiexec is not None) if single_host else info


def _mpich_version(gforker: str) -> str:
    tool = os.path.join(os.path.dirname(gforker), "mpichversion")
    try:
        out = subprocess.run([tool], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    for line in out.splitlines():
        if "version" in line.lower() and ":" in line:
            return line.split(":", 1)[1].strip()
    return "?"
