"""Causal flash attention for long prefill chunks: the launcher of ``flash.cu`` and its NumPy twin.

One segment is one slot's chunk of n consecutive query rows at positions pos0, pos0 + 1, ... whose keys and
values are already in the KV cache. Row i of query head h attends to keys [0, pos0 + i] of KV head h // G:

    out[i, h D : (h + 1) D] = sum_t softmax_t(scale * q[i, h] . k[t]) v[t]

The kernel never stores the scores. A block of 4 warps takes 64 flattened rows m = i G + g (query row i,
head kvh G + g) of one KV head, so the G heads of that KV head share every K/V tile; tiles of 64 keys stream
through shared memory, each warp computes its 16 x 64 scores on tensor cores (fp16 inputs, fp32
accumulation), updates a running max and sum per row (fp32 online softmax, base 2), rescales its fp32
output accumulator and adds P V with P in fp16. Key tiles past the block's last row are skipped; keys past
a row's position are masked only in the tiles that reach past the block's first row.

q arrives as two fp16 parts, q = q_hi + q_lo, and the scores are q_hi . k + q_lo . k in one fp32
accumulator: fp16 q alone would move each score by about |score| 2^-11, which for sharp heads shifts the
weights by percents.

Layouts: q_hi, q_lo [n, NQ, D] fp16; k_cache, v_cache [S, NKV, T, D] fp16; out [n, NQ D] fp16.
Letters: n rows of the chunk, NQ query heads, NKV KV heads, G = NQ / NKV, D head dim, T cache positions,
S slots, L = pos0 + n keys of the last row.

CuPy is imported only by the launcher, so the twin runs without it.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

_SOURCE = (Path(__file__).with_name("flash.cu")).read_text()
_OPTIONS = ("-std=c++17", "--use_fast_math")
HEAD_DIMS = (16, 32, 64, 128)
BLOCK_ROWS = 64  # flattened query rows per block; flash.cu's BM
THREADS = 128
_LOG2E = 1.4426950408889634


def kernel_expr(head_dim: int) -> str:
    return f"flash_prefill<{head_dim}>"


class FlashKernels:
    """The compiled flash kernels of one device (one per head dim). Create it with that device current."""

    def __init__(self) -> None:
        self._fns: dict[int, Any] = {}

    def prepare(self, head_dims: list[int]) -> None:
        """Compile every listed head dim in one module (one NVRTC run)."""
        import cupy as cp

        todo = [d for d in dict.fromkeys(head_dims) if d not in self._fns]
        if not todo:
            return
        exprs = [kernel_expr(d) for d in todo]
        mod = cp.RawModule(code=_SOURCE, options=_OPTIONS, name_expressions=exprs)
        for d, e in zip(todo, exprs, strict=True):
            self._fns[d] = mod.get_function(e)

    def fn(self, head_dim: int) -> Any:
        if head_dim not in self._fns:
            self.prepare([head_dim])
        return self._fns[head_dim]


@cache
def flash_kernels_for(device_id: int) -> FlashKernels:
    """The flash kernel set of CUDA device ``device_id`` (compiled functions are per context)."""
    import cupy as cp

    with cp.cuda.Device(device_id):
        return FlashKernels()


def _check(name: str, a: Any, shape: tuple[int, ...], half: bool = True) -> None:
    if half and a.dtype != np.float16:
        raise ValueError(f"{name} must be float16, not {a.dtype}")
    if tuple(a.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def check_args(
    q_hi: Any, q_lo: Any, k_cache: Any, v_cache: Any, slot: int, pos0: int, out: Any, half_out: bool = True
) -> tuple[int, int, int, int]:
    """(n, NQ, NKV, D) of a valid call; ValueError naming the first argument that does not fit. ``out``
    may be of any dtype when not ``half_out``."""
    if q_hi.ndim != 3:
        raise ValueError(f"q_hi must be [n, NQ, D], not shape {tuple(q_hi.shape)}")
    n, nq, d = q_hi.shape
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must be [S, NKV, T, D], not shape {tuple(k_cache.shape)}")
    s, nkv, t, _ = k_cache.shape
    _check("q_hi", q_hi, (n, nq, d))
    _check("q_lo", q_lo, (n, nq, d))
    _check("k_cache", k_cache, (s, nkv, t, d))
    _check("v_cache", v_cache, (s, nkv, t, d))
    _check("out", out, (n, nq * d), half_out)
    if d not in HEAD_DIMS:
        raise ValueError(f"q_hi: head dim {d} is not one of {HEAD_DIMS}")
    if n < 1:
        raise ValueError("q_hi: the chunk needs at least one row")
    if nkv < 1 or nq % nkv:
        raise ValueError(f"k_cache: {nkv} KV heads do not divide the {nq} query heads of q_hi")
    if not 0 <= slot < s:
        raise ValueError(f"slot {slot} is outside the cache's {s} slots")
    if pos0 < 0 or pos0 + n > t:
        raise ValueError(f"pos0 {pos0}: positions {pos0}..{pos0 + n - 1} exceed the cache's {t}")
    return n, nq, nkv, d


def flash_prefill(
    q_hi: Any, q_lo: Any, k_cache: Any, v_cache: Any, slot: int, pos0: int, scale: float, out: Any
) -> None:
    """out [n, NQ D] fp16 = causal attention of the chunk's rows (positions pos0..pos0 + n - 1) over keys
    [0, their position] of ``slot``. CuPy arrays on one device; allocates nothing (graph-capturable)."""
    import cupy as cp

    n, nq, nkv, d = check_args(q_hi, q_lo, k_cache, v_cache, slot, pos0, out)
    device = q_hi.device.id
    for name, a in (("q_lo", q_lo), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if a.device.id != device:
            raise ValueError(f"{name} is on device {a.device.id}, q_hi on device {device}")
    g = nq // nkv
    tiles = math.ceil(n * g / BLOCK_ROWS)
    if tiles > 65535:
        raise ValueError(f"q_hi: {n} rows x {g} heads per KV head is more than one launch takes")
    t = k_cache.shape[2]
    with cp.cuda.Device(device):
        flash_kernels_for(device).fn(d)(
            (nkv, tiles),
            (THREADS,),
            (
                q_hi,
                q_lo,
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
                np.float32(scale * _LOG2E),
            ),
        )


def flash_prefill_twin(
    q_hi: np.ndarray,
    q_lo: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    slot: int,
    pos0: int,
    scale: float,
    out: np.ndarray,
) -> None:
    """NumPy twin of `flash_prefill`: the same contract in float64 (one plain softmax per row), written
    into ``out`` [n, NQ D] of any float dtype."""
    n, nq, nkv, d = check_args(q_hi, q_lo, k_cache, v_cache, slot, pos0, out, half_out=False)
    g = nq // nkv
    q = q_hi.astype(np.float64) + q_lo.astype(np.float64)  # [n, NQ, D]
    length = pos0 + n
    keys = k_cache[slot, :, :length].astype(np.float64)  # [NKV, L, D]
    values = v_cache[slot, :, :length].astype(np.float64)  # [NKV, L, D]
    qg = q.reshape(n, nkv, g, d).transpose(1, 0, 2, 3)  # [NKV, n, G, D]
    scores = scale * np.einsum("knge,kle->kngl", qg, keys)  # [NKV, n, G, L]
    visible = np.arange(length)[None, :] <= pos0 + np.arange(n)[:, None]  # [n, L]
    scores = np.where(visible[None, :, None, :], scores, -np.inf)
    w = np.exp(scores - scores.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    o = np.einsum("kngl,kle->nkge", w, values)  # [n, NKV, G, D]
    out[...] = o.reshape(n, nq * d)
