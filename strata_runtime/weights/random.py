"""Counter-based random weights: the same numbers on every device and for every stage split.

Element ``i`` of a tensor is a pure function of ``(seed, i)`` (splitmix64 of the counter), so a stage that
generates only its own tensors gets exactly what whole-model generation would, and a GPU gets bit for bit
what a virtual CPU device gets. Values are uniform in ``[-bound, bound)`` with 24 bits of resolution.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import numpy as np

from ..models.ops import on_gpu
from ..reference import ops as reference
from ..reference.ops import SPLITMIX_GOLDEN, SPLITMIX_M1, SPLITMIX_M2

_MASK = (1 << 64) - 1


def mix64(z: int) -> int:
    """splitmix64's finaliser on a Python int."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * SPLITMIX_M1) & _MASK
    z = ((z ^ (z >> 27)) * SPLITMIX_M2) & _MASK
    return z ^ (z >> 31)


def tensor_seed(seed: int, name: str) -> int:
    """The seed of one named tensor: independent of which stage or device generates it."""
    return mix64((seed << 32) ^ zlib.crc32(name.encode()))


@functools.cache
def _uniform_kernel() -> Any:
    import cupy

    return cupy.ElementwiseKernel(
        "uint64 seed, float32 bound",
        "T y",
        """
        unsigned long long z = (unsigned long long)i * 0x9E3779B97F4A7C15ull + seed;
        z ^= z >> 30; z *= 0xBF58476D1CE4E5B9ull;
        z ^= z >> 27; z *= 0x94D049BB133111EBull;
        z ^= z >> 31;
        float u = (float)(z >> 40) * (1.0f / 16777216.0f);
        y = (T)((2.0f * u - 1.0f) * bound);
        """,
        "strata_uniform",
    )


def uniform_(out: Any, seed: int, bound: float, offset: int = 0) -> Any:
    """Fill ``out`` (contiguous) in place with counter-based uniform values in ``[-bound, bound)``.

    ``offset``: ``out`` is the part of a larger tensor that starts at this flat index, and gets exactly the
    values the whole tensor would have there (the counter is ``offset + i``, and ``(offset + i) * golden +
    seed = i * golden + (seed + offset * golden)`` modulo 2^64).
    """
    seed = (seed + offset * SPLITMIX_GOLDEN) & _MASK
    if on_gpu(out):
        _uniform_kernel()(np.uint64(seed), np.float32(bound), out)
    else:
        reference.uniform_(out, seed, bound)
    return out
