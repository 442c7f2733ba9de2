"""Rank 0's live progress line: step, loss, tokens/s, ETA.

On a terminal the line is redrawn in place (a carriage return, no extra
dependency); when output goes to a file or a pipe (CI, ``| tee``), a full
line is printed every ``every`` steps instead, so logs stay readable.
"""

from __future__ import annotations

import time
from typing import TextIO

from shard_cli._format import format_duration, format_rate

__all__ = ["Progress"]

_BAR = 24


class Progress:
    """The progress display of one run, from ``first`` to ``last`` step."""

    def __init__(
        self, out: TextIO, *, first: int, last: int, tty: bool, every: int | None = None
    ) -> None:
        self.out = out
        self.first = first
        self.last = last
        self.tty = tty
        self.every = every or max(1, (last - first + 1) // 10)
        self._start = time.perf_counter()
        self._drawn = False

    def line(self, step: int, loss: float, tokens_per_s: float, elapsed: float) -> str:
        """The text shown after ``step``."""
        done = step - self.first + 1
        total = self.last - self.first + 1
        filled = round(_BAR * done / total)
        eta = elapsed / done * (total - done) if done else 0.0
        width = len(str(self.last))
        return (
            f"step {step:>{width}}/{self.last} [{'#' * filled}{'.' * (_BAR - filled)}] "
            f"loss {loss:.3f}  {format_rate(tokens_per_s)} tok/s  ETA {format_duration(eta)}"
        )

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Show the state after ``step``."""
        text = self.line(step, loss, tokens_per_s, time.perf_counter() - self._start)
        if self.tty:
            self.out.write("\r" + text)
            self._drawn = True
        elif step in (self.first, self.last) or (step - self.first + 1) % self.every == 0:
            self.out.write(text + "\n")
        self.out.flush()

    def close(self) -> None:
        """End the redrawn line (terminal only)."""
        if self._drawn:
            self.out.write("\n")
            self.out.flush()
            self._drawn = False
