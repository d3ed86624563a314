"""Per-rank output: every line labelled ``[rank N]``, live or grouped at the end, in a kernel or a shell."""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["RankOutput"]


class RankOutput:
    """Receives engines' stream chunks and prints whole lines with their rank's label.

    With ``live=False`` everything is kept and printed grouped by rank on :meth:`flush`. ``quiet`` silences
    the magic's own lines (notices on stdout, warnings on stderr), never the ranks' output.
    """

    def __init__(self, live: bool = True, quiet: bool = False,
                 stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        self.live = live
        self.quiet = quiet
        self._out = stdout
        self._err = stderr
        self._partial: dict[tuple[int, str], str] = {}
        self._held: dict[int, list[tuple[str, str]]] = {}

    def _target(self, name: str) -> TextIO:
        if name == "stderr":
            return self._err or sys.stderr
        return self._out or sys.stdout

    def _emit(self, rank: int, name: str, line: str) -> None:
        if self.live:
            target = self._target(name)
            target.write(f"[rank {rank}] {line}")
            target.flush()
        else:
            self._held.setdefault(rank, []).append((name, line))

    def stream(self, rank: int, name: str, text: str) -> None:
        buffered = self._partial.pop((rank, name), "") + text
        lines = buffered.splitlines(keepends=True)
        if lines and not lines[-1].endswith("\n"):
            self._partial[(rank, name)] = lines.pop()
        for line in lines:
            self._emit(rank, name, line)

    def display(self, rank: int, content: dict[str, Any]) -> None:
        """A rank's rich output (``display(obj)``) where no frontend shows it: its text form, as IPython prints it
        outside a kernel; :class:`~taco_notebook.magics.output.NotebookOutput` publishes it to the notebook."""
        self.flush()
        target = self._target("stdout")
        target.write(f"[rank {rank}] display:\n")
        text = content.get("data", {}).get("text/plain")
        if text is not None:
            target.write(f"{text}\n")
        target.flush()

    def notice(self, text: str) -> None:
        """An informational line (cluster starting, ready, stopped): stdout, so the notebook does not show it
        in the red box it keeps for errors. ``--quiet`` silences it."""
        if not self.quiet:
            target = self._target("stdout")
            target.write(f"[taco] {text}\n")
            target.flush()

    def warn(self, text: str) -> None:
        """A line about something going wrong or being lost (a rank failed, engines killed or restarted):
        stderr. ``--quiet`` silences it too, as it does the magic's other messages."""
        if not self.quiet:
            target = self._target("stderr")
            target.write(f"[taco] {text}\n")
            target.flush()

    def flush(self) -> None:
        for (rank, name), text in sorted(self._partial.items()):
            self._emit(rank, name, text + "\n")
        self._partial.clear()
        if not self.live:
            for rank in sorted(self._held):
                for name, line in self._held[rank]:
                    self._target(name).write(f"[rank {rank}] {line}")
            self._held.clear()
            for name in ("stdout", "stderr"):
                self._target(name).flush()
