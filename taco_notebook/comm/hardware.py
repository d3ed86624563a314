"""What a node offers a training job, read without importing torch: GPUs the rank can see, huge pages.

Lives in comm/ because a rank reads it about its own node: at cluster start (the registry and the sidebar show
it per node) and in placement (``--gpus auto`` counts the GPUs before CUDA is initialised).
"""

from __future__ import annotations

import os

__all__ = ["visible_gpus", "gpu_names", "hugepages"]

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
