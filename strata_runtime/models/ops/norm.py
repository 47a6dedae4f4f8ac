"""RMSNorm over the last axis in the input dtype (transformers' Qwen3MoeRMSNorm): fp32 statistics, the
normalised value rounded to the input dtype before the weight multiplies it.

This is the array path's rule; the CUDA paths keep an fp32 residual and do not round in between
(`strata_runtime.cuda.ops.Kernels.add_rms_norm_fp32`). `strata_runtime.reference.ops.rms_norm_in_dtype` is the
NumPy reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...reference import ops as reference
from . import locked_cache, on_gpu

_SOURCE = r"""
#include <cuda_fp16.h>
__device__ inline float to_f(float v) { return v; }
__device__ inline float to_f(__half v) { return __half2float(v); }
__device__ inline void put(float v, float* p) { *p = v; }
__device__ inline void put(float v, __half* p) { *p = __float2half(v); }

extern "C" __global__ void rms_norm(const T* x, const T* w, T* y, int n, float eps) {
    const T* xr = x + (long long)blockIdx.x * n;
    T* yr = y + (long long)blockIdx.x * n;
    __shared__ float part[32];
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) { float v = to_f(xr[j]); s += v * v; }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        s = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        if (threadIdx.x == 0) part[0] = s;
    }
    __syncthreads();
    float inv = rsqrtf(part[0] / (float)n + eps);
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        T normed;
        put(to_f(xr[j]) * inv, &normed);
        put(to_f(normed) * to_f(w[j]), yr + j);
    }
}
"""

_CTYPES = {"float32": "float", "float16": "__half"}


@locked_cache
def _kernel(dtype_name: str) -> Any:
    import cupy

    kernel = cupy.RawKernel(f"#define T {_CTYPES[dtype_name]}\n" + _SOURCE, "rms_norm")
    kernel.compile()  # loaded here, under the lock, not at a first launch on some thread
    return kernel


def rms_norm_in_dtype(x: Any, weight: Any, eps: float) -> Any:
    """RMSNorm of ``x`` [..., N] with ``weight`` [N], in ``x``'s dtype."""
    if not on_gpu(x):
        return reference.rms_norm_in_dtype(x, weight, eps)
    import cupy

    n = x.shape[-1]
    xc = cupy.ascontiguousarray(x)
    w = cupy.ascontiguousarray(weight.astype(x.dtype, copy=False))
    y = cupy.empty_like(xc)
    rows = xc.size // n
    if rows:
        threads = 256 if n >= 256 else 32 * max(1, (n + 31) // 32)
        _kernel(x.dtype.name)((rows,), (threads,), (xc, w, y, np.int32(n), np.float32(eps)))
    return y
