"""This rank's GPU as the dashboard shows it: name, memory in use and its peak (torch's caching allocator, host-side
counters, no sync), and utilization through NVML where it is importable."""

from __future__ import annotations

from typing import Any

__all__ = ["gpu_snapshot"]

_gpu_names: dict[int, str] = {}
_nvml_handles: dict[int, Any] = {}


def _utilization(index: int) -> float | None:
    """Percent (0-100) of time the GPU was busy over the driver's last sample, through NVML if importable.

    The NVML index is the CUDA index only when ``CUDA_VISIBLE_DEVICES`` does not reorder devices; the
    handle is looked up by PCI bus id to be exact.
    """
    try:
        import pynvml  # optional dependency (nvidia-ml-py)
        import torch

        handle = _nvml_handles.get(index)
        if handle is None:
            pynvml.nvmlInit()
            props = torch.cuda.get_device_properties(index)
            ids = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
            bus = f"{ids[0]:08x}:{ids[1]:02x}:{ids[2]:02x}.0" if None not in ids else None
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus) if bus else pynvml.nvmlDeviceGetHandleByIndex(index)
            _nvml_handles[index] = handle
        return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # noqa: BLE001 - no NVML, no permission, or an old driver: utilization is optional
        return None


def gpu_snapshot(device: Any) -> dict[str, Any] | None:
    """``{"name", "memory_bytes", "peak_bytes", "utilization"}`` of this rank's GPU; None on CPU.

    Memory is torch's caching allocator (allocated now, and its peak since the process started or
    ``torch.cuda.reset_peak_memory_stats``): host-side counters, no GPU sync. Never initialises CUDA.
    """
    if device is None or getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    if not torch.cuda.is_initialized():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = _gpu_names.get(index)
    if name is None:
        name = _gpu_names[index] = torch.cuda.get_device_name(index)
    return {
        "name": name,
        "memory_bytes": int(torch.cuda.memory_allocated(index)),
        "peak_bytes": int(torch.cuda.max_memory_allocated(index)),
        "utilization": _utilization(index),
    }
