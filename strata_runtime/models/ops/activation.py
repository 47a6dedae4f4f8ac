"""SwiGLU's gate: ``silu(gate) * up``, computed in fp32 and rounded once to the input dtype."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from . import on_gpu


def silu_mul_reference(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """The NumPy twin."""
    g = gate.astype(np.float32)  # [R, I]
    return (g / (np.float32(1.0) + np.exp(-g)) * up.astype(np.float32)).astype(gate.dtype)  # [R, I]


@functools.cache
def _kernel() -> Any:
    import cupy

    return cupy.ElementwiseKernel(
        "T g, T u",
        "T y",
        "float gf = (float)g; y = (T)(gf / (1.0f + expf(-gf)) * (float)u);",
        "strata_silu_mul",
    )


def silu_mul(gate: Any, up: Any) -> Any:
    """``silu(gate) * up`` elementwise (both [R, I], possibly strided views)."""
    if on_gpu(gate):
        return _kernel()(gate, up)
    return silu_mul_reference(gate, up)
