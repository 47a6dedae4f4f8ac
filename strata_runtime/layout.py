"""Where each row of a window sits: which slot, which position.

A window's rows are grouped in segments, one per slot, each a run of consecutive positions of that slot
(its token, then its proposals, or a prefill chunk). Attention runs per segment over that slot's KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Segment:
    """``n`` consecutive rows of one slot, starting at window row ``row`` and at position ``pos``."""

    slot: int
    row: int
    n: int
    pos: int


@dataclass(frozen=True)
class Layout:
    """The segments of a window, in row order, covering every row exactly once."""

    segments: tuple[Segment, ...]

    @classmethod
    def of(cls, runs: list[tuple[int, int, int]]) -> Layout:
        """From ``(slot, n_rows, first_position)`` runs, in row order."""
        segments, row = [], 0
        for slot, n, pos in runs:
            segments.append(Segment(slot, row, n, pos))
            row += n
        return cls(tuple(segments))

    @property
    def rows(self) -> int:
        return sum(s.n for s in self.segments)

    def positions(self) -> np.ndarray:
        """The position of every row [R]."""
        if not self.segments:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(s.pos, s.pos + s.n, dtype=np.int64) for s in self.segments])

    def slots(self) -> tuple[int, ...]:
        return tuple(s.slot for s in self.segments)

    def row_slots(self) -> np.ndarray:
        """The slot of every row [R]."""
        if not self.segments:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.full(s.n, s.slot, dtype=np.int64) for s in self.segments])

    def placed(self, positions: np.ndarray) -> Layout:
        """The same segments at the positions of ``positions`` [R] (each segment starts at the position of its
        first row): a window whose positions were decided on a device, once they are on the host."""
        return Layout(tuple(Segment(s.slot, s.row, s.n, int(positions[s.row])) for s in self.segments))

    def rows_between(self, start: int, stop: int) -> Layout:
        """The layout of window rows [start, stop), renumbered from row 0 (segments clipped to the range)."""
        out = []
        for s in self.segments:
            lo, hi = max(s.row, start), min(s.row + s.n, stop)
            if lo < hi:
                out.append(Segment(s.slot, lo - start, hi - lo, s.pos + lo - s.row))
        return Layout(tuple(out))
