"""Inputs and helpers shared by the flash-attention tests (kernel on the GPU, reference on the CPU).

Inputs are random, from the caller's seeded generator. Cache positions the chunk of slot 1 must not read
(past its last row, other slots) hold NaN, so a read past the causal limit shows up as a non-finite output.
"""

from __future__ import annotations

import math

import numpy as np

from strata_runtime.reference.flash import flash_prefill as reference_flash_prefill

REL = 3e-3
"""Relative Frobenius bound of the kernel against the reference: P and the output are rounded to fp16."""


def split(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q (fp32) as two fp16 parts hi + lo, as the prefill path splits it."""
    hi = q.astype(np.float16)
    return hi, (q - hi.astype(np.float32)).astype(np.float16)


def make_inputs(g, n, n_q, n_kv, d, pos0, slots=3, extra=37, q_scale=1.0):
    """q parts [n, NQ, D], caches [S, NKV, T, D] for a chunk of slot 1 at pos0; NaN where it must not look."""
    t = pos0 + n + extra
    kc = np.full((slots, n_kv, t, d), np.nan, np.float16)
    vc = np.full((slots, n_kv, t, d), np.nan, np.float16)
    kc[1, :, : pos0 + n] = g.standard_normal((n_kv, pos0 + n, d))
    vc[1, :, : pos0 + n] = g.standard_normal((n_kv, pos0 + n, d))
    hi, lo = split((g.standard_normal((n, n_q, d)) * q_scale).astype(np.float32))
    return hi, lo, kc, vc


def large_score_inputs(g, n, n_q, n_kv, d, pos0):
    """Scores near 50 that differ between keys by about one, and the scale 1/sqrt(D).

    Every key shares a direction w that q points along (a large score common to all keys); keys vary only
    in directions where q is small. Rounding q to fp16 moves each score by about 2^-12 |q| per element,
    a large share of the differences between scores, which are all the softmax sees.
    """
    t = pos0 + n + 8
    basis, _ = np.linalg.qr(g.standard_normal((d, d)))
    w, varying = basis[:, d // 2], basis[:, : d // 2]
    scale = 1 / math.sqrt(d)
    kc = np.full((2, n_kv, t, d), np.nan, np.float16)
    kc[1, :, : pos0 + n] = g.standard_normal((n_kv, pos0 + n, d // 2)) @ varying.T + w
    vc = np.full((2, n_kv, t, d), np.nan, np.float16)
    vc[1, :, : pos0 + n] = g.standard_normal((n_kv, pos0 + n, d))
    q = g.standard_normal((n, n_q, d // 2)) @ varying.T + (50 / scale) * w
    hi, lo = split(q.astype(np.float32))
    return hi, lo, kc, vc, scale


def twin(hi, lo, kc, vc, slot, pos0, scale) -> np.ndarray:
    """The reference's output [n, NQ D] in float64."""
    out = np.empty((hi.shape[0], hi.shape[1] * hi.shape[2]))
    reference_flash_prefill(hi, lo, kc, vc, slot, pos0, scale, out)
    return out
