"""Engine side of the live dashboard: send metric snapshots to the notebook while a cell runs.

Installed on every engine at cluster start. ``taco.metrics`` calls the publisher at most every interval (from
``step()`` and ``taco.progress``); the payload travels on the engine's IOPub as an ipyparallel ``data_message``
and lands in the cell's ``AsyncResult`` metadata (``md["data"]["taco"]``, latest value wins), which the
client's wait loop reads. After every execution the engine publishes once more if anything changed, so the
dashboard's final picture is the cell's true end state, not the last throttled one.
"""

from __future__ import annotations

from typing import Any

from ..comm import metrics

__all__ = ["install", "begin_cell", "KEY"]

KEY = "taco"
PUBLISH_S = 0.4  # 2.5 redraws a second: what a person can follow; more only costs the ranks and the notebook


class _Sender:
    """The publisher: remembers what it last sent so the post-execute flush sends only news."""

    def __init__(self) -> None:
        self.sent: tuple[int, Any] | None = None

    def __call__(self, payload: dict[str, Any]) -> None:
        from ipyparallel.datapub import publish_data

        progress = payload.get("progress")
        self.sent = (payload["metrics"]["steps"], progress and progress.get("n"))
        publish_data({KEY: payload})

    def flush(self) -> None:
        """post_execute: publish the end state if steps or progress moved since the last send."""
        if metrics._publishing.publisher is not self:
            return
        progress = metrics._publishing.progress
        now = (metrics._metrics.steps, progress and progress.get("n"))
        if now != self.sent and (now[0] or progress is not None):
            metrics.publish()


_sender = _Sender()


def install() -> None:
    """Flush the end state after every execution; :func:`begin_cell` decides per cell whether to publish at all."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None and _sender.flush not in shell.events.callbacks["post_execute"]:
        shell.events.register("post_execute", _sender.flush)


def begin_cell(dashboard: bool = True, interval: float = PUBLISH_S) -> None:
    """Before a ``%%taco_run`` cell: count from zero, and publish only if the cell has a dashboard."""
    metrics.reset()
    _sender.sent = None
    metrics.set_publisher(_sender if dashboard else None, interval)
