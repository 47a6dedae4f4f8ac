"""The NumPy reference of the grouped expert products of long prefill chunks (`strata_runtime.cuda.grouped`),
and the contract of both.

A chunk of n rows routed top-k makes A = n k assignments a = r k + j (row r, choice j). `moe_tiles` lists them
expert by expert (``order``) and cuts each expert's run into tiles of at most `TILE_ROWS` places: (expert,
first place, rows, 0). The products read the tiles, so the device needs no host read of the group sizes:

    hid[p]          = silu(x[order[p] // k] . Wgu[e][:I]) * (x[order[p] // k] . Wgu[e][I:])   (`moe_gate_up`)
    ys[order[p]]    = hid[p] . Wd[e]                                                       (`moe_down`)
    resid[r]       += sum_j wts[r, j] ys[r k + j], j in order                               (`moe_combine`)

for every place p of a tile of expert e. Layouts: idx [n, k] int32; x [n, H] fp16; Wgu[e] [2I, H] and Wd[e]
[H, I] fp16, found through the tables of a `strata_runtime.cuda.experts.LayerExperts` (wherever the expert
is: a VRAM slot, a helper slot or host memory); hid [A, I] fp16; ys [A, H] fp16; wts [n, k] fp32; resid
[n, H] fp32; order and rank [A] int32; tiles [`max_tiles`, 4] int32; n_tiles [1] int32.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from strata_cfg.schema.windows import PREFILL_EXPERT_TILE_ROWS

TILE_ROWS = PREFILL_EXPERT_TILE_ROWS
"""Places per tile: grouped.cu's BM."""


def max_tiles(assignments: int, n_exp: int) -> int:
    """The most tiles ``assignments`` can make over ``n_exp`` experts, however they are routed: each expert's
    last tile is its only partial one."""
    return math.ceil(assignments / TILE_ROWS) + min(n_exp, assignments)


def supported(hidden: int, inter: int, n_exp: int) -> bool:
    """Whether the grouped kernels take a model of this shape: both reductions a multiple of 8 (16-byte
    loads), even outputs, at most 1024 experts."""
    return hidden % 8 == 0 and inter % 8 == 0 and 0 < n_exp <= 1024


def _f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32)


def moe_tiles(
    idx: np.ndarray, n_exp: int, rank: np.ndarray, order: np.ndarray, tiles: np.ndarray, n_tiles: np.ndarray
) -> None:
    """``order``: the assignments of idx grouped by expert, experts in order (within an expert the kernel's
    order is any; here it is the assignments'). ``rank``: scratch. ``tiles`` and ``n_tiles`` as above."""
    flat = idx.reshape(-1)
    counts = np.bincount(flat, minlength=n_exp)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    order[:] = np.argsort(flat, kind="stable")
    rank.reshape(-1)[order] = np.arange(flat.size) - first[flat[order]]
    t = 0
    for e in range(n_exp):
        for s in range(0, int(counts[e]), TILE_ROWS):
            tiles[t] = (e, first[e] + s, min(TILE_ROWS, int(counts[e]) - s), 0)
            t += 1
    n_tiles[0] = t


def _tiles(tiles: np.ndarray, n_tiles: np.ndarray) -> list[tuple[int, int, int]]:
    return [(int(e), int(p), int(n)) for e, p, n, _ in tiles[: int(n_tiles[0])]]


def moe_gate_up(
    x: np.ndarray,
    experts: Any,
    order: np.ndarray,
    tiles: np.ndarray,
    n_tiles: np.ndarray,
    topk: int,
    hid: np.ndarray,
) -> None:
    """``experts.weights(e)``: expert e's gate/up and down (the kernels read them through its tables)."""
    inter = hid.shape[1]
    for e, p, n in _tiles(tiles, n_tiles):
        gu = _f32(x[order[p : p + n] // topk]) @ _f32(experts.weights(e)[0]).T  # [n, 2I]
        gate = gu[:, :inter]
        hid[p : p + n] = (gate / (1.0 + np.exp(-gate)) * gu[:, inter:]).astype(np.float16)


def moe_down(
    hid: np.ndarray, experts: Any, order: np.ndarray, tiles: np.ndarray, n_tiles: np.ndarray, ys: np.ndarray
) -> None:
    for e, p, n in _tiles(tiles, n_tiles):
        ys[order[p : p + n]] = (_f32(hid[p : p + n]) @ _f32(experts.weights(e)[1]).T).astype(np.float16)


def moe_combine(ys: np.ndarray, wts: np.ndarray, resid: np.ndarray) -> None:
    rows, topk = wts.shape
    y = _f32(ys).reshape(rows, topk, -1)
    total = np.zeros_like(resid)
    for j in range(topk):
        total += wts[:, j : j + 1] * y[:, j]
    resid += total
