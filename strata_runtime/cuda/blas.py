"""Batched fp16 matrix products on cuBLAS, for the prefill path.

`cupy.matmul` on arrays of more than two dimensions widens fp16 operands to fp32 contiguous copies and
runs an fp32 product: for a stack of expert weights that is a copy of every expert per layer and no
tensor cores. These wrappers call ``cublasGemmStridedBatchedEx`` on the arrays as they are (any row and
batch strides, unit stride along the last axis): fp16 inputs, fp32 accumulation, fp16 or fp32 output,
and an optional ``beta`` to add into the output in place; or fp32 throughout (the prefill path's router).
They write into the output given and allocate nothing, so a CUDA graph can capture them.

Row-major products map onto column-major cuBLAS by transposing the whole equation: C = A B^T is computed
as C^T = B A^T, which needs no data movement.
"""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np
from cupy_backends.cuda.libs import cublas

_CUDA_R_16F, _CUDA_R_32F = 2, 0
_COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F
_GEMM_DEFAULT = -1
_OP_N, _OP_T = 0, 1
_TYPES = {np.dtype(np.float16): _CUDA_R_16F, np.dtype(np.float32): _CUDA_R_32F}


def _layout(a: cp.ndarray) -> tuple[int, int, int]:
    """(batch, leading dimension, batch stride) in elements of a [B, rows, cols] or [rows, cols] array."""
    item = a.itemsize
    if a.strides[-1] != item:
        raise ValueError(f"a matrix of shape {a.shape} needs unit stride along its last axis")
    if a.ndim == 2:
        return 1, a.strides[0] // item, 0
    if a.ndim != 3:
        raise ValueError(f"products take 2- or 3-dimensional arrays, not shape {a.shape}")
    return a.shape[0], a.strides[1] // item, a.strides[0] // item


def _gemm(trans_b: bool, a: cp.ndarray, b: cp.ndarray, c: cp.ndarray, alpha: float, beta: float) -> None:
    single = a.dtype == b.dtype == c.dtype == np.float32
    if not single and (a.dtype != np.float16 or b.dtype != np.float16 or c.dtype not in _TYPES):
        raise TypeError(
            f"fp16 inputs and an fp16 or fp32 output, or all fp32, not {a.dtype}, {b.dtype} -> {c.dtype}"
        )
    in_type = _CUDA_R_32F if single else _CUDA_R_16F
    m, k = a.shape[-2:]
    n = b.shape[-2] if trans_b else b.shape[-1]
    if (b.shape[-1] if trans_b else b.shape[-2]) != k or c.shape[-2:] != (m, n):
        raise ValueError(f"shapes {a.shape} x {b.shape}{'^T' if trans_b else ''} -> {c.shape} do not agree")
    batch_a, lda, sa = _layout(a)
    batch_b, ldb, sb = _layout(b)
    batch, ldc, sc = _layout(c)
    if batch_a != batch or batch_b != batch:
        raise ValueError(f"batch sizes {batch_a}, {batch_b} -> {batch} do not agree")
    alpha_h, beta_h = np.array(alpha, np.float32), np.array(beta, np.float32)
    handle = bind_stream(cp.cuda.get_current_stream())
    # C^T[n, m] = op(B)[n, k] A^T[k, m] in column-major terms.
    cublas.gemmStridedBatchedEx(
        handle,
        _OP_T if trans_b else _OP_N,
        _OP_N,
        n,
        m,
        k,
        alpha_h.ctypes.data,
        b.data.ptr,
        in_type,
        ldb,
        sb,
        a.data.ptr,
        in_type,
        lda,
        sa,
        beta_h.ctypes.data,
        c.data.ptr,
        _TYPES[c.dtype],
        ldc,
        sc,
        batch,
        _COMPUTE_32F,
        _GEMM_DEFAULT,
    )


def bind_stream(stream: Any) -> int:
    """Make ``stream`` the current device's cuBLAS stream where it is not already, and return the cuBLAS
    handle. CuPy refuses to set a cuBLAS stream while any stream captures a graph, so a capture binds its
    stream before it begins; the products inside it then find their stream bound and set nothing."""
    handle = cp.cuda.device.get_cublas_handle()
    if cublas.getStream(handle) != stream.ptr:
        cublas.setStream(handle, stream.ptr)
    return int(handle)


def matmul_nt(a: Any, b: Any, c: Any, alpha: float = 1.0, beta: float = 0.0) -> Any:
    """c = alpha * a @ b^T + beta * c, per batch: a [(B,) M, K], b [(B,) N, K] (a weight), c [(B,) M, N]."""
    _gemm(True, a, b, c, alpha, beta)
    return c


def matmul_nn(a: Any, b: Any, c: Any, alpha: float = 1.0, beta: float = 0.0) -> Any:
    """c = alpha * a @ b + beta * c, per batch: a [(B,) M, K], b [(B,) K, N], c [(B,) M, N]."""
    _gemm(False, a, b, c, alpha, beta)
    return c
