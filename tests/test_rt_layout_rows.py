"""Slicing a window's layout into row ranges (the CUDA path runs short prompts 8 rows at a time)."""

from __future__ import annotations

import numpy as np

from strata_runtime.layout import Layout


def test_rows_between_covers_every_row_once_with_its_position():
    g = np.random.default_rng(109)
    sizes, starts = g.integers(1, 20, 4), g.integers(0, 100, 4)
    runs = [(s, int(sizes[s]), int(starts[s])) for s in range(4)]
    layout = Layout.of(runs)
    step = int(g.integers(1, 9))
    slots, positions = [], []
    for a in range(0, layout.rows, step):
        part = layout.rows_between(a, a + step)
        assert part.rows == min(step, layout.rows - a)
        assert part.segments[0].row == 0
        slots += [s.slot for s in part.segments for _ in range(s.n)]
        positions += part.positions().tolist()
    assert positions == layout.positions().tolist()
    assert slots == [s.slot for s in layout.segments for _ in range(s.n)]
