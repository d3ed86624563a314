"""What a node offers a training job, read without importing torch: GPUs the rank can see, huge pages.

Lives in comm/ because a rank reads it about its own node: at cluster start (the registry and the sidebar show
it per node), in placement (``--gpus auto`` counts the GPUs before CUDA is initialised), and for ``%taco_doctor``
(huge page pools and hugetlbfs mounts, NICs, CPUs and NUMA nodes; gathered by
:mod:`taco_notebook.cluster.doctor.nodefacts`).
"""

from __future__ import annotations

import os
import re

__all__ = ["visible_gpus", "gpu_names", "hugepages", "hugepage_pools", "hugetlbfs_mounts", "network_interfaces",
           "cpu_topology"]

_NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use: the driver's devices, cut by ``CUDA_VISIBLE_DEVICES``.

    Reads ``/proc/driver/nvidia/gpus`` (one directory per GPU) instead of asking CUDA, which would initialise it.
    """
    try:
        gpus = len(os.listdir(_NVIDIA_GPUS))
    except OSError:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # CUDA stops at the first invalid entry ("-1" hides every device)
        entries = [d.strip() for d in visible.split(",")]
        gpus = min(gpus, next((i for i, d in enumerate(entries) if not d or d.startswith("-")), len(entries)))
    return gpus


def gpu_names() -> list[str]:
    """Models of the GPUs this process may use ("NVIDIA H100 80GB HBM3"), from the driver's /proc files.

    The driver lists devices by PCI bus id; ``CUDA_VISIBLE_DEVICES`` of plain indices picks among them in
    that order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``), anything else keeps the first :func:`visible_gpus`.
    No CUDA initialisation, so it is safe before placement.
    """
    try:
        buses = sorted(os.listdir(_NVIDIA_GPUS))
    except OSError:
        return []
    names = []
    for bus in buses:
        model = "unknown NVIDIA GPU"
        try:
            with open(os.path.join(_NVIDIA_GPUS, bus, "information")) as info:
                for line in info:
                    if line.startswith("Model:"):
                        model = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        names.append(model)
    count = visible_gpus()
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")][:count]
    if visible and all(d.isdigit() and int(d) < len(names) for d in visible):
        return [names[int(d)] for d in visible]
    return names[:count]


def hugepages() -> dict[str, int] | None:
    """``{"total", "free", "page_kb"}`` from ``/proc/meminfo``; None where the kernel reports none."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in meminfo)
                      if k in ("HugePages_Total", "HugePages_Free", "Hugepagesize")}
        return {"total": fields["HugePages_Total"], "free": fields["HugePages_Free"], "page_kb": fields["Hugepagesize"]}
    except (OSError, KeyError, ValueError):
        return None


# ---- what `%taco_doctor` reads about a node (no subprocess, no torch) ----------------------------------------
_HUGEPAGES_SYS = "/sys/kernel/mm/hugepages"
_NET_SYS = "/sys/class/net"
_NODE_SYS = "/sys/devices/system/node"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:  # absent, or EINVAL (a virtual NIC's speed)
        return None


def _read_int(path: str) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def hugepage_pools() -> dict[str, dict[str, int]]:
    """Each huge page size the kernel offers, by its size in kB (``"2048"``, ``"1048576"``): total, free, reserved.

    From ``/sys/kernel/mm/hugepages/hugepages-<size>kB``: 1 GB pages appear there only where the CPU and kernel
    support them (``pdpe1gb``), so an absent ``"1048576"`` means "not possible here", a zero total "not reserved".
    """
    pools: dict[str, dict[str, int]] = {}
    try:
        entries = sorted(os.listdir(_HUGEPAGES_SYS))
    except OSError:
        return pools
    for entry in entries:
        if not (entry.startswith("hugepages-") and entry.endswith("kB")):
            continue
        base = os.path.join(_HUGEPAGES_SYS, entry)
        pools[entry[len("hugepages-"):-len("kB")]] = {
            "total": _read_int(os.path.join(base, "nr_hugepages")) or 0,
            "free": _read_int(os.path.join(base, "free_hugepages")) or 0,
            "reserved": _read_int(os.path.join(base, "resv_hugepages")) or 0,
        }
    return pools


def _size_kb(text: str) -> int | None:
    """``"2M"``, ``"1G"``, ``"2048k"`` (hugetlbfs's ``pagesize=`` option) in kB."""
    units = {"k": 1, "m": 1024, "g": 1024 * 1024}
    text = text.strip().lower().rstrip("b")
    if text and text[-1] in units and text[:-1].isdigit():
        return int(text[:-1]) * units[text[-1]]
    return int(text) // 1024 if text.isdigit() else None


def hugetlbfs_mounts(mounts_file: str = "/proc/mounts") -> list[dict[str, object]]:
    """Where hugetlbfs is mounted: ``[{"path", "page_kb"}]``; the page size is the mount's ``pagesize=``, else
    the kernel's default huge page size (``Hugepagesize`` in /proc/meminfo)."""
    default = (hugepages() or {}).get("page_kb")
    found: list[dict[str, object]] = []
    try:
        with open(mounts_file) as mounts:
            lines = mounts.read().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) < 4 or fields[2] != "hugetlbfs":
            continue
        page_kb = default
        for option in fields[3].split(","):
            if option.startswith("pagesize="):
                page_kb = _size_kb(option.split("=", 1)[1])
        # /proc/mounts escapes spaces and tabs in paths as octal (\040)
        path = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
        found.append({"path": path, "page_kb": page_kb})
    return found


def network_interfaces() -> list[dict[str, object]]:
    """This network namespace's NICs but loopback: name, speed (Mbit/s, None when the driver has none), MTU,
    up, and whether it is hardware (has a ``device``: physical or a VM's virtio NIC) or virtual (veth, bridge)."""
    try:
        names = sorted(os.listdir(_NET_SYS))
    except OSError:
        return []
    nics: list[dict[str, object]] = []
    for name in names:
        base = os.path.join(_NET_SYS, name)
        if name == "lo" or _read(os.path.join(base, "type")) == "772":  # 772: ARPHRD_LOOPBACK
            continue
        speed = _read_int(os.path.join(base, "speed"))
        nics.append({"name": name, "speed_mbit": speed if speed is not None and speed > 0 else None,
                     "mtu": _read_int(os.path.join(base, "mtu")),
                     "up": _read(os.path.join(base, "operstate")) == "up",
                     "hardware": os.path.exists(os.path.join(base, "device"))})
    return nics


def _cpulist_count(text: str) -> int:
    """CPUs in a kernel cpulist such as ``"0-3,8-11"``."""
    count = 0
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        count += int(high or low) - int(low) + 1
    return count


def cpu_topology() -> dict[str, object]:
    """Online CPUs, this process's usable CPUs, and NUMA nodes with their CPUs (``/sys/devices/system/node``)."""
    numa: list[dict[str, object]] = []
    try:
        entries = sorted((e for e in os.listdir(_NODE_SYS) if e.startswith("node") and e[4:].isdigit()),
                         key=lambda e: int(e[4:]))
    except OSError:
        entries = []
    for entry in entries:
        cpus = _read(os.path.join(_NODE_SYS, entry, "cpulist")) or ""
        numa.append({"node": int(entry[4:]), "cpus": cpus, "cpu_count": _cpulist_count(cpus)})
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpus": os.cpu_count(), "usable_cpus": usable, "numa_nodes": numa}
