"""NumPy references of the array path's ops, which are also the CPU path itself.

`strata_runtime.models.ops` runs these on NumPy arrays and a CuPy kernel of the same contract on CuPy arrays;
`strata_runtime.weights.random` does the same for the counter-based random weights.
"""

from __future__ import annotations

import numpy as np

SPLITMIX_GOLDEN = 0x9E3779B97F4A7C15
SPLITMIX_M1 = 0xBF58476D1CE4E5B9
SPLITMIX_M2 = 0x94D049BB133111EB
"""splitmix64's constants (the CUDA kernel of `strata_runtime.weights.random` spells the same numbers)."""
_CHUNK = 1 << 22
"""Elements per NumPy chunk of `uniform_`, which bounds the uint64 temporaries."""


def rms_norm_in_dtype(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm by transformers' rule (Qwen3MoeRMSNorm): fp32 statistics, the normalised value rounded to the
    input dtype, then multiplied by the weight in that dtype. ``x`` [..., N], ``weight`` [N].

    The CUDA decode and prefill paths keep their residual stream in fp32 and follow another rule
    (`strata_runtime.reference.kernels.add_rms_norm_fp32`): no rounding between the norm and the weight.
    """
    x32 = x.astype(np.float32)  # [..., N]
    inv = 1.0 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(eps))  # [..., 1]
    return weight * (x32 * inv).astype(x.dtype)  # type: ignore[no-any-return]  # [..., N]


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SwiGLU's gate ``silu(gate) * up``, computed in fp32 and rounded once to the input dtype."""
    g = gate.astype(np.float32)  # [R, I]
    return (g / (np.float32(1.0) + np.exp(-g)) * up.astype(np.float32)).astype(gate.dtype)  # [R, I]


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """NeoX rotary embedding (rotate-half) of ``x`` [R, N, D] by per-row tables ``cos``/``sin`` [R, D/2]
    (fp32), rounded to the input dtype first."""
    half = x.shape[-1] // 2
    c = np.concatenate([cos, cos], axis=-1)[:, None, :].astype(x.dtype)  # [R, 1, D]
    s = np.concatenate([sin, sin], axis=-1)[:, None, :].astype(x.dtype)  # [R, 1, D]
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [R, N, D]
    return x * c + rotated * s  # type: ignore[no-any-return]  # [R, N, D]


def uniform_(out: np.ndarray, seed: int, bound: float) -> np.ndarray:
    """Fill ``out`` in place: element i is splitmix64 of ``i * golden + seed``, its top 24 bits mapped to
    ``[-bound, bound)``."""
    flat = out.reshape(-1)
    s, g = np.uint64(seed), np.uint64(SPLITMIX_GOLDEN)
    m1, m2 = np.uint64(SPLITMIX_M1), np.uint64(SPLITMIX_M2)
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
    return out
