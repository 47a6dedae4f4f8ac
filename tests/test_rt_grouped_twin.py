"""The grouped expert products' NumPy twin (`strata_runtime.reference.grouped`), which the CPU stand-in of the
CUDA path runs: its grouping, its tile bound and its products against a row-by-row computation; and the CUDA
launchers' compile list, which needs no GPU to check."""

from __future__ import annotations

import numpy as np
import pytest

from strata_runtime.cuda.experts import resident_experts
from strata_runtime.reference import grouped as twin


@pytest.mark.parametrize(
    ("name", "idx"),
    [
        ("one expert takes every row", np.zeros((300, 1), np.int32)),
        ("every expert one row", np.arange(64, dtype=np.int32).reshape(32, 2)),
        ("tile-sized groups", np.repeat(np.arange(3, dtype=np.int32), 128).reshape(-1, 1)),
        ("random", np.random.default_rng(5).integers(0, 64, (257, 8)).astype(np.int32)),
    ],
)
def test_tiles_fit_the_bound_and_cover_every_assignment(name, idx):
    e = 64
    a = idx.size
    rank, order = np.empty(a, np.int32), np.empty(a, np.int32)
    tiles, n = np.full((twin.max_tiles(a, e), 4), -1, np.int32), np.empty(1, np.int32)
    twin.moe_tiles(idx, e, rank, order, tiles, n)
    used = tiles[: n[0]]
    assert n[0] <= twin.max_tiles(a, e), name
    assert (used[:, 2] >= 1).all() and (used[:, 2] <= twin.TILE_ROWS).all()
    np.testing.assert_array_equal(np.sort(order), np.arange(a))
    places = np.concatenate([np.arange(p, p + c) for _, p, c, _ in used])
    np.testing.assert_array_equal(places, np.arange(a))  # the tiles cut `order` end to end, in order
    flat = idx.reshape(-1)
    for ex, p, c, _ in used:
        assert (flat[order[p : p + c]] == ex).all()
    first = {int(ex): int(p) for ex, p, _, _ in used[::-1]}  # each expert's first place
    np.testing.assert_array_equal(rank[order], places - [first[int(ex)] for ex in flat[order]])


def test_products_give_each_assignment_its_experts_output():
    g = np.random.default_rng(11)
    rows, e, k, h, inter = 90, 6, 3, 24, 16
    idx = np.stack([g.choice(e, k, replace=False) for _ in range(rows)]).astype(np.int32)
    x = g.standard_normal((rows, h)).astype(np.float16)
    w_gu = g.standard_normal((e, 2 * inter, h)).astype(np.float16)
    w_d = g.standard_normal((e, h, inter)).astype(np.float16)
    wts = g.random((rows, k)).astype(np.float32)
    a = idx.size
    rank, order = np.empty(a, np.int32), np.empty(a, np.int32)
    tiles, n = np.empty((twin.max_tiles(a, e), 4), np.int32), np.empty(1, np.int32)
    twin.moe_tiles(idx, e, rank, order, tiles, n)
    hid, ys = np.empty((a, inter), np.float16), np.empty((a, h), np.float16)
    experts = resident_experts(w_gu, w_d, np)
    twin.moe_gate_up(x, experts, order, tiles, n, k, hid)
    twin.moe_down(hid, experts, order, tiles, n, ys)
    resid = g.standard_normal((rows, h)).astype(np.float32)
    start = resid.copy()
    twin.moe_combine(ys, wts, resid)
    for r in (0, 45, rows - 1):
        want = np.zeros(h, np.float32)
        for j in range(k):
            gu = w_gu[idx[r, j]].astype(np.float32) @ x[r].astype(np.float32)
            act = (gu[:inter] / (1 + np.exp(-gu[:inter])) * gu[inter:]).astype(np.float16).astype(np.float32)
            y = (w_d[idx[r, j]].astype(np.float32) @ act).astype(np.float16)
            want += wts[r, j] * y.astype(np.float32)
        np.testing.assert_allclose(resid[r] - start[r], want, rtol=2e-3, atol=2e-3)


def test_the_stage_compiles_every_kernel_the_launchers_use() -> None:
    """`GroupedKernels.prepare_all` (run when a stage is built) compiles every expression the four launchers
    then look up, so a first prompt never waits for NVRTC; the products also get their shared memory."""
    from types import SimpleNamespace

    from strata_runtime.cuda.grouped import GroupedKernels, shared_bytes

    kern = GroupedKernels()
    prepared: set[str] = set()
    used: dict[str, SimpleNamespace] = {}
    kern.prepare = lambda expressions: prepared.update(expressions)  # type: ignore[method-assign]

    class Launcher(SimpleNamespace):
        def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
            self.shared.append(shared_mem)

    kern.fn = lambda expression: used.setdefault(  # type: ignore[method-assign]
        expression, Launcher(max_dynamic_shared_size_bytes=0, shared=[])
    )
    kern.prepare_all()
    rows, k, h, inter, e = 5, 2, 16, 8, 4
    idx = np.zeros((rows, k), np.int32)
    tiles = np.zeros((twin.max_tiles(rows * k, e), 4), np.int32)
    x, hid, ys = np.zeros((rows, h)), np.zeros((rows * k, inter)), np.zeros((rows * k, h))
    kern.moe_tiles(idx, e, idx, idx, tiles, idx)
    experts = SimpleNamespace(gate_up=None, down=None)
    kern.moe_gate_up(x, experts, None, tiles, None, k, hid)  # type: ignore[arg-type]
    kern.moe_down(hid, experts, None, tiles, None, ys)  # type: ignore[arg-type]
    kern.moe_combine(ys, np.zeros((rows, k)), x)
    assert set(used) == prepared == {"moe_tiles", "moe_gate_up<128>", "moe_down<128>", "moe_combine"}
    for name in ("moe_gate_up<128>", "moe_down<128>"):
        assert used[name].max_dynamic_shared_size_bytes == shared_bytes(128) == used[name].shared[0]


def test_a_kernels_shared_memory_attribute_is_set_once_per_size() -> None:
    """`KernelCache.fn_with_shared` (the grouped products and the flash kernel launch through it) sets the
    function's dynamic shared memory the first time and again only when the size changes, not per launch."""
    from strata_runtime.cuda.compile import KernelCache

    class Fn:
        def __init__(self) -> None:
            self.sets: list[int] = []

        def __setattr__(self, name: str, value: object) -> None:
            if name == "max_dynamic_shared_size_bytes":
                self.sets.append(int(value))  # type: ignore[call-overload]
            object.__setattr__(self, name, value)

    cache = KernelCache("")
    fn = Fn()
    cache.fn = lambda expression: fn  # type: ignore[method-assign]
    for size in (98304, 98304, 98304, 69632, 69632):
        assert cache.fn_with_shared("k<128>", size) is fn
    assert fn.sets == [98304, 69632]
