"""taco's controller process (``python -m taco_notebook.controller``): :class:`taco_notebook.ipp.hub.TacoController`
with ipyparallel's command line (:data:`taco_notebook.cluster.launch.engineset.CONTROLLER_CMD`)."""

from __future__ import annotations

from ..ipp.hub import TacoController

__all__ = ["raise_open_files_limit", "main"]


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit (its children, the controller's queues
    and schedulers, inherit it); return ``(soft, hard)`` as they are after.

    Every engine holds connections to each of the controller's processes: about two descriptors per engine in
    the busiest. The usual soft limit of 1,024 would stop registration near 500 engines, with the hard limit
    often far above it (:func:`taco_notebook.cluster.launch.engineset.check_open_files` refuses a size the hard
    limit cannot hold).
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def main() -> None:
    raise_open_files_limit()
    TacoController.launch_instance()

