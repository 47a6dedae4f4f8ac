"""SwiGLU's gate: ``silu(gate) * up``, computed in fp32 and rounded once to the input dtype."""

from __future__ import annotations

from typing import Any

from ...reference import ops as reference
from . import locked_cache, on_gpu


@locked_cache
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
    return reference.silu_mul(gate, up)
