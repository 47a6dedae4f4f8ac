"""The NumPy reference of the fused prefill attention (`strata_runtime.cuda.flash`), and the contract of both.

One segment is one slot's chunk of n consecutive query rows at positions pos0, pos0 + 1, ... whose keys and
values are already in the KV cache. Row i of query head h attends to keys [0, pos0 + i] of KV head h // G:

    out[i, h D : (h + 1) D] = sum_t softmax_t(scale * q[i, h] . k[t]) v[t]

with q = q_hi + q_lo given as two fp16 parts, or q = q_hi when q_lo is None. Layouts: q_hi, q_lo
[n, NQ, D] fp16; k_cache, v_cache [S, NKV, T, D] fp16; out [n, NQ D]. `check_args` is the argument contract
the kernel and this reference share.
"""

from __future__ import annotations

from typing import Any

import numpy as np

HEAD_DIMS = (16, 32, 64, 128)
"""The head dims the kernel is instantiated for (``flash.cu``); the contract refuses others."""


def _check(name: str, a: Any, shape: tuple[int, ...], half: bool = True) -> None:
    if half and a.dtype != np.float16:
        raise ValueError(f"{name} must be float16, not {a.dtype}")
    if tuple(a.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def check_args(
    q_hi: Any,
    q_lo: Any | None,
    k_cache: Any,
    v_cache: Any,
    slot: int,
    pos0: int,
    out: Any,
    half_out: bool = True,
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
    if q_lo is not None:
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
    q_hi: np.ndarray,
    q_lo: np.ndarray | None,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    slot: int,
    pos0: int,
    scale: float,
    out: np.ndarray,
) -> None:
    """The reference of `strata_runtime.cuda.flash.flash_prefill`: the same contract in float64 (one plain
    softmax per row), written into ``out`` [n, NQ D] of any float dtype."""
    n, nq, nkv, d = check_args(q_hi, q_lo, k_cache, v_cache, slot, pos0, out, half_out=False)
    g = nq // nkv
    q = q_hi.astype(np.float64)  # [n, NQ, D]
    if q_lo is not None:
        q = q + q_lo.astype(np.float64)
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
