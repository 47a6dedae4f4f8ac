"""Order statistics of measured times and rates: percentiles and the median."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile with linear interpolation between the closest ranks; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(xs: list[float]) -> float:
    """The median, 0.0 for no values."""
    return percentile(xs, 0.5) or 0.0
