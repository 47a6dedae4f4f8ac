"""Causal flash attention for long prefill chunks: the launcher of ``flash.cu``.

One segment is one slot's chunk of n consecutive query rows at positions pos0, pos0 + 1, ... whose keys and
values are already in the KV cache. Row i of query head h attends to keys [0, pos0 + i] of KV head h // G:

    out[i, h D : (h + 1) D] = sum_t softmax_t(scale * q[i, h] . k[t]) v[t]

The kernel never stores the scores. A block of 4 warps takes 64 or 128 flattened rows m = i G + g (query
row i, head kvh G + g) of one KV head, so the G heads of that KV head share every K/V tile; tiles of keys
stream through shared memory, each warp computes the scores of its 16 or 32 rows on tensor cores (fp16
inputs, fp32 accumulation), updates a running max and sum per row (fp32 online softmax, base 2), rescales
its fp32 output accumulator when a row's max moved and adds P V with P in fp16. Key tiles past the block's
last row are skipped; keys past a row's position are masked only in the tiles that reach past the block's
first row.

On a GPU whose SMs hold two blocks of it in shared memory (Hopper), each warp takes two 16-row tiles that
share every K and V fragment it reads, with the block's q in shared memory; elsewhere one tile of 16 rows
and 64 keys (`tile_shape`). q arrives in one of two precisions:

* two fp16 parts, q = q_hi + q_lo, and the scores are q_hi . k + q_lo . k in one fp32 accumulator, so
  they keep q's fp32 precision: fp16 q alone moves each score by up to about |score| 2^-11, which for the
  large scores of sharp heads shifts the weights by percents. The second product costs a third of the
  kernel's tensor-core work.
* q_hi alone (``q_lo`` None): q rounded to fp16, as FlashAttention and llama.cpp compute prompt attention:
  one product over the keys.

Layouts: q_hi, q_lo [n, NQ, D] fp16; k_cache, v_cache [S, NKV, T, D] fp16; out [n, NQ D] fp16.
Letters: n rows of the chunk, NQ query heads, NKV KV heads, G = NQ / NKV, D head dim, T cache positions,
S slots, L = pos0 + n keys of the last row.

The NumPy reference and the argument contract both follow are in `strata_runtime.reference.flash`.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numpy as np

from ..backend import cupy_module
from ..models.ops import locked_cache
from ..reference.flash import check_args
from .compile import KernelCache, source

_SOURCE = source("flash.cu")
THREADS = 128
_LOG2E = 1.4426950408889634


NARROW = (1, 64)
"""(16-row tiles per warp, keys per tile) of the shape every GPU from Ampere on runs: 68 KiB of shared memory
a block at head dim 128."""

HOPPER_SM_SHARED = 228 * 1024
"""Shared memory of one Hopper SM (H100, H200), in bytes: what the shapes were measured on."""


def tile_shape(head_dim: int, split_q: bool, sm_shared: int = HOPPER_SM_SHARED) -> tuple[int, int]:
    """(16-row tiles per warp, keys per tile) of the instantiation for ``head_dim`` on a GPU whose SMs have
    ``sm_shared`` bytes of shared memory. Two tiles per warp share every K and V fragment the warp reads from
    shared memory, over 32 keys at head dim 128 (64 would spill registers) and 64 below, with the block's q
    in shared memory; they are taken where two such blocks fit in an SM (the kernel's launch bounds),
    otherwise `NARROW`."""
    wide = (2, 32 if head_dim > 64 else 64)
    if 2 * (_shared(head_dim, split_q, *wide) + 1024) <= sm_shared:  # 1 KiB a block is the hardware's
        return wide
    return NARROW


def _shared(head_dim: int, split_q: bool, wt: int, bn: int) -> int:
    row = (head_dim + 8) * 2  # a shared row, padded to D + 8 halves
    q_rows = (2 if split_q else 1) * 64 * wt if wt > 1 else 0
    return (2 * 2 * bn + q_rows) * row


def block_rows(head_dim: int, split_q: bool = True, sm_shared: int = HOPPER_SM_SHARED) -> int:
    """Flattened query rows per block: 4 warps of 16-row tiles."""
    return 4 * 16 * tile_shape(head_dim, split_q, sm_shared)[0]


def kernel_expr(head_dim: int, split_q: bool = True, sm_shared: int = HOPPER_SM_SHARED) -> str:
    wt, bn = tile_shape(head_dim, split_q, sm_shared)
    return f"flash_prefill<{head_dim}, {'true' if split_q else 'false'}, {wt}, {bn}>"


def shared_bytes(head_dim: int, split_q: bool = True, sm_shared: int = HOPPER_SM_SHARED) -> int:
    """Dynamic shared memory of a block: K and V of two key tiles, and with two row tiles per warp the
    block's q (each part)."""
    return _shared(head_dim, split_q, *tile_shape(head_dim, split_q, sm_shared))


@cache
def sm_shared_bytes(device_id: int) -> int:
    """Shared memory of one SM of CUDA device ``device_id``, in bytes."""
    props = cupy_module().cuda.runtime.getDeviceProperties(device_id)
    return int(props["sharedMemPerMultiprocessor"])


@locked_cache
def flash_kernels_for(device_id: int) -> KernelCache:
    """The flash kernels of CUDA device ``device_id``, one instantiation per head dim and q precision
    (`kernel_expr`)."""
    with cupy_module().cuda.Device(device_id):
        return KernelCache(_SOURCE)


def flash_prefill(
    q_hi: Any,
    q_lo: Any | None,
    k_cache: Any,
    v_cache: Any,
    slot: int,
    pos0: int,
    scale: float,
    out: Any,
    where: Any = None,
) -> None:
    """out [n, NQ D] fp16 = causal attention of the chunk's rows (positions pos0..pos0 + n - 1) over keys
    [0, their position] of ``slot``; q = q_hi + q_lo, or q_hi alone when ``q_lo`` is None. CuPy arrays on
    one device; allocates nothing (graph-capturable). ``where``: [2] int32 on the device, {slot, pos0} read
    by the kernel when it runs in place of the two numbers (which are then only checked), so that a captured
    graph serves chunks of any slot and position; the caller keeps them within the cache."""
    import cupy as cp

    n, nq, nkv, d = check_args(q_hi, q_lo, k_cache, v_cache, slot, pos0, out)
    device = q_hi.device.id
    split_q = q_lo is not None
    if where is not None and (where.dtype != np.int32 or where.shape != (2,)):
        raise ValueError(f"where must be [2] int32 (slot, pos0), not {where.dtype} {tuple(where.shape)}")
    others = (("q_lo", q_lo), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out), ("where", where))
    for name, a in others:
        if a is not None and a.device.id != device:
            raise ValueError(f"{name} is on device {a.device.id}, q_hi on device {device}")
    g = nq // nkv
    sm = sm_shared_bytes(device)
    tiles = math.ceil(n * g / block_rows(d, split_q, sm))
    if tiles > 65535:
        raise ValueError(f"q_hi: {n} rows x {g} heads per KV head is more than one launch takes")
    t = k_cache.shape[2]
    with cp.cuda.Device(device):
        smem = shared_bytes(d, split_q, sm)
        flash_kernels_for(device).fn_with_shared(kernel_expr(d, split_q, sm), smem)(
            (nkv, tiles),
            (THREADS,),
            (
                q_hi,
                q_lo if split_q else q_hi,  # never read without the split
                k_cache,
                v_cache,
                out,
                np.int32(n),
                np.int32(nq),
                np.int32(nkv),
                np.int32(g),
                np.int32(t),
                np.int32(slot),
                np.int32(pos0),
                where if where is not None else np.uint64(0),  # a null pointer: the numbers above
                np.float32(scale * _LOG2E),
            ),
            shared_mem=smem,
        )
