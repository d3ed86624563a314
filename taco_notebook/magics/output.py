"""What a kernel shows: per-rank output (the plan layer's :class:`~taco_notebook.plan.output.RankOutput`, whose
ranks' rich output, ``display(obj)``, reaches the notebook as the kernel's own) and the doctor's report."""

from __future__ import annotations

from typing import Any

from ..cluster.doctor.render import ShownReport
from ..plan.output import RankOutput

__all__ = ["NotebookOutput", "show_report"]


class NotebookOutput(RankOutput):
    """:class:`RankOutput` that publishes a rank's display data through IPython, as a cell's own output."""

    def display(self, rank: int, content: dict[str, Any]) -> None:
        from IPython.display import publish_display_data

        self.flush()
        self._target("stdout").write(f"[rank {rank}] display:\n")
        publish_display_data(data=content.get("data", {}), metadata=content.get("metadata", {}))


def show_report(report: ShownReport) -> None:
    """The doctor's report as HTML (with the text table beside it) in a notebook's kernel, else the text table."""
    from IPython import get_ipython
    from IPython.display import display

    if getattr(get_ipython(), "kernel", None) is None:  # a terminal: its display shows text/plain only
        print(report)
        return
    display({"text/html": report._repr_html_(), "text/plain": str(report)}, raw=True)
