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

_SOURCE = source("grouped.cu")
THREADS = 256
BLOCK_FEATURES = 128  # weight rows per block: grouped.cu's BN (moe_gate_up: 64 outputs' gate and up)
SHARED_BYTES = 3 * (TILE_ROWS + BLOCK_FEATURES) * 64 * 2  # STAGES * STAGE_HALFS * sizeof(half)
_LARGE = ("moe_gate_up", "moe_down")


class GroupedKernels(KernelCache):
    """The launchers of ``grouped.cu`` on one device. Create it with that device current."""

    def __init__(self) -> None:
        super().__init__(_SOURCE)
        self._sized: set[str] = set()

    def _large(self, name: str) -> Any:
        """A product kernel, allowed `SHARED_BYTES` of dynamic shared memory (over the default 48 KiB)."""
        fn = self.fn(name)
        if name not in self._sized:
            fn.max_dynamic_shared_size_bytes = SHARED_BYTES  # CuPy's RawKernel sets the function attribute
            self._sized.add(name)
        return fn

    def moe_tiles(self, idx: Any, n_exp: int, rank: Any, order: Any, tiles: Any, n_tiles: Any) -> None:
        """Group idx [n, k]'s assignments by expert into ``order`` [A] and ``tiles`` [max_tiles, 4], their
        count into ``n_tiles`` [1]; ``rank`` [A] is scratch."""
        self.fn("moe_tiles")(
            (1,), (1024,), (idx, np.int32(idx.size), np.int32(n_exp), rank, order, tiles, n_tiles)
        )

    def moe_gate_up(self, x: Any, w: Any, order: Any, tiles: Any, n_tiles: Any, topk: int, hid: Any) -> None:
        """hid [A, I] fp16: each place's SwiGLU of its row of x [n, H] through its expert's w [E, 2I, H]."""
        h, inter = x.shape[1], hid.shape[1]
        grid = (tiles.shape[0], math.ceil(inter / (BLOCK_FEATURES // 2)))
        self._large("moe_gate_up")(
            grid,
            (THREADS,),
            (x, w, order, tiles, n_tiles, hid, np.int32(h), np.int32(inter), np.int32(topk)),
            shared_mem=SHARED_BYTES,
        )

    def moe_down(self, hid: Any, w: Any, order: Any, tiles: Any, n_tiles: Any, ys: Any) -> None:
        """ys [A, H] fp16, by assignment: each place's hid [A, I] through its expert's w [E, H, I]."""
        inter, h = hid.shape[1], ys.shape[1]
        grid = (tiles.shape[0], math.ceil(h / BLOCK_FEATURES))
        self._large("moe_down")(
            grid,
            (THREADS,),
            (hid, w, order, tiles, n_tiles, ys, np.int32(h), np.int32(inter)),
            shared_mem=SHARED_BYTES,
        )

    def moe_combine(self, ys: Any, wts: Any, resid: Any) -> None:
        """resid [n, H] += each row's k results of ys [A, H] weighted by wts [n, k], in choice order."""
        rows, topk = wts.shape
        args = (ys, wts, resid, np.int32(topk), np.int32(resid.shape[1]))
        self.fn("moe_combine")((rows,), (THREADS,), args)


@cache
def grouped_kernels_for(device_id: int) -> GroupedKernels:
    """The grouped kernels of CUDA device ``device_id``."""
    with cupy_module().cuda.Device(device_id):
        return GroupedKernels()
