"""A private Debian Open MPI for the tests, extracted with ``dpkg -x`` instead of installed.

Installing ``openmpi-bin`` system-wide would change which MPI library mpi4py loads for every other process on
the machine (see ENVIRONMENT.md), so the packages are downloaded with ``apt-get download`` and unpacked into
a cache directory of this user (0700). ``OPAL_PREFIX``, ``PATH`` and ``LD_LIBRARY_PATH`` point Open MPI at it.

    python -m tests.support.openmpi        # prepare the cache once, print where it is
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OpenMPI", "PACKAGES", "prepare_openmpi"]

# openmpi-bin and what it needs that a slim Debian does not have (apt-cache depends --recurse, minus the
# debconf front ends). Missing optional transports (ucx, psm) only cost a warning.
PACKAGES = ("openmpi-bin", "openmpi-common", "libopenmpi3", "libpmix2", "libhwloc15", "libhwloc-plugins",
            "libevent-core-2.1-7", "libevent-pthreads-2.1-7", "libfabric1", "libibverbs1", "ibverbs-providers",
            "librdmacm1", "libnl-3-200", "libnl-route-3-200", "libpsm-infinipath1", "libpsm2-2", "libucx0",
            "libmunge2", "libxnvctrl0", "ocl-icd-libopencl1")
DEFAULT_CACHE = Path(os.environ.get("TACO_OPENMPI_CACHE", f"/tmp/taco-openmpi-{os.getuid()}"))


@dataclass(frozen=True)
class OpenMPI:
    """An unpacked Open MPI: its ``mpiexec``, ``libmpi.so`` and the environment that makes both work."""

    root: Path

    @property
    def prefix(self) -> Path:
        """Debian configures Open MPI with prefix /usr, libdir /usr/lib/<triplet>, sysconfdir /etc/openmpi."""
        return self.root / "usr"

    @property
    def mpiexec(self) -> str:
        return str(self.prefix / "bin" / "mpiexec.openmpi")

    @property
    def libdirs(self) -> list[str]:
        return [str(self.prefix / "lib" / "x86_64-linux-gnu"), str(self.root / "lib" / "x86_64-linux-gnu")]

    @property
    def libmpi(self) -> str:
        return str(self.prefix / "lib" / "x86_64-linux-gnu" / "libmpi.so.40")

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with Open MPI's paths in front."""
        env = dict(os.environ if base is None else base)
        env["OPAL_PREFIX"] = str(self.prefix)
        env["OPAL_SYSCONFDIR"] = str(self.root / "etc" / "openmpi")
        env["PATH"] = os.pathsep.join([str(self.prefix / "bin"), env.get("PATH", "")])
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*self.libdirs, env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
        # a container has no ssh and no IB: keep the launcher and transports local
        env.setdefault("OMPI_MCA_plm_rsh_agent", "false")
        env.setdefault("OMPI_MCA_btl", "self,vader,tcp")
        env.setdefault("OMPI_MCA_pml", "ob1")
        env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        return env

    def mpiexec_args(self, n: int) -> list[str]:
        return [self.mpiexec, "--oversubscribe", "--allow-run-as-root", "-n", str(n)]


def prepare_openmpi(cache: Path = DEFAULT_CACHE) -> OpenMPI:
    """Download and unpack Open MPI into ``cache`` once; raise RuntimeError saying why when it cannot."""
    ready = cache / "ready"
    found = OpenMPI(cache / "root")
    if ready.exists() and os.path.exists(found.mpiexec):
        return found
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise RuntimeError("no apt-get/dpkg here to fetch Debian's Open MPI")
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(cache, 0o700)
    with tempfile.TemporaryDirectory(dir=cache) as debs:
        got = subprocess.run(["apt-get", "download", *PACKAGES], cwd=debs, capture_output=True, text=True,
                             timeout=600)
        if got.returncode != 0 and os.geteuid() == 0:  # package lists may be missing: refresh once (root only)
            subprocess.run(["apt-get", "update"], capture_output=True, timeout=600)
            got = subprocess.run(["apt-get", "download", *PACKAGES], cwd=debs, capture_output=True, text=True,
                                 timeout=600)
        if got.returncode != 0:
            raise RuntimeError(f"apt-get download of Open MPI failed: {got.stderr.strip()[-500:]}")
        shutil.rmtree(found.root, ignore_errors=True)
        for deb in sorted(glob.glob(os.path.join(debs, "*.deb"))):
            subprocess.run(["dpkg", "-x", deb, str(found.root)], check=True, capture_output=True, timeout=300)
    if not os.path.exists(found.mpiexec):
        raise RuntimeError(f"Open MPI unpacked into {found.root} but {found.mpiexec} is missing")
    ready.write_text("ok\n")
    return found


if __name__ == "__main__":
    ompi = prepare_openmpi()
    print(ompi.mpiexec)
    sys.exit(subprocess.run([ompi.mpiexec, "--version"], env=ompi.environment()).returncode)
