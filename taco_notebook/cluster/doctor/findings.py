"""What is wrong with a node, from its facts (:mod:`.nodefacts`), and what to do about it.

:func:`diagnose` is pure: facts in, :class:`Finding` s out, so it applies the same to facts from an engine, from
ssh, or saved in a file. Severities: ``error`` (a job would fail or silently run wrong: no MPI, mpi4py on
another MPI), ``warning`` (it runs, slower or without a TACO feature: no huge pages, GPUs sharing a NIC),
``info`` (worth knowing: no GPU here).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Finding", "diagnose", "diagnose_cluster", "page_label", "parse_page_size", "SUGGESTED_2M_PAGES",
           "ONE_GB_CMDLINE"]

SUGGESTED_2M_PAGES = 1024  # 2 GiB: room for the 2D allreduce's intra-node buffer of a few 100 MB per rank
ONE_GB_CMDLINE = "default_hugepagesz=1GB hugepagesz=1GB hugepages=50"  # what TACO-Training's GPU nodes boot with
_2M, _1G = 2048, 1024 * 1024
_INSTALL_MPI = "`pip install mpich mpi4py` (or your system's Open MPI and mpi4py built against it)"


@dataclass(frozen=True)
class Finding:
    """A problem on a node: how bad (``error`` / ``warning`` / ``info``), what it is, and the fix."""

    severity: str
    problem: str
    remedy: str


def page_label(page_kb: int) -> str:
    """``2048`` → ``"2 MB"``, ``1048576`` → ``"1 GB"``."""
    return f"{page_kb // _1G} GB" if page_kb >= _1G else f"{page_kb // 1024} MB" if page_kb >= 1024 else \
        f"{page_kb} kB"


def parse_page_size(text: str) -> int:
    """``"2M"``, ``"2MB"``, ``"1G"``, ``"1GB"`` → kB; anything else is an error naming the choices."""
    sizes = {"2m": _2M, "2mb": _2M, "1g": _1G, "1gb": _1G}
    try:
        return sizes[text.strip().lower()]
    except KeyError:
        raise ValueError(f"huge page size must be 2M or 1G (or 'default'), got {text!r}") from None


def _mount_remedy(page_kb: int, default_kb: int | None) -> str:
    size = "2M" if page_kb == _2M else "1G"
    path = "/dev/hugepages" if page_kb == default_kb else f"/dev/hugepages{size}"
    return (f"`mkdir -p {path} && mount -t hugetlbfs -o pagesize={size} none {path}`, and to keep it: "
            f"`none {path} hugetlbfs pagesize={size} 0 0` in /etc/fstab")


def _one_gb_findings(one_gb: dict[str, int] | None) -> list[Finding]:
    """Information, not a warning: only a HARP-style user-space network stack on GPU nodes maps 1 GB pages;
    taco's own allreduce runs the same without them (its shared buffers use 2 MB pages or /dev/shm)."""
    if one_gb is None:
        return [Finding("info", "1 GB huge pages are not offered by this CPU or kernel (only a HARP-style "
                                "user-space network stack would use them; taco's allreduce does not)",
                        "for HARP: a CPU with the pdpe1gb flag (`grep -c pdpe1gb /proc/cpuinfo`) and a kernel with "
                        f"hugetlbfs; then `{ONE_GB_CMDLINE}` on the kernel command line and a reboot")]
    if one_gb["total"] == 0:
        return [Finding("info", "no 1 GB huge pages reserved (only a HARP-style user-space network stack would "
                                "use them; taco's allreduce does not)",
                        f"for HARP: add `{ONE_GB_CMDLINE}` to the kernel command line (GRUB_CMDLINE_LINUX in "
                        "/etc/default/grub, then `update-grub`) and reboot: 1 GB pages are reliably "
                        "reserved only at boot")]
    return []


def _hugepage_findings(facts: dict[str, Any]) -> list[Finding]:
    huge = facts.get("hugepages", {})
    pools, default_kb = huge.get("pools", {}), huge.get("default_kb")
    mounted = {m.get("page_kb") for m in huge.get("mounts", [])}
    found = _one_gb_findings(pools.get(str(_1G))) if _gpu_count(facts) else []  # only HARP on GPU nodes uses them
    two_mb = pools.get(str(_2M))
    if two_mb is None:
        found.append(Finding("warning", "this kernel has no huge page support",
                             "a kernel built with CONFIG_HUGETLBFS (every distribution kernel is)"))
    elif two_mb["total"] == 0:
        if default_kb == _2M:
            how = (f"`sysctl -w vm.nr_hugepages={SUGGESTED_2M_PAGES}` ({SUGGESTED_2M_PAGES} × 2 MB = "
                   f"{SUGGESTED_2M_PAGES * 2 // 1024} GiB; any N), and to keep it across reboots `echo "
                   f"'vm.nr_hugepages = {SUGGESTED_2M_PAGES}' > /etc/sysctl.d/80-hugepages.conf`")
        else:
            how = (f"`echo {SUGGESTED_2M_PAGES} > /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages` "
                   f"(vm.nr_hugepages sets the default {page_label(default_kb or _1G)} pool here), or "
                   f"`hugepagesz=2M hugepages={SUGGESTED_2M_PAGES}` on the kernel command line")
        found.append(Finding("warning", "no 2 MB huge pages reserved: the 2D allreduce's intra-node buffer falls "
                                        "back to /dev/shm", how))
    for size, pool in sorted(pools.items(), key=lambda item: int(item[0])):
        label = page_label(int(size))
        if pool["total"] > 0 and pool["free"] == 0:
            found.append(Finding("warning", f"all {pool['total']} {label} huge pages are in use",
                                 "stop what holds them (`grep -l huge /proc/*/numa_maps`) or reserve more"))
        if pool["total"] > 0 and int(size) not in mounted:
            found.append(Finding("warning", f"{pool['total']} {label} huge pages reserved but no hugetlbfs is "
                                            f"mounted for them, so no program can map them",
                                 _mount_remedy(int(size), default_kb)))
    return found


def _gpu_count(facts: dict[str, Any]) -> int:
    gpus = facts.get("gpus", {})
    return max(len(gpus.get("gpus", [])), int(gpus.get("driver_gpus", 0)))


def _gpu_findings(facts: dict[str, Any]) -> list[Finding]:
    gpus = facts.get("gpus", {})
    tool, count = gpus.get("tool"), _gpu_count(facts)
    if tool == "missing" and count:
        return [Finding("warning", f"nvidia-smi missing: the driver lists {count} GPU(s) but their memory and "
                                   "interconnect topology cannot be read",
                        "install the NVIDIA driver's utilities (Debian/Ubuntu: nvidia-utils-<driver version>) "
                        "so that nvidia-smi is on PATH")]
    if tool == "missing":
        return [Finding("info", "no NVIDIA GPU (no nvidia-smi, no /proc/driver/nvidia): ranks train on CPU "
                                "with gloo", "nothing for CPU training; for GPUs install the NVIDIA driver")]
    if tool not in (None, "ok"):
        return [Finding("error", f"nvidia-smi failed: {tool}",
                        "run `nvidia-smi` by hand: a driver/library version mismatch needs the driver "
                        "reinstalled or a reboot")]
    if tool == "ok" and count and gpus.get("topology") is None:
        return [Finding("info", "`nvidia-smi topo -m` gave no topology",
                        "run it by hand; without it NVLink/PCIe placement is unknown")]
    return []


def _nic_findings(facts: dict[str, Any]) -> list[Finding]:
    nics = [n for n in facts.get("nics", []) if n.get("up")]
    if not nics:
        return [Finding("warning", "no network interface is up: this node cannot reach another",
                        "bring one up (`ip link set DEV up`) and give it an address")]
    hardware = [n for n in nics if n.get("hardware")] or nics
    gpus = _gpu_count(facts)
    if gpus > len(hardware):
        names = ", ".join(str(n["name"]) for n in hardware)
        return [Finding("warning", f"{gpus} GPUs share {len(hardware)} NIC(s) ({names}): each GPU gets "
                                   f"1/{gpus / len(hardware):g} of a NIC for the inter-node step",
                        "one NIC per GPU, as TACO's 2D allreduce expects (on a cloud: an instance type with "
                        f"{gpus} network interfaces, each on its own subnet)")]
    return []


def _mpi_findings(facts: dict[str, Any]) -> list[Finding]:
    mpi = facts.get("mpi", {})
    if mpi.get("mpiexec") == "missing":
        return [Finding("error", "no mpiexec beside this Python or on PATH", f"install one: {_INSTALL_MPI}")]
    if mpi.get("error"):
        return [Finding("error", f"mpiexec does not run: {mpi['error']}", f"reinstall it: {_INSTALL_MPI}")]
    mine = (mpi.get("implementation"), mpi.get("version"))
    loaded = mpi.get("mpi4py", {})
    if loaded.get("error"):
        return [Finding("error", f"mpi4py cannot load an MPI: {loaded['error']}",
                        "`pip install mpi4py` into this Python")]
    in_process = mpi.get("mpi4py_in_process")
    if in_process and (in_process["implementation"], in_process["version"]) != mine:
        return [Finding("error", f"this engine's mpi4py runs on {in_process['implementation']} "
                                 f"{in_process['version']}, mpiexec is {mine[0]} {mine[1]}",
                        "start the cluster with the mpiexec of that MPI (--mpiexec PATH)")]
    if (loaded.get("implementation"), loaded.get("version")) == mine:
        return []
    env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in mpi.get("ranks_env", {}).items())
    fixed = mpi.get("mpi4py_with_ranks_env", {})
    said = f"mpi4py loads {loaded.get('implementation')} {loaded.get('version')} but mpiexec is {mine[0]} {mine[1]}"
    if env and (fixed.get("implementation"), fixed.get("version")) == mine:
        return [Finding("warning", f"{said}: taco's ranks get MPI4PY_MPIABI={mine[0]} and its library path, so "
                                   "they agree, but a plain `mpiexec python train.py` would run every rank alone "
                                   "(world size 1)",
                        f"`export {env}` in the shell (or the job script) that runs mpiexec")]
    return [Finding("error", f"{said}: every rank would run alone (world size 1)",
                    f"launch with the mpiexec of the MPI mpi4py loads (--mpiexec PATH), or "
                    f"{'`export ' + env + '`' if env else 'reinstall mpi4py against ' + str(mine[0])}")]


def _torch_findings(facts: dict[str, Any]) -> list[Finding]:
    torch, gpus = facts.get("torch", {}), _gpu_count(facts)
    if torch.get("version") == "missing":
        return [Finding("error", "torch is not installed", "`pip install torch` (the build for this node's CUDA)")]
    if gpus and not torch.get("cuda"):
        return [Finding("warning", f"torch {torch.get('version')} is a CPU build on a node with {gpus} GPU(s)",
                        "install a CUDA build of torch (https://pytorch.org/get-started/locally/)")]
    nccl = torch.get("nccl")
    if gpus and torch.get("cuda") and (nccl is None or str(nccl).startswith("unavailable")):
        return [Finding("warning", f"NCCL is not usable from torch: {nccl}",
                        "a torch CUDA build that ships NCCL (the PyPI wheels do); ranks fall back to gloo")]
    return []


_CHECKS: tuple[Callable[[dict[str, Any]], list[Finding]], ...] = (
    _hugepage_findings, _gpu_findings, _nic_findings, _mpi_findings, _torch_findings)


def diagnose(facts: dict[str, Any]) -> list[Finding]:
    """Every problem one node's facts show, each with its remedy; a node that could not be read is one error."""
    if "error" in facts:
        return [Finding("error", f"could not read the node: {facts['error']}",
                        "check that the node is reachable and has taco_notebook and torch installed")]
    return [finding for check in _CHECKS for finding in check(facts)]


def _differs(facts: list[dict[str, Any]], what: Callable[[dict[str, Any]], str]) -> str | None:
    """``"n0 a; n1 b"`` when the nodes' ``what`` differ, else None."""
    seen = {str(f.get("node")): what(f) for f in facts}
    return "; ".join(f"{node} {value}" for node, value in seen.items()) if len(set(seen.values())) > 1 else None


def diagnose_cluster(facts: list[dict[str, Any]], links: list[dict[str, Any]]) -> list[Finding]:
    """What is wrong between nodes: different MPIs or torch versions, a link that could not be measured."""
    readable = [f for f in facts if "error" not in f]
    found = []
    mpis = _differs(readable, lambda f: f"{f.get('mpi', {}).get('implementation')} "
                                        f"{f.get('mpi', {}).get('version')}")
    if mpis:
        found.append(Finding("error", f"the nodes run different MPIs ({mpis}): one mpiexec cannot start them all",
                             "install the same MPI (implementation and version) on every node"))
    torches = _differs(readable, lambda f: str(f.get("torch", {}).get("version")))
    if torches:
        found.append(Finding("warning", f"the nodes run different torch versions ({torches})",
                             "install the same torch build on every node: collectives of different versions "
                             "are not guaranteed to interoperate"))
    for link in links:
        if link.get("error"):
            found.append(Finding("warning", f"the link {link['from']} → {link['to']} could not be measured: "
                                            f"{link['error']}",
                                 f"check that {link['to']} accepts TCP connections from {link['from']} (a "
                                 "firewall on ephemeral ports stops MPI and gloo too)"))
    return found
