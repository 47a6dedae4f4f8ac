"""Batched fp16 matrix products on cuBLAS, for the prefill path.

`cupy.matmul` on arrays of more than two dimensions widens fp16 operands to fp32 contiguous copies and
runs an fp32 product: for a stack of expert weights that is a copy of every expert per layer and no
tensor cores. These wrappers call ``cublasGemmStridedBatchedEx`` on the arrays as they are (any row and
batch strides, unit stride along the last axis): fp16 inputs, fp32 accumulation, fp16 or fp32 output,
and an optional ``beta`` to add into the output in place; or fp32 throughout (the prefill path's router).
They write into the output given and allocate nothing, so a CUDA graph can capture them: inside
`capturing` they call cuBLAS itself (the library CuPy loaded, on CuPy's handle), since CuPy's wrappers set
the handle's stream before each call and refuse to while any stream is capturing a graph.

Row-major products map onto column-major cuBLAS by transposing the whole equation: C = A B^T is computed
as C^T = B A^T, which needs no data movement.
"""

from __future__ import annotations

import contextvars
import ctypes
import ctypes.util
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
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
    handle = cp.cuda.device.get_cublas_handle()
    # C^T[n, m] = op(B)[n, k] A^T[k, m] in column-major terms.
    args = (
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
    if not _CAPTURING.get():  # CuPy's wrappers
        cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
        cublas.gemmStridedBatchedEx(handle, *args)
        return
    lib = _library()
    _check(lib.cublasSetStream_v2(handle, cp.cuda.get_current_stream().ptr), "cublasSetStream")
    _check(lib.cublasGemmStridedBatchedEx(handle, *args), "cublasGemmStridedBatchedEx")


_CAPTURING: contextvars.ContextVar[bool] = contextvars.ContextVar("strata_blas_capturing", default=False)
"""Whether this thread's products are being captured into a CUDA graph (`capturing`)."""


@contextmanager
def capturing() -> Iterator[None]:
    """Products queued inside are captured into a CUDA graph: they call cuBLAS itself (the library CuPy
    loaded, on CuPy's handle), since CuPy's wrappers set the handle's stream before each call and refuse to
    while any stream captures. Outside, the products take CuPy's wrappers, whose calls cost less host time
    (the prefill path launched layer by layer, and the expert cache's one product per expert)."""
    token = _CAPTURING.set(True)
    try:
        yield
    finally:
        _CAPTURING.reset(token)


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed: cuBLAS status {status}")


_I, _P, _L = ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong


@cache
def _library() -> ctypes.CDLL:
    """The cuBLAS library CuPy loaded (found among the process's mapped files once CuPy has made a handle),
    with the two calls the products make."""
    path = None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                found = re.search(r"(/\S*/libcublas\.so[.\d]*)$", line.strip())
                if found:
                    path = found.group(1)
                    break
    except OSError:
        pass
    lib = ctypes.CDLL(path or ctypes.util.find_library("cublas") or "libcublas.so")
    lib.cublasSetStream_v2.argtypes = [_P, _P]
    lib.cublasSetStream_v2.restype = _I
    gemm = lib.cublasGemmStridedBatchedEx
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB, beta, C,
    # Ctype, ldc, strideC, batchCount, computeType, algo
    gemm.argtypes = [
        _P,
        _I,
        _I,
        _I,
        _I,
        _I,
        _P,
        _P,
        _I,
        _I,
        _L,
        _P,
        _I,
        _I,
        _L,
        _P,
        _P,
        _I,
        _I,
        _L,
        _I,
        _I,
        _I,
    ]
    gemm.restype = _I
    return lib


def matmul_nt(a: Any, b: Any, c: Any, alpha: float = 1.0, beta: float = 0.0) -> Any:
    """c = alpha * a @ b^T + beta * c, per batch: a [(B,) M, K], b [(B,) N, K] (a weight), c [(B,) M, N]."""
    _gemm(True, a, b, c, alpha, beta)
    return c


def matmul_nn(a: Any, b: Any, c: Any, alpha: float = 1.0, beta: float = 0.0) -> Any:
    """c = alpha * a @ b + beta * c, per batch: a [(B,) M, K], b [(B,) K, N], c [(B,) M, N]."""
    _gemm(False, a, b, c, alpha, beta)
    return c
