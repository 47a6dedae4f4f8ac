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

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK = (1 << 64) - 1
_CHUNK = 1 << 22
"""Elements per NumPy chunk, which bounds the uint64 temporaries."""


def mix64(z: int) -> int:
    """splitmix64's finaliser on a Python int."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def tensor_seed(seed: int, name: str) -> int:
    """The seed of one named tensor: independent of which stage or device generates it."""
    return mix64((seed << 32) ^ zlib.crc32(name.encode()))


def _uniform_numpy(out: np.ndarray, seed: int, bound: float) -> None:
    flat = out.reshape(-1)
    s, g = np.uint64(seed), np.uint64(_GOLDEN)
    m1, m2 = np.uint64(_M1), np.uint64(_M2)
    for start in range(0, flat.size, _CHUNK):
        n = min(_CHUNK, flat.size - start)
        z = np.arange(start, start + n, dtype=np.uint64) * g + s  # [n] wraps mod 2^64 like the kernel
        z ^= z >> np.uint64(30)
        z *= m1
        z ^= z >> np.uint64(27)
        z *= m2
        z ^= z >> np.uint64(31)
        u = (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)  # [n] in [0, 1), exact
        flat[start : start + n] = ((np.float32(2.0) * u - np.float32(1.0)) * np.float32(bound)).astype(
            out.dtype
        )


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


def uniform_(out: Any, seed: int, bound: float) -> Any:
    """Fill ``out`` (contiguous) in place with counter-based uniform values in ``[-bound, bound)``."""
    if on_gpu(out):
        import numpy

        _uniform_kernel()(numpy.uint64(seed), numpy.float32(bound), out)
    else:
        _uniform_numpy(out, seed, bound)
    return out
