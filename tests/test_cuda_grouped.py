"""The grouped expert kernels of long prefill chunks (`strata_runtime.cuda.grouped`) against their NumPy twin.

Outputs are poisoned with NaN before each launch, so a place or an assignment no block wrote fails. Shapes
cover the production one (hidden 2048, expert width 768, 128 experts top-8), reductions and outputs that are
not multiples of a block's (the zero-filled tails), and a skewed routing whose popular experts span several
tiles of rows. The products run on tensor cores in fp16 with fp32 accumulation and round their outputs to
fp16, as the twin does, so they agree to fp16 rounding (`HALF_REL`).
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_checks import rel_err, rng

from strata_runtime.cuda.experts import LayerExperts, addresses, resident_experts
from strata_runtime.experts.host import host_empty
from strata_runtime.reference import grouped as twin

pytestmark = pytest.mark.gpu

HALF_REL = 2e-3
"""fp16 outputs whose inputs were summed in a different order: a few fp16 ulps at most."""


@pytest.fixture(scope="module")
def gpu():
    cp = pytest.importorskip("cupy")
    from strata_runtime.cuda.grouped import grouped_kernels_for

    return cp, grouped_kernels_for(0)


def routing(g: np.random.Generator, rows: int, e: int, k: int, skew: float) -> np.ndarray:
    """idx [rows, k] int32: k distinct experts per row, expert i drawn with weight (i + 1)^-skew."""
    p = (np.arange(e) + 1.0) ** -skew
    return np.stack([g.choice(e, k, replace=False, p=p / p.sum()) for _ in range(rows)]).astype(np.int32)


def tiles_of(cp, kern, idx: np.ndarray, e: int):
    """The device's grouping of idx: order, tiles and their count (device arrays), and the twin's."""
    a = idx.size
    rank, order = cp.full(a, -1, cp.int32), cp.full(a, -1, cp.int32)
    tiles, n_tiles = cp.full((twin.max_tiles(a, e), 4), -1, cp.int32), cp.full(1, -1, cp.int32)
    kern.moe_tiles(cp.asarray(idx), e, rank, order, tiles, n_tiles)
    want = (np.empty(a, np.int32), np.empty(a, np.int32), np.empty((twin.max_tiles(a, e), 4), np.int32))
    want_n = np.empty(1, np.int32)
    twin.moe_tiles(idx, e, want[0], want[1], want[2], want_n)
    return (order, tiles, n_tiles), (want[1], want[2], want_n)


SHAPES = [  # rows, experts, k, hidden, expert width, skew
    (1, 8, 2, 64, 64, 0.0),
    (130, 16, 4, 72, 40, 0.0),  # tails: a reduction of 72 and 40, 40 outputs, 130 rows
    (333, 128, 8, 2048, 768, 0.0),
    (700, 64, 8, 256, 128, 1.2),  # skewed: the popular experts get several tiles
]


@pytest.mark.parametrize(("rows", "e", "k", "h", "inter", "skew"), SHAPES)
def test_tiles_group_every_assignment_by_expert(gpu, rows, e, k, h, inter, skew):
    cp, kern = gpu
    idx = routing(rng(), rows, e, k, skew)
    (order, tiles, n_tiles), (_, want_tiles, want_n) = tiles_of(cp, kern, idx, e)
    n = int(n_tiles.get()[0])
    assert n == int(want_n[0])
    # The tile table does not depend on the order within an expert: it equals the twin's exactly.
    np.testing.assert_array_equal(tiles.get()[:n], want_tiles[:n])
    got = order.get()
    np.testing.assert_array_equal(np.sort(got), np.arange(idx.size))  # every assignment once
    flat = idx.reshape(-1)
    for ex, p0, count, _ in tiles.get()[:n]:
        assert (flat[got[p0 : p0 + count]] == ex).all()
    assert int(np.ceil(np.bincount(flat, minlength=e) / twin.TILE_ROWS).sum()) == n


@pytest.mark.parametrize(("rows", "e", "k", "h", "inter", "skew"), SHAPES)
def test_products_match_the_twin(gpu, rows, e, k, h, inter, skew):
    cp, kern = gpu
    g = rng()
    idx = routing(g, rows, e, k, skew)
    (order, tiles, n_tiles), _ = tiles_of(cp, kern, idx, e)
    x = g.standard_normal((rows, h)).astype(np.float16)
    w_gu = (g.standard_normal((e, 2 * inter, h)) / np.sqrt(h)).astype(np.float16)
    w_d = (g.standard_normal((e, h, inter)) / np.sqrt(inter)).astype(np.float16)
    a = idx.size
    hid_d = cp.full((a, inter), cp.nan, cp.float16)
    on_device = resident_experts(cp.asarray(w_gu), cp.asarray(w_d), cp)
    kern.moe_gate_up(cp.asarray(x), on_device, order, tiles, n_tiles, k, hid_d)
    order_h, tiles_h, n_h = order.get(), tiles.get(), n_tiles.get()
    hid = np.empty((a, inter), np.float16)
    on_host = resident_experts(w_gu, w_d, np)
    twin.moe_gate_up(x, on_host, order_h, tiles_h, n_h, k, hid)
    assert rel_err(hid_d.get(), hid) < HALF_REL

    ys_d = cp.full((a, h), cp.nan, cp.float16)
    kern.moe_down(hid_d, on_device, order, tiles, n_tiles, ys_d)
    ys = np.empty((a, h), np.float16)
    twin.moe_down(hid_d.get(), on_host, order_h, tiles_h, n_h, ys)
    assert rel_err(ys_d.get(), ys) < HALF_REL
    # Each assignment's row: row r's choice j went through expert idx[r, j] (ys by assignment, not place).
    for r, j in ((0, 0), (rows - 1, k - 1)):
        xr = x[r].astype(np.float32)
        gu = w_gu[idx[r, j]].astype(np.float32) @ xr
        act = gu[:inter] / (1 + np.exp(-gu[:inter])) * gu[inter:]
        want = w_d[idx[r, j]].astype(np.float32) @ act
        assert rel_err(ys_d.get()[r * k + j], want) < 1e-2


@pytest.mark.parametrize(("rows", "k", "h"), [(1, 2, 64), (333, 8, 2048), (50, 3, 100)])
def test_combine_matches_the_twin(gpu, rows, k, h):
    cp, kern = gpu
    g = rng()
    ys = g.standard_normal((rows * k, h)).astype(np.float16)
    wts = g.random((rows, k)).astype(np.float32) + 0.1
    resid = g.standard_normal((rows, h)).astype(np.float32)
    r_d = cp.asarray(resid)
    kern.moe_combine(cp.asarray(ys), cp.asarray(wts), r_d)
    twin.moe_combine(ys, wts, resid)
    assert rel_err(r_d.get(), resid) < 1e-6


def test_a_rows_products_do_not_depend_on_the_other_rows(gpu):
    """A row's expert outputs are the same bit for bit alone in its expert's tile or among 200 others."""
    cp, kern = gpu
    g = rng()
    e, k, h, inter = 16, 4, 256, 128
    idx = routing(g, 200, e, k, 0.0)
    x = g.standard_normal((200, h)).astype(np.float16)
    w_gu = cp.asarray((g.standard_normal((e, 2 * inter, h)) / 16).astype(np.float16))
    w_d = cp.asarray((g.standard_normal((e, h, inter)) / 16).astype(np.float16))
    experts = resident_experts(w_gu, w_d, cp)

    def outputs(rows: slice) -> np.ndarray:
        sub = np.ascontiguousarray(idx[rows])
        (order, tiles, n_tiles), _ = tiles_of(cp, kern, sub, e)
        hid = cp.full((sub.size, inter), cp.nan, cp.float16)
        kern.moe_gate_up(cp.asarray(x[rows]), experts, order, tiles, n_tiles, k, hid)
        ys = cp.full((sub.size, h), cp.nan, cp.float16)
        kern.moe_down(hid, experts, order, tiles, n_tiles, ys)
        return ys.get().reshape(-1, k, h)

    whole = outputs(slice(0, 200))
    for r in (0, 77, 199):
        np.testing.assert_array_equal(outputs(slice(r, r + 1))[0], whole[r])


def test_the_products_read_each_expert_where_its_table_points_bit_for_bit(gpu):
    """Under an expert cache a layer's experts are scattered: some in VRAM slots of a pool in any order, the
    rest in pinned, mapped host memory, which the blocks read over the host link. Through tables that point
    there, the products give the same bits as over one stacked array on the device; a table that points
    one expert at another's weights does not."""
    cp, kern = gpu
    g = rng()
    rows, e, k, h, inter = 300, 16, 4, 256, 128
    idx = routing(g, rows, e, k, 0.0)
    x = cp.asarray(g.standard_normal((rows, h)).astype(np.float16))
    w_gu = (g.standard_normal((e, 2 * inter, h)) / 16).astype(np.float16)
    w_d = (g.standard_normal((e, h, inter)) / 16).astype(np.float16)
    (order, tiles, n_tiles), _ = tiles_of(cp, kern, idx, e)

    def outputs(experts: LayerExperts) -> np.ndarray:
        hid = cp.full((idx.size, inter), cp.nan, cp.float16)
        kern.moe_gate_up(x, experts, order, tiles, n_tiles, k, hid)
        ys = cp.full((idx.size, h), cp.nan, cp.float16)
        kern.moe_down(hid, experts, order, tiles, n_tiles, ys)
        return ys.get()

    stacked = outputs(resident_experts(cp.asarray(w_gu), cp.asarray(w_d), cp))
    in_vram = np.arange(
        0, e, 2
    )  # the even experts hold slots, in reverse order; the odd ones stay on the host
    pool_gu, pool_d = cp.asarray(w_gu[in_vram[::-1]]), cp.asarray(w_d[in_vram[::-1]])
    host_gu = host_empty(w_gu.shape, np.float16, pinned=True)
    host_d = host_empty(w_d.shape, np.float16, pinned=True)
    host_gu[...], host_d[...] = w_gu, w_d
    gu_at, d_at = addresses(host_gu), addresses(host_d)
    slot = {int(ex): len(in_vram) - 1 - n for n, ex in enumerate(in_vram)}
    for ex, s in slot.items():
        gu_at[ex], d_at[ex] = addresses(pool_gu)[s], addresses(pool_d)[s]
    scattered = LayerExperts(cp.asarray(gu_at), cp.asarray(d_at), lambda ex: (w_gu[ex], w_d[ex]))
    np.testing.assert_array_equal(outputs(scattered), stacked)
    gu_at[1] = gu_at[3]  # expert 1's gate/up read from expert 3's host copy
    wrong = LayerExperts(cp.asarray(gu_at), cp.asarray(d_at), lambda ex: (w_gu[ex], w_d[ex]))
    assert not np.array_equal(outputs(wrong), stacked)
