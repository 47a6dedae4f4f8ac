"""NeoX rotary position embedding (rotate-half), with per-row cos/sin tables in fp32."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...reference import ops as reference
from . import locked_cache, on_gpu


@locked_cache
def _kernel() -> Any:
    import cupy

    # One thread per element of x; the partner element is the other half of the same head.
    return cupy.ElementwiseKernel(
        "raw T x, raw float32 cos, raw float32 sin, int32 heads, int32 dim",
        "T y",
        """
        int half = dim / 2;
        int j = i % dim;
        long long row = i / ((long long)heads * dim);
        int f = j % half;
        T c = (T)cos[row * half + f];
        T s = (T)sin[row * half + f];
        T partner = j < half ? (T)(-x[i + half]) : x[i - half];
        y = x[i] * c + partner * s;
        """,
        "strata_rope",
    )


def rope(x: Any, cos: Any, sin: Any) -> Any:
    """Rotate ``x`` [R, N, D] by the angles of each row's position."""
    if not on_gpu(x):
        return reference.rope(x, cos, sin)
    import cupy

    xc = cupy.ascontiguousarray(x)
    y = cupy.empty_like(xc)
    _kernel()(
        xc,
        cupy.ascontiguousarray(cos),
        cupy.ascontiguousarray(sin),
        np.int32(x.shape[1]),
        np.int32(x.shape[2]),
        y,
    )
    return y
