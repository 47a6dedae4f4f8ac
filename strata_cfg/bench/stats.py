"""Order statistics of measured times and rates: percentiles and the median."""

from __future__ import annotations

from ..schema.workloads import percentile

__all__ = ["median", "percentile"]


def median(xs: list[float]) -> float:
    """The median, 0.0 for no values."""
    return percentile(xs, 0.5) or 0.0
