"""Grouped expert products for long prefill chunks: the launchers of ``grouped.cu``.

The routed experts of a chunk run as one product per projection over every expert the chunk routes to,
without a host read: `moe_tiles` groups the assignments by expert on the device and cuts them into tiles of at
most 128 places, and each product launches a grid sized for the most tiles any routing can make
(`strata_runtime.reference.grouped.max_tiles`); blocks past the real count return at once. So a layer's
launches queue behind each other, and the host runs ahead through the whole chunk. Each block reads its
expert's weight tile once for up to 128 rows on tensor cores (fp16 inputs, fp32 accumulation); the gate and
up features of an output sit in one thread, so the SwiGLU is fused into the first product.

The contract, the layouts and the NumPy reference are in `strata_runtime.reference.grouped`. Every launcher
takes CuPy arrays on one device and allocates nothing.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numpy as np

from ..backend import cupy_module
from ..reference.grouped import TILE_ROWS
from .compile import KernelCache, source
from .experts import LayerExperts

_SOURCE = source("grouped.cu")
THREADS = 256
STAGES, STEP = 3, 64  # grouped.cu's STAGES and BK
BLOCK_FEATURES = 128
"""Weight rows per product block (grouped.cu's BN; for moe_gate_up 64 gate and 64 up rows). On an H200, 256
measured slower for both products."""


def shared_bytes(features: int) -> int:
    """Dynamic shared memory of a product block of ``features`` weight rows: STAGES (BM + BN) BK halves."""
    return STAGES * (TILE_ROWS + features) * STEP * 2


class GroupedKernels(KernelCache):
    """The launchers of ``grouped.cu`` on one device. Create it with that device current."""

    def __init__(self) -> None:
        super().__init__(_SOURCE)

    def prepare_all(self) -> None:
        """Compile every kernel the launchers use in one NVRTC run, so a first prompt does not wait for it."""
        self.prepare(expressions())

    def moe_tiles(self, idx: Any, n_exp: int, rank: Any, order: Any, tiles: Any, n_tiles: Any) -> None:
        """Group idx [n, k]'s assignments by expert into ``order`` [A] and ``tiles`` [max_tiles, 4], their
        count into ``n_tiles`` [1]; ``rank`` [A] is scratch."""
        self.fn("moe_tiles")(
            (1,), (1024,), (idx, np.int32(idx.size), np.int32(n_exp), rank, order, tiles, n_tiles)
        )

    def moe_gate_up(
        self, x: Any, experts: LayerExperts, order: Any, tiles: Any, n_tiles: Any, topk: int, hid: Any
    ) -> None:
        """hid [A, I] fp16: each place's SwiGLU of its row of x [n, H] through its expert's gate/up [2I, H],
        found through ``experts.gate_up``."""
        h, inter, smem = x.shape[1], hid.shape[1], shared_bytes(BLOCK_FEATURES)
        self.fn_with_shared(_product("moe_gate_up"), smem)(
            (tiles.shape[0], math.ceil(inter / (BLOCK_FEATURES // 2))),
            (THREADS,),
            (x, experts.gate_up, order, tiles, n_tiles, hid, np.int32(h), np.int32(inter), np.int32(topk)),
            shared_mem=smem,
        )

    def moe_down(
        self, hid: Any, experts: LayerExperts, order: Any, tiles: Any, n_tiles: Any, ys: Any
    ) -> None:
        """ys [A, H] fp16, by assignment: each place's hid [A, I] through its expert's down [H, I], found
        through ``experts.down``."""
        inter, h, smem = hid.shape[1], ys.shape[1], shared_bytes(BLOCK_FEATURES)
        self.fn_with_shared(_product("moe_down"), smem)(
            (tiles.shape[0], math.ceil(h / BLOCK_FEATURES)),
            (THREADS,),
            (hid, experts.down, order, tiles, n_tiles, ys, np.int32(h), np.int32(inter)),
            shared_mem=smem,
        )

    def moe_combine(self, ys: Any, wts: Any, resid: Any) -> None:
        """resid [n, H] += each row's k results of ys [A, H] weighted by wts [n, k], in choice order."""
        rows, topk = wts.shape
        args = (ys, wts, resid, np.int32(topk), np.int32(resid.shape[1]))
        self.fn("moe_combine")((rows,), (THREADS,), args)


def _product(name: str) -> str:
    """The instantiation of a product kernel the launchers use."""
    return f"{name}<{BLOCK_FEATURES}>"


@cache
def grouped_kernels_for(device_id: int) -> GroupedKernels:
    """The grouped kernels of CUDA device ``device_id``."""
    with cupy_module().cuda.Device(device_id):
        return GroupedKernels()


def expressions() -> list[str]:
    """Every instantiation of grouped.cu the launchers use."""
    return ["moe_tiles", _product("moe_gate_up"), _product("moe_down"), "moe_combine"]
