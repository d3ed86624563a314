"""Everything ``%taco_doctor`` reports about one node, as a JSON-able dict: :func:`node_facts`.

Runs where the node is: on an engine (``view.apply(node_facts)``), under plain Python, or as
``python -m taco_notebook.cluster.doctor.nodefacts`` (prints the JSON) through ssh or ``ip netns exec``. No
IPython, no CUDA initialisation (placement may still choose the GPUs), and no crash when a tool is missing: a
missing ``nvidia-smi`` or ``mpiexec`` is reported as ``"missing"``, a failing one with what it said.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from typing import Any

from ...comm.group import hardware
from ..launch.mpi import library_identity

__all__ = ["node_facts", "gpu_facts", "mpi_facts", "torch_facts", "hugepage_facts", "library_identity",
           "SCHEMA", "main"]

SCHEMA = 1  # bumped when a field changes meaning, so a client can refuse facts from an older node
_TOOL_TIMEOUT_S = 20.0
_GPU_QUERY = "index,name,memory.total,pci.bus_id"
# mpi4py without MPI_Init: Get_library_version is one of the few calls MPI allows before it.
_MPI4PY_PROBE = ("import json, mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False\n"
                 "from mpi4py import MPI\n"
                 "print(json.dumps({'mpi4py': mpi4py.__version__, 'library': MPI.Get_library_version()}))")


def _run_tool(argv: list[str], env: dict[str, str] | None = None) -> tuple[bool, str]:
    """(ran and exited 0, stdout or what went wrong), never raising."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{os.path.basename(argv[0])} did not run: {exc}"
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        return False, f"{os.path.basename(argv[0])} exited {done.returncode}: {said[0] if said else 'no output'}"
    return True, done.stdout


def hugepage_facts() -> dict[str, Any]:
    """Huge page pools by size (kB), the kernel's default size, and the hugetlbfs mounts."""
    default = hardware.hugepages()
    return {"pools": hardware.hugepage_pools(), "default_kb": default["page_kb"] if default else None,
            "mounts": hardware.hugetlbfs_mounts()}


def _parse_gpu_csv(text: str) -> list[dict[str, Any]]:
    """Rows of ``nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id --format=csv,noheader,nounits``."""
    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[0].isdigit():
            continue
        memory = fields[2]
        gpus.append({"index": int(fields[0]), "name": fields[1],
                     "memory_mib": int(memory) if memory.isdigit() else None, "bus_id": fields[3]})
    return gpus


def gpu_facts() -> dict[str, Any]:
    """GPUs from ``nvidia-smi`` (count, model, memory) and ``nvidia-smi topo -m`` (the interconnect matrix).

    ``tool`` is ``"ok"``, ``"missing"`` (not on PATH: the driver's /proc files still give count and models) or
    what went wrong. ``driver_gpus`` counts what the driver lists, whatever ``CUDA_VISIBLE_DEVICES`` says.
    """
    try:
        driver_gpus = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        driver_gpus = 0
    facts: dict[str, Any] = {"driver_gpus": driver_gpus, "visible": hardware.visible_gpus(), "gpus": [],
                             "topology": None}
    tool = shutil.which("nvidia-smi")
    if tool is None:
        facts["tool"] = "missing"
        facts["gpus"] = [{"index": i, "name": name, "memory_mib": None, "bus_id": None}
                         for i, name in enumerate(hardware.gpu_names())]
        return facts
    ok, out = _run_tool([tool, f"--query-gpu={_GPU_QUERY}", "--format=csv,noheader,nounits"])
    facts["tool"] = "ok" if ok else out
    if ok:
        facts["gpus"] = _parse_gpu_csv(out)
        topo_ok, topo = _run_tool([tool, "topo", "-m"])
        facts["topology"] = topo.rstrip() if topo_ok else None
    return facts


def _mpi4py_library(env: dict[str, str] | None) -> dict[str, Any]:
    """What mpi4py loads in a fresh interpreter with ``env`` (None: this one's environment)."""
    ok, out = _run_tool([sys.executable, "-c", _MPI4PY_PROBE], env=env)
    if not ok:
        return {"error": out}
    probe = json.loads(out.strip().splitlines()[-1])
    impl, version = library_identity(probe["library"])
    return {"mpi4py": probe["mpi4py"], "implementation": impl, "version": version,
            "library": probe["library"].replace("\x00", "").strip().splitlines()[0]}


def mpi_facts() -> dict[str, Any]:
    """The ``mpiexec`` taco would pick (its implementation and version) and what mpi4py loads, as is and with
    the environment taco gives its ranks (``MPI4PY_MPIABI`` and the library path, see :mod:`.launch.mpi`)."""
    from ..launch import mpi

    facts: dict[str, Any] = {"mpiexec": "missing", "implementation": None, "version": None}
    found = mpi._candidates(None)  # the interpreter's bin/ first, then PATH: the order find_mpi uses
    if found:
        ok, out = _run_tool([found[0], "--version"])
        facts["mpiexec"] = found[0]
        if ok:
            facts["implementation"], facts["version"] = library_identity(out)
        else:
            facts["error"] = out
    loaded = sys.modules.get("mpi4py.MPI")
    if loaded is not None:  # an engine: the library this very process runs on
        impl, version = library_identity(loaded.Get_library_version())
        facts["mpi4py_in_process"] = {"implementation": impl, "version": version}
    facts["mpi4py"] = as_is = _mpi4py_library(None)
    agrees = (as_is.get("implementation"), as_is.get("version")) == (facts["implementation"], facts["version"])
    if facts["implementation"] in ("mpich", "openmpi") and not agrees:  # would taco's ranks get it right?
        ranks_env = mpi.mpi4py_environment(found[0], facts["implementation"])
        facts["ranks_env"] = ranks_env
        if ranks_env:
            facts["mpi4py_with_ranks_env"] = _mpi4py_library({**os.environ, **ranks_env})
    return facts


def torch_facts() -> dict[str, Any]:
    """torch's version, its CUDA build, and NCCL's version where CUDA is built in and a GPU is visible.

    CUDA itself is not initialised (``torch.cuda.is_available()`` would pin the visible devices before
    placement); NCCL's version is a plain library call.
    """
    try:
        import torch
    except ImportError as exc:
        return {"version": "missing", "error": str(exc)}
    facts: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda, "nccl": None}
    if torch.version.cuda and hardware.visible_gpus() > 0:
        try:
            version = torch.cuda.nccl.version()
            facts["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as exc:  # noqa: BLE001 - any failure here is a fact to report, not a crash
            facts["nccl"] = f"unavailable: {exc}"
    return facts


def node_facts() -> dict[str, Any]:
    """One node's facts for the doctor: identity, huge pages, GPUs, NICs, CPUs/NUMA, MPI, torch. JSON-able."""
    return {"schema": SCHEMA, "hostname": socket.gethostname(),
            "node": os.environ.get("TACO_NODE_NAME") or socket.gethostname(),
            "python": sys.version.split()[0], "hugepages": hugepage_facts(), "gpus": gpu_facts(),
            "nics": hardware.network_interfaces(), "cpu": hardware.cpu_topology(), "mpi": mpi_facts(),
            "torch": torch_facts()}


def main() -> int:
    """``python -m taco_notebook.cluster.doctor.nodefacts``: this node's facts as one line of JSON on stdout."""
    print(json.dumps(node_facts()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
