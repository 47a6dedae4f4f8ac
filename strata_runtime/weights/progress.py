"""Progress of loading weights: a bar per stage, on a terminal or wherever the caller reports it."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Protocol, TextIO


class ProgressBar:
    """A one-line progress bar on stderr (or any text stream), redrawn at most every 0.1 s."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.label, self.total, self.done = label, max(total, 1), 0
        self.stream = stream or sys.stderr
        self.width, self._last = width, 0.0

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= 0.1 or self.done >= self.total:
            self._last = now
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * self.width)
            gb = self.done / 1e9
            self.stream.write(f"\r{self.label} [{bar:<{self.width}}] {frac:4.0%} {gb:.2f} GB")
            self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


class Bar(Protocol):
    """One loading step's progress: bytes done so far, then closed."""

    def advance(self, n: int) -> None: ...

    def close(self) -> None: ...


Progress = Callable[[str, int], Bar | None]
"""Makes a progress bar for (label, total bytes), or None for no bar: `stderr_progress`, or the server's
(`strata_runtime.server.engine_loop.LoadProgress`), which reports it on ``/health``."""


def stderr_progress(label: str, total: int) -> ProgressBar | None:
    """A bar on stderr when it is a terminal (a redrawn line makes no sense in a log file)."""
    return ProgressBar(label, total) if sys.stderr.isatty() else None
