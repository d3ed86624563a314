"""Per-rank output in a kernel: the plan layer's :class:`~taco_notebook.plan.output.RankOutput`, whose ranks' rich
output (``display(obj)``) reaches the notebook as the kernel's own."""

from __future__ import annotations

from typing import Any

from ..plan.output import RankOutput

__all__ = ["NotebookOutput"]


class NotebookOutput(RankOutput):
    """:class:`RankOutput` that publishes a rank's display data through IPython, as a cell's own output."""

    def display(self, rank: int, content: dict[str, Any]) -> None:
        from IPython.display import publish_display_data

        self.flush()
        self._target("stdout").write(f"[rank {rank}] display:\n")
        publish_display_data(data=content.get("data", {}), metadata=content.get("metadata", {}))
