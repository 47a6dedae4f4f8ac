"""A linear layer through 8-bit weights with a scale a row: how they are rounded, and the product.

The MTP head drafts through such a copy of the LM head under ``spec.draft_head = "int8"``
(`strata_runtime.model.draft_head`). Both functions take the arrays' module ``xp`` (NumPy or CuPy); on a GPU
the product is one kernel (``gemv_i8`` of `strata_runtime/cuda/gemv.cuh`), of which `linear_int8` on NumPy
arrays is the reference the GPU tests hold it to.
"""

from __future__ import annotations

from typing import Any

QUANTIZE_ROWS = 8192
"""Rows widened to float32 at a time while rounding (64 MiB at a hidden size of 2048)."""
PRODUCT_ROWS = 16384
"""Rows of 8-bit weights widened to float32 at a time in `linear_int8` (128 MiB at a hidden size of 2048)."""


def quantize_rows(xp: Any, w: Any, rows_at_once: int = QUANTIZE_ROWS) -> tuple[Any, Any]:
    """(q int8 [N, K], scale float32 [N]) of weights [N, K]: each row scaled by its largest magnitude / 127
    and rounded to the nearest step, so w[n, k] = q[n, k] * scale[n] within half a step (a row of zeros
    gets scale 1 and zeros)."""
    n, k = w.shape
    q = xp.empty((n, k), dtype=xp.int8)
    scale = xp.empty(n, dtype=xp.float32)
    for n0 in range(0, n, rows_at_once):
        block = w[n0 : n0 + rows_at_once].astype(xp.float32)
        top = xp.abs(block).max(axis=1)
        s = xp.where(top > 0, top / 127.0, 1.0).astype(xp.float32)
        q[n0 : n0 + block.shape[0]] = xp.clip(xp.rint(block / s[:, None]), -127, 127).astype(xp.int8)
        scale[n0 : n0 + block.shape[0]] = s
    return q, scale


def linear_int8(xp: Any, q: Any, scale: Any, x: Any, out: Any) -> None:
    """out[R, N] = (x[R, K] @ q[N, K].T) * scale[N] in float32 (q int8, scale float32)."""
    x = x.astype(xp.float32, copy=False)
    for n0 in range(0, q.shape[0], PRODUCT_ROWS):
        n1 = min(q.shape[0], n0 + PRODUCT_ROWS)
        out[:, n0:n1] = (x @ q[n0:n1].astype(xp.float32).T) * scale[n0:n1]
