"""Progress of a long command on stderr.

On a terminal it is one bar redrawn in place; anywhere else (a log file, CI) a redraw with
``\\r`` smears into one long line, so each step is a plain line of its own instead.
"""
from __future__ import annotations

import sys


class Progress:
    """``begin(label)`` before a step, ``end()`` after it, ``finish()`` at the end;
    ``add(steps)`` when more steps turn up."""

    def __init__(self, total: int, stream=None, width: int = 28):
        self.total, self.done, self.width = total, 0, width
        self.stream = stream or sys.stderr
        self.label = ""
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())

    def _count(self) -> str:
        return f"{self.done}/{self.total}"

    def _draw(self) -> None:
        filled = self.width * self.done // max(1, self.total)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self._count()} {self.label}"[:120].ljust(120))
        self.stream.flush()

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def add(self, steps: int) -> None:
        self.total += steps
        if self.live:
            self._draw()

    def begin(self, label: str) -> None:
        self.label = label
        if self.live:
            self._draw()
        else:
            self._line(f"[{self.done + 1}/{self.total}] {label} ...")

    def end(self) -> None:
        self.done += 1
        if self.live:
            self._draw()

    def finish(self) -> None:
        self.label = "done"
        if self.live:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
        else:
            self._line(f"[{self._count()}] done")
