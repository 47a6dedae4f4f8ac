"""The last stage's head on the CUDA path: the final norm and the LM head, on fp32 rows.

The MTP head (`strata_runtime.cuda.mtp`) reuses it for its own norm's output and the shared LM head.
"""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from strata_cfg.schema.windows import MAX_WINDOW_ROWS

from ..backend import upload_into
from ..models.ops.choose import Draws
from ..models.ops.distribution import inv_temperature, log_min_p
from .blas import matmul_nt
from .ops import argmax_scratch, kernels_for


class CudaHead:
    """The final norm and LM head on fp32 rows (the last stage's, or the MTP head's output)."""

    def __init__(self, device_id: int, norm: cp.ndarray, lm_head: cp.ndarray, eps: float) -> None:
        self.device_id, self.norm, self.lm_head, self.eps = device_id, norm, lm_head, eps
        self.kern = kernels_for(device_id)

    def final_norm(self, hidden: Any) -> cp.ndarray:
        """rmsnorm(hidden) * norm as a new fp32 array [R, H]."""
        with cp.cuda.Device(self.device_id):
            x = cp.ascontiguousarray(hidden, dtype=cp.float32)
            out = cp.empty_like(x)
            self.kern.add_rms_norm_fp32(x, None, self.norm, out, self.eps)
            return out

    def logits(self, normed: Any) -> cp.ndarray:
        """Logits [R, V] in fp32: the GEMV kernel for a window's rows, a cuBLAS product (fp16 rows, fp32
        accumulation and output) for more."""
        with cp.cuda.Device(self.device_id):
            rows = normed.shape[0]
            out = cp.empty((rows, self.lm_head.shape[0]), cp.float32)
            if rows > MAX_WINDOW_ROWS:
                return matmul_nt(cp.ascontiguousarray(normed, dtype=cp.float16), self.lm_head, out)
            self.kern.gemv(self.lm_head, cp.ascontiguousarray(normed, dtype=cp.float32), out)
            return out

    def argmax(self, logits: Any) -> cp.ndarray:
        """Each row's argmax [R] (int64, the lowest index on ties) of logits [R, V], each row searched in
        slices in parallel (`strata_runtime.cuda.ops.Kernels.argmax`). On an H200, over a 151,936-word
        vocabulary: CuPy's own reduction about 230 us for two rows, one block per row 33 us, the slices 4."""
        with cp.cuda.Device(self.device_id):
            out = cp.empty(logits.shape[0], cp.int32)
            self.kern.argmax(cp.ascontiguousarray(logits), out, argmax_scratch(cp, *logits.shape))
            return out.astype(cp.int64)

    def mask(self, logits: Any, rows: np.ndarray, bits: np.ndarray) -> None:
        """Rows ``rows`` (host int64 [M]) of logits [R, V], in place: minus infinity where the row's packed
        mask ``bits`` (host uint32 [M, W]) clears a token (`strata_runtime.cuda.ops.Kernels.mask_logits`);
        the host arrays go up through pinned memory, on the current stream."""
        with cp.cuda.Device(self.device_id):
            r = cp.empty(rows.shape[0], cp.int64)
            b = cp.empty(bits.shape, cp.uint32)
            upload_into(r, rows.astype(np.int64))
            upload_into(b, np.ascontiguousarray(bits, dtype=np.uint32))
            self.kern.mask_logits(logits, r, b)

    def choose(self, logits: Any, draws: Draws) -> cp.ndarray:
        """Each row's chosen token [R] (int64) of logits [R, V] by ``draws`` (`strata_runtime.models.ops.
        choose`); the host arrays go up through pinned memory, on the current stream."""
        with cp.cuda.Device(self.device_id):
            rows = logits.shape[0]
            t, u, p = (cp.empty(rows, cp.float32) for _ in range(3))
            k = cp.empty(rows, cp.int32)
            upload_into(t, draws.inv_temp.astype(np.float32))
            upload_into(u, draws.uniform.astype(np.float32))
            upload_into(k, draws.top_k.astype(np.int32))
            upload_into(p, draws.top_p.astype(np.float32))
            m = None  # no row cuts by min-p: nothing more to copy up
            if not np.isneginf(draws.log_min_p).all():
                m = cp.empty(rows, cp.float32)
                upload_into(m, draws.log_min_p.astype(np.float32))
            out = cp.empty(rows, cp.int64)
            self.kern.choose(logits, t, u, k, p, out, log_min_p=m)
            return out

    def distribution(
        self, logits: Any, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
    ) -> cp.ndarray:
        """The distribution [R, V] (float64) `choose` draws each row of logits [R, V] from at this temperature
        (> 0), top-k, top-p and min-p (`strata_runtime.cuda.ops.Kernels.distribution`), on the current
        stream."""
        with cp.cuda.Device(self.device_id):
            out = cp.empty(logits.shape, cp.float64)
            rows = cp.ascontiguousarray(logits, dtype=cp.float32)
            lmp = log_min_p(min_p)
            self.kern.distribution(rows, inv_temperature(temperature), top_k, top_p, out, log_min_p=lmp)
            return out

    def draw(self, probs: Any, uniforms: Any) -> cp.ndarray:
        """Each row's draw [R] (int64) from probs [R, V] (float64) at uniforms [R] (float64, any stride):
        ``inverse_cdf_rows``, on the current stream."""
        with cp.cuda.Device(self.device_id):
            out = cp.empty(probs.shape[0], cp.int64)
            self.kern.inverse_cdf(cp.ascontiguousarray(probs, dtype=cp.float64), uniforms, out)
            return out

    def verify_sampled(self, p: Any, q: Any, tokens: Any, uniforms: Any) -> tuple[cp.ndarray, cp.ndarray]:
        """One slot's speculative rejection sampling (``verify_sampled_rows``): p [n, V] and q [n - 1, V]
        (float64), its input ids [n] (int64) and uniforms [n or more] (float64); (proposals kept, the token
        after them) as 0-d int64 arrays, on the current stream."""
        with cp.cuda.Device(self.device_id):
            accepted, first = cp.empty(1, cp.int64), cp.empty(1, cp.int64)
            self.kern.verify_sampled(p, q, tokens, uniforms[None, :], accepted, first)
            return accepted[0], first[0]
