"""Every CUDA decode kernel against its NumPy twin, on fresh random inputs of several shapes.

Outputs are poisoned with NaN before each launch, so an element the kernel fails to write fails the test.
Bounds are relative Frobenius errors: fp32 arithmetic on fp16 weights lands far under 1e-4.
"""

from __future__ import annotations

from math import ceil

import numpy as np
import pytest
from kernel_checks import rel_err, rng

from strata_runtime.models.ops.distribution import log_min_p

pytestmark = pytest.mark.gpu

REL = 2e-4


@pytest.fixture(scope="module")
def gpu():
    cp = pytest.importorskip("cupy")
    from strata_runtime.cuda import ops
    from strata_runtime.reference import kernels as ref

    return cp, ops.kernels_for(0), ref


def half(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16)


GEMV_ROWS = [1, 2, 3, 4, 8]
GEMV_SHAPES = [(512, 2048), (1000, 4096), (96, 768), (130, 64), (33, 200)]
GEMV_SHAPES += [(128, 2048), (255, 4096), (1, 2048)]  # router-sized: the split reduction


@pytest.fixture(scope="module")
def gemv_prepared(gpu):
    """Every GEMV instantiation the twin test launches, compiled in one NVRTC run rather than one per test."""
    _, kern, _ = gpu
    kern.prepare(
        {kern.gemv_expr(r, n, k, norm) for r in GEMV_ROWS for n, k in GEMV_SHAPES for norm in (False, True)}
    )


@pytest.mark.parametrize("rows", GEMV_ROWS)
@pytest.mark.parametrize(("n", "k"), GEMV_SHAPES)
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("with_norm", [False, True])
def test_gemv_matches_twin(gpu, gemv_prepared, rows, n, k, accumulate, with_norm):
    cp, kern, ref = gpu
    g = rng()
    w = half(g.standard_normal((n, k)) * 0.05)
    x = (g.standard_normal((rows, k)) * 3).astype(np.float32)
    nw = half(1 + 0.1 * g.standard_normal(k)) if with_norm else None
    base = g.standard_normal((rows, n)).astype(np.float32)
    out_d = cp.asarray(base if accumulate else np.full((rows, n), np.nan, np.float32))
    kern.gemv(cp.asarray(w), cp.asarray(x), out_d, accumulate, cp.asarray(nw) if nw is not None else None)
    want = base.copy()
    ref.gemv(w, x, want, accumulate, nw)
    assert rel_err(out_d.get(), want) < REL


@pytest.mark.parametrize(("rows", "h"), [(1, 2048), (5, 64), (8, 4096)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_fp32_matches_twin(gpu, rows, h, with_delta):
    cp, kern, ref = gpu
    g = rng()
    resid = g.standard_normal((rows, h)).astype(np.float32)
    delta = g.standard_normal((rows, h)).astype(np.float32) if with_delta else None
    w = half(1 + 0.1 * g.standard_normal(h))
    r_d, out_d = cp.asarray(resid), cp.full((rows, h), cp.nan, cp.float32)
    kern.add_rms_norm_fp32(r_d, cp.asarray(delta) if delta is not None else None, cp.asarray(w), out_d, 1e-6)
    out = np.empty_like(resid)
    ref.add_rms_norm_fp32(resid, delta, w, out, 1e-6)
    assert rel_err(r_d.get(), resid) < REL
    assert rel_err(out_d.get(), out) < REL


@pytest.fixture(params=["tc", "split"])
def attention_kernel(request) -> bool:
    """Decode attention on tensor cores (``attn_tc``, where the shape allows; True) and the FMA kernel
    (``attn_split``, which the other shapes take; False), as each launch asks (``tensor_cores``): both must
    match the reference."""
    return request.param == "tc"


def _attention_workspace(cp, kern, tc: bool, rows: int, n_q: int, n_kv: int, d: int, t: int) -> tuple:
    """Decode attention's scratch, sized exactly for the kernel that runs and filled with NaN (a partial it
    reads but never wrote shows), and its counters at zero, for ``rows`` rows over a ``t``-position cache."""
    from strata_runtime.cuda.choices import attention_counters, attention_scratch_size

    size = attention_scratch_size(rows, n_q, n_kv, d, t, kern.attention_on_tc(d, n_q // n_kv, tc))
    return cp.full(size, cp.nan, cp.float32), cp.zeros((rows, attention_counters(n_kv, t)), cp.int32)


@pytest.mark.parametrize(
    ("n_q", "n_kv", "d"), [(32, 4, 128), (4, 2, 16), (8, 2, 32), (64, 4, 128), (16, 2, 64), (8, 2, 256)]
)
def test_qk_norm_rope_kv_and_attention_match_the_reference(gpu, attention_kernel, n_q, n_kv, d):
    cp, kern, ref = gpu
    g = rng()
    slots, t, rows = 3, 700, 5
    pos = g.integers(0, t, rows).astype(np.int32)
    slot = g.integers(0, slots, rows).astype(np.int32)
    # Distinct (slot, pos) per row so the cache writes do not overlap.
    pos[:] = np.arange(rows) * 97 % t
    qkv = g.standard_normal((rows, (n_q + 2 * n_kv) * d)).astype(np.float32)
    qn, kn = half(1 + 0.1 * g.standard_normal(d)), half(1 + 0.1 * g.standard_normal(d))
    kc = half(g.standard_normal((slots, n_kv, t, d)))
    vc = half(g.standard_normal((slots, n_kv, t, d)))
    kc_d, vc_d = cp.asarray(kc), cp.asarray(vc)
    q_d = cp.full((rows, n_q, d), cp.nan, cp.float32)
    kern.qk_norm_rope_kv(
        cp.asarray(qkv),
        cp.asarray(qn),
        cp.asarray(kn),
        cp.asarray(pos),
        cp.asarray(slot),
        q_d,
        kc_d,
        vc_d,
        1e6,
        1e-6,
    )
    q = np.empty((rows, n_q, d), np.float32)
    ref.qk_norm_rope_kv(qkv, qn, kn, pos, slot, q, kc, vc, 1e6, 1e-6)
    assert rel_err(q_d.get(), q) < 1e-3  # sincos of large angles in fp32
    assert rel_err(kc_d.get(), kc) < 1e-3
    assert rel_err(vc_d.get(), vc) < 1e-3

    scratch, done = _attention_workspace(cp, kern, attention_kernel, rows, n_q, n_kv, d, t)
    out = np.empty((rows, n_q * d), np.float32)
    ref.attention(q, kc_d.get(), vc_d.get(), pos, slot, out)
    firsts = []
    for _ in range(2):  # the second launch finds the counters the first left: they must be back at zero
        out_d = cp.full((rows, n_q * d), cp.nan, cp.float32)
        args = (cp.asarray(q), kc_d, vc_d, cp.asarray(pos), cp.asarray(slot), out_d, scratch, done)
        kern.attention(*args, tensor_cores=attention_kernel)
        assert rel_err(out_d.get(), out) < REL
        assert not done.get().any()
        firsts.append(out_d.get())
    np.testing.assert_array_equal(firsts[0], firsts[1])  # the merge runs chunks in order, whoever is last
    from strata_runtime.cuda.choices import attention_on_tensor_cores

    if attention_kernel and attention_on_tensor_cores(d, n_q // n_kv):  # it ran, not attn_split
        assert f"attn_tc<{d},{n_q // n_kv},0>" in kern._fns


def test_attention_merges_hundreds_of_chunks(gpu, attention_kernel):
    """Past about 16k positions `attn_split`'s merge reads the chunks' statistics from global memory instead
    of shared memory, and `attn_tc`'s blocks each stream several chunks (64 runs of 10 chunks at the longest
    row here); both must agree with the reference, with ``attn_tc``'s scratch of
    64 partials a row and head."""
    cp, kern, ref = gpu
    g = rng()
    slots, n_q, n_kv, d, t = 2, 32, 4, 128, 40_000
    pos, slot = np.array([t - 1, 100, 16_300], np.int32), np.array([0, 1, 1], np.int32)
    q = g.standard_normal((3, n_q, d)).astype(np.float32)
    kc, vc = half(g.standard_normal((slots, n_kv, t, d))), half(g.standard_normal((slots, n_kv, t, d)))
    out_d = cp.full((3, n_q * d), cp.nan, cp.float32)
    scratch, done = _attention_workspace(cp, kern, attention_kernel, 3, n_q, n_kv, d, t)
    args = (cp.asarray(q), cp.asarray(kc), cp.asarray(vc), cp.asarray(pos), cp.asarray(slot))
    kern.attention(*args, out_d, scratch, done, tensor_cores=attention_kernel)
    out = np.empty((3, n_q * d), np.float32)
    ref.attention(q, kc, vc, pos, slot, out)
    assert rel_err(out_d.get(), out) < REL


def test_attention_refuses_a_scratch_too_small_for_the_kernel_that_runs(gpu, attention_kernel):
    """``attn_tc`` keeps 64 partials a row and head at most, ``attn_split`` one per 64 positions of the
    context: each launch checks the scratch it was given against its own kernel's need."""
    from strata_runtime.cuda.choices import attention_counters, attention_scratch_size

    cp, kern, _ = gpu
    g = rng()
    rows, n_q, n_kv, d, t = 2, 32, 4, 128, 9000
    tc = kern.attention_on_tc(d, n_q // n_kv, attention_kernel)
    assert tc == attention_kernel
    need = attention_scratch_size(rows, n_q, n_kv, d, t, tc)
    assert need == rows * n_q * (64 if tc else 141) * (d + 2)
    q = cp.asarray(g.standard_normal((rows, n_q, d)).astype(np.float32))
    kc = cp.asarray(half(g.standard_normal((rows, n_kv, t, d))))
    pos, slot = cp.asarray(np.array([t - 1, 5000], np.int32)), cp.arange(rows, dtype=cp.int32)
    out = cp.full((rows, n_q * d), cp.nan, cp.float32)
    done = cp.zeros((rows, attention_counters(n_kv, t)), cp.int32)
    with pytest.raises(
        ValueError, match=f"attention needs {need} floats of scratch for 2 rows, got {need - 1}"
    ):
        kern.attention(q, kc, kc, pos, slot, out, cp.zeros(need - 1, cp.float32), done, tensor_cores=tc)
    kern.attention(q, kc, kc, pos, slot, out, cp.zeros(need, cp.float32), done, tensor_cores=tc)
    assert np.isfinite(out.get()).all()


@pytest.mark.parametrize(
    ("n_q", "n_kv", "d", "t"),
    [
        (32, 4, 128, 700),
        (8, 2, 32, 700),
        (16, 2, 64, 700),
        (8, 2, 256, 700),
        (64, 4, 128, 700),
        (32, 4, 128, 2500),  # rows past 16 chunks merge them in groups, then the groups
        (8, 2, 32, 2500),
        (32, 4, 128, 9000),  # attn_tc: up to 128 chunks in 16 runs or fewer, then up to 64
        (16, 4, 64, 9000),
    ],
)
def test_attention_row_is_the_same_in_every_window(gpu, attention_kernel, n_q, n_kv, d, t):
    """`attn_split`'s windows of 1-2 rows take 256-thread blocks and larger windows 128 (`attention_shape`);
    `attn_tc` splits a row by its position alone (one run up to 3 chunks: positions 64 and 191 here; 192 is
    the first in several). A row's output must be the same bit for bit alone, in a 2-row window and in a
    5-row window, whether it is one run or its partials merge at once or in groups."""
    from strata_runtime.cuda.choices import attention_shape

    cp, kern, _ = gpu
    g = rng()
    slots, rows = 5, 5
    assert attention_shape(d, n_q // n_kv, 1)[1] == attention_shape(d, n_q // n_kv, rows)[1]
    pos = {700: [t - 1, 64, 191, 192, 1], 2500: [t - 1, 1024, 1023, 2047, 1100]}.get(
        t,
        [t - 1, 4095, 8191, 8192, 6000],  # 141, 64, 128, 129 and 94 chunks
    )
    pos = np.array(pos, np.int32)
    slot = np.arange(rows, dtype=np.int32)
    q = cp.asarray(g.standard_normal((rows, n_q, d)).astype(np.float32))
    kc = cp.asarray(half(g.standard_normal((slots, n_kv, t, d))))
    vc = cp.asarray(half(g.standard_normal((slots, n_kv, t, d))))

    def attend(sel: list[int]) -> np.ndarray:
        r = len(sel)
        out = cp.full((r, n_q * d), cp.nan, cp.float32)
        scratch, done = _attention_workspace(cp, kern, attention_kernel, r, n_q, n_kv, d, t)
        rows_of = (cp.asarray(pos[sel]), cp.asarray(slot[sel]))
        kern.attention(q[sel], kc, vc, *rows_of, out, scratch, done, tensor_cores=attention_kernel)
        return out.get()

    every = attend(list(range(rows)))
    for r in range(rows):
        np.testing.assert_array_equal(attend([r])[0], every[r])
        np.testing.assert_array_equal(attend([r, (r + 1) % rows])[0], every[r])


@pytest.mark.parametrize(("n_q", "n_kv", "d"), [(32, 4, 128), (4, 2, 16), (64, 4, 128), (16, 2, 64)])
def test_attention_reads_nothing_past_each_rows_position(gpu, attention_kernel, n_q, n_kv, d):
    """The cache past a row's position may hold anything (an earlier request's keys, NaN, inf): the output
    must match the reference over positions 0..pos alone, at every kind of row (inside one chunk, ending
    mid-chunk, and a long row whose blocks stream several chunks)."""
    cp, kern, ref = gpu
    g = rng()
    t = 9000
    pos = np.array([0, 40, 64, 1000, 7000], np.int32)
    rows = len(pos)
    slot = np.arange(rows, dtype=np.int32)
    q = g.standard_normal((rows, n_q, d)).astype(np.float32)
    kc, vc = half(g.standard_normal((rows, n_kv, t, d))), half(g.standard_normal((rows, n_kv, t, d)))
    poisoned_k, poisoned_v = kc.copy(), vc.copy()
    for r, p in enumerate(pos):
        poisoned_k[r, :, p + 1 :] = np.float16(np.nan)
        poisoned_v[r, :, p + 1 :: 2] = np.float16(np.inf)
        poisoned_v[r, :, p + 2 :: 2] = np.float16(np.nan)
    out_d = cp.full((rows, n_q * d), cp.nan, cp.float32)
    scratch, done = _attention_workspace(cp, kern, attention_kernel, rows, n_q, n_kv, d, t)
    kern.attention(
        cp.asarray(q),
        cp.asarray(poisoned_k),
        cp.asarray(poisoned_v),
        cp.asarray(pos),
        cp.asarray(slot),
        out_d,
        scratch,
        done,
        tensor_cores=attention_kernel,
    )
    out = np.empty((rows, n_q * d), np.float32)
    ref.attention(q, kc, vc, pos, slot, out)
    assert rel_err(out_d.get(), out) < REL
    assert not done.get().any()


def _moe_inputs(g: np.random.Generator, rows: int, e: int, h: int, inter: int) -> tuple[np.ndarray, ...]:
    """A window's rows, norm, router logits, experts (gate/up, down) and residual for the expert kernels."""
    x = (g.standard_normal((rows, h)) * 2).astype(np.float32)
    nw = half(1 + 0.1 * g.standard_normal(h))
    logits = g.standard_normal((rows, e)).astype(np.float32)
    gate_up = half(g.standard_normal((e, 2 * inter, h)) * 0.03)
    down = half(g.standard_normal((e, h, inter)) * 0.03)
    return x, nw, logits, gate_up, down, g.standard_normal((rows, h)).astype(np.float32)


@pytest.mark.parametrize(
    ("rows", "e", "k", "h", "inter"),
    [
        (1, 128, 8, 2048, 768),
        (3, 16, 4, 256, 128),
        (8, 8, 2, 64, 64),
        (4, 64, 8, 2048, 768),
        (8, 128, 8, 2048, 768),
        (2, 256, 8, 512, 256),
        (7, 16, 16, 256, 256),  # every row routes to every expert: 7 assignments share each
    ],
)
@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_matches_twin(gpu, rows, e, k, h, inter, norm_topk):
    from strata_runtime.cuda.experts import LayerExperts, resident_experts

    cp, kern, ref = gpu
    g = rng()
    x, nw, logits, gate_up, down, resid = _moe_inputs(g, rows, e, h, inter)
    r_d = cp.asarray(resid)
    idx_d, w_d = cp.full((rows, k), -1, cp.int32), cp.full((rows, k), cp.nan, cp.float32)
    experts = resident_experts(cp.asarray(gate_up), cp.asarray(down), cp)
    h_d = cp.full((rows * k, inter), cp.nan, cp.float32)
    kern.moe(
        cp.asarray(x), cp.asarray(nw), cp.asarray(logits), norm_topk, 1e-6, experts, r_d, idx_d, w_d, h_d
    )
    idx, w = np.empty((rows, k), np.int32), np.empty((rows, k), np.float32)
    host = LayerExperts(np.zeros(e), np.zeros(e), lambda i: (gate_up[i], down[i]))
    ref.moe(x, nw, logits, norm_topk, 1e-6, host, resid, idx, w, np.empty((rows * k, inter), np.float32))
    np.testing.assert_array_equal(idx_d.get(), idx)
    assert rel_err(w_d.get(), w) < REL
    assert rel_err(r_d.get(), resid) < REL


@pytest.mark.parametrize(("e", "k", "h", "inter"), [(128, 8, 2048, 768), (16, 4, 256, 256), (8, 2, 64, 64)])
def test_moe_rows_are_batch_invariant(gpu, e, k, h, inter):
    """A row's experts give the same bits alone and in a window of 8 rows, some of which share its experts:
    greedy text must not depend on which rows share a window."""
    from strata_runtime.cuda.experts import resident_experts

    cp, kern, _ = gpu
    g = rng()
    x, nw, logits, gate_up, down, resid = _moe_inputs(g, 8, e, h, inter)
    logits[1::2] = logits[0]  # every other row routes as row 0 does: experts shared across the window
    experts = resident_experts(cp.asarray(gate_up), cp.asarray(down), cp)

    def run(rows: slice) -> np.ndarray:
        n = len(range(8)[rows])
        r_d = cp.asarray(resid[rows])
        idx_d, w_d = cp.zeros((n, k), cp.int32), cp.zeros((n, k), cp.float32)
        h_d = cp.zeros((n * k, inter), cp.float32)
        args = (cp.asarray(x[rows]), cp.asarray(nw), cp.asarray(logits[rows]), True, 1e-6, experts, r_d)
        kern.moe(*args, idx_d, w_d, h_d)
        return r_d.get()

    window = run(slice(0, 8))
    for r in (0, 1, 5):
        np.testing.assert_array_equal(run(slice(r, r + 1))[0], window[r])
    np.testing.assert_array_equal(run(slice(2, 5)), window[2:5])


@pytest.mark.parametrize("warm", ["1", "1/early", "8", "8/early"])
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_moe_warming_l2_gives_the_same_bits(gpu, warm, rows):
    """The down products bringing other weights into L2 (before or after their own wait and loads, in
    windows the policy covers or not) change no bit of the routing or the residual, and leave the warmed
    weights as they were."""
    from strata_runtime.cuda.choices import L2Warm, l2_warm
    from strata_runtime.cuda.experts import resident_experts

    cp, kern, _ = gpu
    g = rng()
    e, k, h, inter = 128, 8, 2048, 768
    x, nw, logits, gate_up, down, resid = _moe_inputs(g, rows, e, h, inter)
    experts = resident_experts(cp.asarray(gate_up), cp.asarray(down), cp)
    next_qkv = cp.asarray(half(g.standard_normal((5120, h))))
    before = next_qkv.get()

    def run(heat) -> tuple[np.ndarray, np.ndarray]:
        r_d = cp.asarray(resid)
        idx_d, w_d = cp.zeros((rows, k), cp.int32), cp.zeros((rows, k), cp.float32)
        h_d = cp.zeros((rows * k, inter), cp.float32)
        args = (cp.asarray(x), cp.asarray(nw), cp.asarray(logits), True, 1e-6, experts, r_d, idx_d, w_d, h_d)
        kern.moe(*args, warm=heat)
        return r_d.get(), idx_d.get()

    plain = run(None)
    with l2_warm(L2Warm.parse(warm)):
        warmed = run(next_qkv)
    np.testing.assert_array_equal(warmed[1], plain[1])
    np.testing.assert_array_equal(warmed[0], plain[0])
    np.testing.assert_array_equal(next_qkv.get(), before)


def _half_on_host(cp, g, gate_up, down, counts, misses):
    """An expert cache's tables for a layer with about half its experts (at random) in pinned host memory
    and the rest in VRAM: the `LayerExperts`, which experts are on the host, and the arrays its addresses
    point into (VRAM first), which the caller keeps alive."""
    from strata_runtime.cuda.experts import LayerExperts, addresses
    from strata_runtime.experts.host import host_empty

    e = gate_up.shape[0]
    host_gu, host_dn = host_empty(gate_up.shape, np.float16, True), host_empty(down.shape, np.float16, True)
    host_gu[...], host_dn[...] = gate_up, down
    dev_gu, dev_dn = cp.asarray(gate_up), cp.asarray(down)
    on_host = g.random(e) < 0.5  # half the experts hold no slot
    slot_of = np.where(on_host, -1, np.arange(e)).astype(np.int32)
    gu_addr = np.where(on_host, addresses(host_gu), addresses(dev_gu)).astype(np.uint64)
    dn_addr = np.where(on_host, addresses(host_dn), addresses(dev_dn)).astype(np.uint64)
    experts = LayerExperts(
        cp.asarray(gu_addr), cp.asarray(dn_addr), lambda i: (gate_up[i], down[i]),
        cp.asarray(slot_of), counts, misses,
    )  # fmt: skip
    return experts, on_host, (dev_gu, dev_dn, host_gu, host_dn)


@pytest.mark.parametrize(
    ("rows", "e", "k", "h", "inter"), [(3, 128, 8, 2048, 768), (8, 16, 8, 256, 256), (5, 16, 4, 96, 48)]
)
def test_moe_reads_experts_from_mapped_host_memory_bit_for_bit_and_counts_the_misses(
    gpu, rows, e, k, h, inter
):
    """The expert cache's miss path: the same kernel, its address tables pointing at pinned host memory for
    some experts, gives exactly the result of reading them all from VRAM, and counts routing and misses."""
    from strata_runtime.cuda.experts import resident_experts

    cp, kern, _ = gpu
    g = rng()
    x, nw, logits, gate_up, down, resid = _moe_inputs(g, rows, e, h, inter)
    counts, misses = cp.zeros(e, cp.float32), cp.zeros(1, cp.float32)
    cached, on_host, arrays = _half_on_host(cp, g, gate_up, down, counts, misses)
    dev_gu, dev_dn = arrays[:2]
    outs = []
    for experts in (resident_experts(dev_gu, dev_dn, cp), cached):
        r_d, idx_d = cp.asarray(resid), cp.full((rows, k), -1, cp.int32)
        w_d, h_d = cp.full((rows, k), cp.nan, cp.float32), cp.full((rows * k, inter), cp.nan, cp.float32)
        kern.moe(cp.asarray(x), cp.asarray(nw), cp.asarray(logits), True, 1e-6, experts, r_d, idx_d, w_d, h_d)
        outs.append((r_d.get(), idx_d.get()))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])  # the same bytes, the same sums
    idx = outs[1][1]
    np.testing.assert_array_equal(counts.get(), np.bincount(idx.reshape(-1), minlength=e))
    assert int(misses.get()[0]) == int(on_host[idx].sum()) > 0


def test_small_elementwise_kernels_match_the_reference(gpu):
    from strata_runtime.cuda.ops import argmax_scratch

    cp, kern, ref = gpu
    g = rng()
    rows, inter, h, v = 6, 96, 80, 5000
    gu = g.standard_normal((rows, 2 * inter)).astype(np.float32)
    out_d = cp.full((rows, inter), cp.nan, cp.float32)
    kern.silu_mul(cp.asarray(gu), out_d)
    out = np.empty((rows, inter), np.float32)
    ref.silu_mul(gu, out)
    assert rel_err(out_d.get(), out) < REL

    resid, y, gate = (
        g.standard_normal((rows, h)).astype(np.float32),
        g.standard_normal((rows, h)).astype(np.float32),
        g.standard_normal(rows).astype(np.float32),
    )
    for gt in (None, gate):
        r_d = cp.asarray(resid)
        kern.add_scaled(r_d, cp.asarray(y), cp.asarray(gt) if gt is not None else None)
        want = resid.copy()
        ref.add_scaled(want, y, gt)
        assert rel_err(r_d.get(), want) < REL

    table = half(g.standard_normal((v, h)))
    ids = g.integers(0, v, rows).astype(np.int32)
    emb_d = cp.full((rows, h), cp.nan, cp.float32)
    kern.embed(cp.asarray(table), cp.asarray(ids), emb_d)
    emb = np.empty((rows, h), np.float32)
    ref.embed(table, ids, emb)
    np.testing.assert_array_equal(emb_d.get(), emb)

    logits = g.standard_normal((rows, v)).astype(np.float32)
    am_d = cp.full(rows, -1, cp.int32)
    kern.argmax(cp.asarray(logits), am_d, argmax_scratch(cp, *logits.shape))
    am = np.empty(rows, np.int32)
    ref.argmax(logits, am)
    np.testing.assert_array_equal(am_d.get(), am)


@pytest.mark.parametrize("v", [151_936, 2_049, 40_000, 7])
def test_argmax_over_slices_matches_numpy(gpu, v):
    """A row is cut into slices searched in parallel: the maximum must win wherever it lies, an equal
    maximum in a later slice must lose to the first (ties to the lower index), and rows of -inf or with
    NaNs must give what the one-block kernel gave (the first -inf; NaNs never win over a number, -inf
    included). A row of NaNs alone still gets an index of its own, its first: a token the next window's
    embedding can read (no candidate winning gave 2^31 - 1, which read far outside the table)."""
    from strata_runtime.cuda.choices import argmax_slices
    from strata_runtime.cuda.ops import argmax_scratch

    cp, kern, ref = gpu
    g = rng()
    rows = 8
    logits = g.standard_normal((rows, v)).astype(np.float32)
    nb = argmax_slices(v)
    per = -(-v // nb)
    top = float(logits.max()) + 1.0
    logits[0, v - 1] = top  # the last value of the last slice
    logits[1, [v // 3, v - 1]] = top  # a tie across slices: the lower index wins
    logits[2, [min(per, v - 1), 0]] = top  # a tie between the first value and the next slice's first
    logits[3, :] = -np.inf
    logits[4, ::2] = np.nan
    logits[4, 1] = top
    logits[6, :] = np.nan
    logits[7, :] = np.nan
    logits[7, v // 2] = -np.inf  # -inf wins over a NaN
    am_d = cp.full(rows, -1, cp.int32)
    kern.argmax(cp.asarray(logits), am_d, argmax_scratch(cp, *logits.shape))
    np.testing.assert_array_equal(am_d.get(), [argmax_below_nan(row) for row in logits])


def argmax_below_nan(row: np.ndarray) -> int:
    """The argmax kernels' rule: the first largest number, a NaN ranking below every number (-inf too); the
    first index where the row holds only NaNs."""
    numbers = ~np.isnan(row)
    if not numbers.any():
        return 0
    return int(np.flatnonzero(numbers & (row == row[numbers].max()))[0])


@pytest.mark.parametrize(
    ("n_q", "n_kv", "d", "hidden"),
    [
        (32, 4, 128, 2048),
        (16, 2, 64, 1024),
        (8, 2, 32, 256),
        (16, 4, 16, 512),
        (8, 2, 256, 2048),
        (128, 8, 32, 2048),
    ],
)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_qkv_with_rope_fused_matches_the_projection_then_qk_norm_rope_kv(gpu, n_q, n_kv, d, hidden, rows):
    """`Kernels.qkv_rope` fuses the q/k norm, RoPE and the KV write into the tensor-core projection's end:
    what it writes (qkv, q, the cache) must be what the projection and ``qk_norm_rope_kv`` write one after
    the other, and the NumPy twin's. The shapes take 2, 4 and 16 blocks per head, one, and two heads per
    block; rows share a slot at neighbouring positions, as a drafted window's do. Its counters are back at
    zero after each launch, so a second launch gives the same."""
    from strata_runtime.cuda.choices import qkv_rope_launch

    cp, kern, ref = gpu
    assert qkv_rope_launch(rows, (n_q + 2 * n_kv) * d, hidden, d, kern.tensor_cores) is not None
    g = rng()
    slots, t = 3, 300
    slot = (np.arange(rows) // 2 % slots).astype(np.int32)  # pairs of rows in one slot
    pos = (17 * (np.arange(rows) // 2) + np.arange(rows) % 2 + 5).astype(np.int32)  # pairs at p, p + 1
    w = half(g.standard_normal(((n_q + 2 * n_kv) * d, hidden)) * 0.05)
    x = (g.standard_normal((rows, hidden)) * 2).astype(np.float32)
    ln1 = half(1 + 0.1 * g.standard_normal(hidden))
    qn, kn = half(1 + 0.1 * g.standard_normal(d)), half(1 + 0.1 * g.standard_normal(d))
    kc, vc = half(g.standard_normal((slots, n_kv, t, d))), half(g.standard_normal((slots, n_kv, t, d)))
    theta, eps = 1e6, 1e-6

    def run(fused: bool) -> tuple[np.ndarray, ...]:
        qkv = cp.full((rows, (n_q + 2 * n_kv) * d), cp.nan, cp.float32)
        q = cp.full((rows, n_q, d), cp.nan, cp.float32)
        kc_d, vc_d = cp.asarray(kc), cp.asarray(vc)
        dev = [cp.asarray(a) for a in (w, x, ln1, qn, kn, pos, slot)]
        if fused:
            kern.qkv_rope(dev[0], dev[1], qkv, dev[2], eps, *dev[3:], q, kc_d, vc_d, theta, done)
        else:
            kern.gemv(dev[0], dev[1], qkv, norm=dev[2], eps=eps)
            kern.qk_norm_rope_kv(qkv, *dev[3:], q, kc_d, vc_d, theta, eps)
        return qkv.get(), q.get(), kc_d.get()[slot, :, pos], vc_d.get()[slot, :, pos]  # the rows' writes

    done = cp.zeros(n_q + 2 * n_kv, cp.int32)
    fused = run(True)
    assert not done.any()
    again, apart = run(True), run(False)
    for a, b in zip(fused, again, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(fused[0], apart[0])  # the projection's sums are the same kernel's
    assert rel_err(fused[1], apart[1]) < 1e-6  # q: the same functions, at worst contracted otherwise
    for a, b in zip(fused[2:], apart[2:], strict=True):  # k and v in fp16: at most one step of rounding apart
        assert (np.abs(a.astype(np.float32) - b.astype(np.float32)) <= np.spacing(np.abs(b))).all()
    qkv_r, q_r = np.empty_like(fused[0]), np.empty_like(fused[1])
    kc_r, vc_r = kc.copy(), vc.copy()
    ref.qkv_rope(w, x, qkv_r, ln1, eps, qn, kn, pos, slot, q_r, kc_r, vc_r, theta)
    assert rel_err(fused[0], qkv_r) < REL
    assert rel_err(fused[1], q_r) < 1e-3  # sincos of large angles in fp32
    assert rel_err(fused[2], kc_r[slot, :, pos]) < 1e-3
    assert rel_err(fused[3], vc_r[slot, :, pos]) < 1e-3


def launch_gemv(cp, kern, expr, grid, w, x, out, norm):
    """One explicit instantiation of a GEMV kernel on grid (blocks, threads), writing out [R, N]."""
    out[...] = cp.nan
    from strata_runtime.cuda.ops import NO_ROPE

    args = (w, x, out, np.int32(w.shape[0]), np.int32(0), norm if norm is not None else np.uint64(0))
    rope = NO_ROPE if expr.startswith("gemv_mma<") else ()
    kern.fn(expr)((grid[0],), (grid[1],), (*args, np.float32(1e-6), *rope))


@pytest.mark.parametrize(("n", "k"), [(3000, 2048), (700, 4096), (128, 2048), (255, 4096)])
def test_gemv_rows_are_batch_invariant(gpu, n, k):
    """A row's result must not depend on which rows share its window (greedy text equality across modes):
    for the kernel `Kernels.gemv` takes for the shape, for two block shapes of the tensor-core kernel, and
    for the CUDA-core kernel with each number of output features a warp takes (`gemv_rows_per_warp`), and for
    a short output's split reduction with each number of features a block takes (`SPLIT_FEATURES`)."""
    cp, kern, _ = gpu
    g = rng()
    w = cp.asarray(half(g.standard_normal((n, k)) * 0.05))
    x = cp.asarray(g.standard_normal((8, k)).astype(np.float32))
    nw = cp.asarray(half(1 + 0.1 * g.standard_normal(k)))
    counts = (1, 2, 3, 5, 8)
    for norm in (None, nw):
        flag = "false" if norm is None else "true"
        variants = [
            (f"gemv_wide<{{r}},{k},{per},{flag}>", (ceil(ceil(n / per) / 8), 256)) for per in (1, 2, 4)
        ]
        variants += [
            (f"gemv_mma<{{r}},{k},{mt},{warps},{flag}>", (ceil(n / (16 * mt)), 32 * warps))
            for mt, warps in ((1, 16), (4, 8))
        ]
        if n <= 256:
            variants += [(f"gemv_split<{{r}},{k},{f},{flag}>", (ceil(n / f), 256)) for f in (1, 2, 4)]
        kern.prepare([e.format(r=r) for e, _ in variants for r in counts])
        full = cp.empty((8, n), cp.float32)
        kern.gemv(w, x, full, norm=norm)
        for rows in counts:
            part = cp.empty((rows, n), cp.float32)
            kern.gemv(w, x[:rows].copy(), part, norm=norm)
            np.testing.assert_array_equal(part.get(), full[:rows].get())
        for expr, grid in variants:
            whole = cp.empty((8, n), cp.float32)
            launch_gemv(cp, kern, expr.format(r=8), grid, w, x, whole, norm)
            np.testing.assert_allclose(whole.get(), full.get(), rtol=1e-4, atol=1e-4)
            for rows in counts:
                part = cp.empty((rows, n), cp.float32)
                launch_gemv(cp, kern, expr.format(r=rows), grid, w, x[:rows].copy(), part, norm)
                np.testing.assert_array_equal(part.get(), whole[:rows].get())


@pytest.mark.parametrize(
    ("n", "k", "with_norm"),
    [(300, 2048, True), (600, 4096, False), (40000, 2048, True), (128, 2048, True), (200, 4096, False)],
)
def test_gemv_keeps_fp32_precision_at_every_scale(gpu, n, k, with_norm):
    """The tensor-core GEMV splits each scaled row into fp16 hi + lo parts: rows from 1e-6 to 1e8 keep a
    float32-sized error (fp16 rows alone would be near 1e-4, and 1e8 would overflow). So does a router-sized
    output, whose split reduction sums the squares of rows up to 1e8 in fp32."""
    cp, kern, _ = gpu
    g = rng()
    w = half(g.standard_normal((n, k)) * 0.05)
    scales = np.array([1e-6, 1e-3, 1, 3, 300, 3e4, 1e6, 1e8], np.float32)
    x = g.standard_normal((8, k)).astype(np.float32) * scales[:, None]
    nw = half(1 + 0.1 * g.standard_normal(k)) if with_norm else None
    xn = x.astype(np.float64)
    if nw is not None:
        xn = xn * nw.astype(np.float64) / np.sqrt((xn**2).mean(1, keepdims=True) + 1e-6)
    want = xn @ w.astype(np.float64).T
    out = cp.full((8, n), cp.nan, cp.float32)
    kern.gemv(cp.asarray(w), cp.asarray(x), out, norm=cp.asarray(nw) if nw is not None else None)
    err = np.linalg.norm(out.get() - want, axis=1) / np.linalg.norm(want, axis=1)
    assert err.max() < 4e-6, err


# ---- the prefill path's kernels -------------------------------------------------------------------------

HALF_REL = 2e-3  # fp16 outputs: one rounding of each element


@pytest.mark.parametrize(("rows", "h"), [(1, 64), (70, 2048), (129, 200)])
def test_rms_norm_fp32_to_half_matches_twin(gpu, rows, h):
    cp, kern, ref = gpu
    g = rng()
    x = (g.standard_normal((rows, h)) * 3).astype(np.float32)
    w = half(1 + 0.1 * g.standard_normal(h))
    out_d = cp.full((rows, h), cp.nan, cp.float16)
    kern.rms_norm_fp32_to_half(cp.asarray(x), cp.asarray(w), out_d, 1e-6)
    out = np.empty((rows, h), np.float16)
    ref.rms_norm_fp32_to_half(x, w, out, 1e-6)
    assert rel_err(out_d.get(), out) < HALF_REL


@pytest.mark.parametrize(
    ("n_q", "n_kv", "d"), [(32, 4, 128), (4, 2, 16), (8, 2, 32), (2, 1, 256), (6, 2, 80)]
)
def test_qk_norm_rope_split_matches_the_reference(gpu, n_q, n_kv, d):
    """The prefill form: k and v into the cache as `qk_norm_rope_kv` writes them, q as fp16 hi + lo parts
    that together keep q's fp32 precision (positions are small here, so fp32 sincos is exact enough to
    tell hi + lo from hi alone)."""
    cp, kern, ref = gpu
    g = rng()
    slots, t, rows = 4, 64, 37
    pos = (np.arange(rows) * 7 % t).astype(np.int32)
    slot = (np.arange(rows) * 7 // t).astype(np.int32)  # distinct (slot, pos) per row
    qkv = (3 * g.standard_normal((rows, (n_q + 2 * n_kv) * d))).astype(np.float32)
    qn, kn = half(1 + 0.1 * g.standard_normal(d)), half(1 + 0.1 * g.standard_normal(d))
    kc, vc = half(g.standard_normal((slots, n_kv, t, d))), half(g.standard_normal((slots, n_kv, t, d)))
    kc_d, vc_d = cp.asarray(kc), cp.asarray(vc)
    hi_d, lo_d = (cp.full((rows, n_q, d), cp.nan, cp.float16) for _ in range(2))
    args = (cp.asarray(qkv), cp.asarray(qn), cp.asarray(kn), cp.asarray(pos), cp.asarray(slot))
    kern.qk_norm_rope_split(*args, hi_d, lo_d, kc_d, vc_d, 1e6, 1e-6)
    q = np.empty((rows, n_q, d), np.float32)
    ref.qk_norm_rope_kv(qkv, qn, kn, pos, slot, q, kc, vc, 1e6, 1e-6)
    hi, lo = hi_d.get().astype(np.float64), lo_d.get().astype(np.float64)
    assert rel_err(hi, q) < 1e-3  # sincos and powf of the fast-math build
    assert rel_err(kc_d.get(), kc) < 1e-3
    np.testing.assert_array_equal(vc_d.get(), vc)
    # hi + lo is q in fp32: against the decode kernel's fp32 q (the same rotation, its norm summed in another
    # order) it is off by rounding, where hi alone is off by about 2^-12.
    q_d = cp.full((rows, n_q, d), cp.nan, cp.float32)
    kern.qk_norm_rope_kv(*args, q_d, cp.asarray(kc), cp.asarray(vc), 1e6, 1e-6)
    assert rel_err(hi + lo, q_d.get()) < 2e-6


@pytest.mark.parametrize(("rows", "e", "k"), [(1, 8, 2), (100, 128, 8), (33, 60, 4), (9, 256, 8)])
@pytest.mark.parametrize("norm_topk", [False, True])
def test_route_topk_matches_twin(gpu, rows, e, k, norm_topk):
    cp, kern, ref = gpu
    g = rng()
    logits = g.standard_normal((rows, e)).astype(np.float32)
    logits[0, 1] = logits[0, 0]  # a tie: the lower index ranks first
    idx_d, w_d = cp.full((rows, k), -1, cp.int32), cp.full((rows, k), cp.nan, cp.float32)
    kern.route_topk(cp.asarray(logits), norm_topk, idx_d, w_d)
    idx, w = np.empty((rows, k), np.int32), np.empty((rows, k), np.float32)
    ref.route_topk(logits, norm_topk, idx, w)
    np.testing.assert_array_equal(idx_d.get(), idx)
    assert rel_err(w_d.get(), w) < REL


def test_route_topk_counts_each_assignment_by_the_tier_that_serves_it(gpu):
    """Under an expert cache, a prompt chunk's routing counts each assignment into the cache's counters (per
    expert, and the misses: not in VRAM, of which in a helper slot), as the twin counts them; without
    counters it routes alike."""
    from types import SimpleNamespace

    cp, kern, ref = gpu
    g = rng()
    rows, e, k = 300, 128, 8
    logits = g.standard_normal((rows, e)).astype(np.float32)
    slot_of = g.integers(-4, 40, e).astype(np.int32)  # VRAM slots, host memory (-1), helper slots (< -1)
    start_counts = g.integers(1, 5, e).astype(np.float32)  # counts of windows before, still unread
    start_misses = np.array([9.0, 4.0], np.float32)

    def tables(xp):
        return SimpleNamespace(
            slot_of=xp.array(slot_of), counts=xp.array(start_counts), misses=xp.array(start_misses)
        )

    on_device, on_host = tables(cp), tables(np)
    idx_d, w_d = cp.empty((rows, k), cp.int32), cp.empty((rows, k), cp.float32)
    kern.route_topk(cp.asarray(logits), True, idx_d, w_d, on_device)
    idx, w = np.empty((rows, k), np.int32), np.empty((rows, k), np.float32)
    ref.route_topk(logits, True, idx, w, on_host)
    np.testing.assert_array_equal(on_device.counts.get(), on_host.counts)
    np.testing.assert_array_equal(on_device.misses.get(), on_host.misses)
    chosen = slot_of[idx.reshape(-1)]
    want = start_misses + [np.count_nonzero(chosen < 0), np.count_nonzero(chosen < -1)]
    np.testing.assert_array_equal(on_host.misses, want)
    assert on_host.counts.sum() == start_counts.sum() + rows * k
    uncounted = SimpleNamespace(counts=None)
    kern.route_topk(cp.asarray(logits), True, idx_d, w_d, uncounted)
    np.testing.assert_array_equal(idx_d.get(), idx)


@pytest.mark.parametrize(
    ("heads", "n", "pos", "group"), [(4, 1, 0, 1), (4, 70, 0, 8), (8, 65, 300, 4), (3, 130, 1000, 1)]
)
def test_softmax_causal_matches_twin(gpu, heads, n, pos, group):
    cp, kern, ref = gpu
    from strata_runtime.cuda.choices import padded_keys

    g = rng()
    rows, length = n * group, pos + n
    ld = padded_keys(length)
    scores = (g.standard_normal((heads, rows, length)) * 4).astype(np.float32)
    s_d = cp.full((heads, rows, ld), cp.nan, cp.float32)[:, :, :length]  # rows padded, as the prefill path
    s_d[...] = cp.asarray(scores)
    p_d = cp.full((heads, rows, ld), cp.nan, cp.float16)[:, :, :length]
    kern.softmax_causal(s_d, p_d, pos, group)
    want = np.full(scores.shape, np.nan, np.float16)
    ref.softmax_causal(scores, want, pos, group)
    got = p_d.get()
    assert rel_err(got, want) < HALF_REL
    for r in (0, rows - 1):  # nothing past the row's own position; each row sums to one
        assert not got[:, r, pos + r // group + 1 :].any()
        np.testing.assert_allclose(got[:, r].astype(np.float32).sum(-1), 1.0, rtol=1e-2)


@pytest.mark.parametrize(("rows", "e", "k"), [(1, 8, 2), (2048, 128, 8), (333, 256, 8)])
def test_moe_group_gives_every_assignment_a_distinct_place(gpu, rows, e, k):
    cp, kern, ref = gpu
    g = rng()
    idx = np.stack([g.choice(e, k, replace=False) for _ in range(rows)]).astype(np.int32)  # [R, k]
    rank_d, most_d = cp.full((rows, k), -1, cp.int32), cp.full(1, -1, cp.int32)
    kern.moe_group(cp.asarray(idx), e, rank_d, most_d)
    rank, most = np.empty((rows, k), np.int32), np.empty(1, np.int32)
    ref.moe_group(idx, e, rank, most)
    assert int(most_d.get()[0]) == int(most[0])
    got = rank_d.get()
    for ex in np.unique(idx):  # the places of one expert's assignments are exactly 0..count-1
        np.testing.assert_array_equal(np.sort(got[idx == ex]), np.arange((idx == ex).sum()))


def test_expert_grouping_kernels_match_the_reference(gpu):
    cp, kern, ref = gpu
    g = rng()
    rows, k, e, h, inter = 37, 4, 16, 96, 48
    idx = np.stack([g.choice(e, k, replace=False) for _ in range(rows)]).astype(np.int32)  # [R, k]
    counts = np.bincount(idx.ravel(), minlength=e)
    c = int(counts.max())
    rank = np.empty(rows * k, np.int32)
    seen = np.zeros(e, np.int32)
    for a, ex in enumerate(idx.ravel()):
        rank[a], seen[ex] = seen[ex], seen[ex] + 1
    rank = rank.reshape(rows, k)
    x = half(g.standard_normal((rows, h)))
    xs_d = cp.zeros((e, c, h), cp.float16)
    kern.moe_scatter_rows(cp.asarray(x), cp.asarray(idx), cp.asarray(rank), xs_d)
    xs = np.zeros((e, c, h), np.float16)
    ref.moe_scatter_rows(x, idx, rank, xs)
    np.testing.assert_array_equal(xs_d.get(), xs)

    gu = half(g.standard_normal((e * c, 2 * inter)))
    hid_d = cp.full((e * c, inter), cp.nan, cp.float16)
    kern.silu_mul_half(cp.asarray(gu), hid_d)
    hid = np.empty((e * c, inter), np.float16)
    ref.silu_mul_half(gu, hid)
    assert rel_err(hid_d.get(), hid) < HALF_REL

    ys = half(g.standard_normal((e, c, h)))
    wts = g.random((rows, k)).astype(np.float32)
    resid = g.standard_normal((rows, h)).astype(np.float32)
    r_d = cp.asarray(resid)
    kern.moe_gather_add(cp.asarray(ys), cp.asarray(idx), cp.asarray(rank), cp.asarray(wts), r_d)
    ref.moe_gather_add(ys, idx, rank, wts, resid)
    assert rel_err(r_d.get(), resid) < REL


@pytest.mark.parametrize("out_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_batched_products_match_numpy(gpu, out_dtype, beta):
    """`blas.matmul_nt`/`matmul_nn` on strided views (a slot's keys in a cache, a slice of query rows)."""
    cp, _, _ = gpu
    from strata_runtime.cuda.blas import matmul_nn, matmul_nt

    g = rng()
    cache = half(g.standard_normal((3, 4, 50, 32)))  # [S, K, T, D]
    q = half(g.standard_normal((4, 24, 32)))  # [K, rows, D]
    keys, qv = cache[1, :, :37], q[:, 5:20]  # strided batch and row views
    base = g.standard_normal((4, 15, 37)).astype(out_dtype)
    c_d = cp.asarray(base)
    matmul_nt(cp.asarray(q)[:, 5:20], cp.asarray(cache)[1, :, :37], c_d, alpha=0.5, beta=beta)
    expected = 0.5 * np.einsum("bmk,bnk->bmn", qv.astype(np.float64), keys.astype(np.float64)) + beta * base
    assert rel_err(c_d.get(), expected) < (HALF_REL if out_dtype == np.float16 else REL)

    p = half(g.random((4, 15, 37)))
    o_d = cp.asarray(np.zeros((4, 15, 32), out_dtype))
    matmul_nn(cp.asarray(p), cp.asarray(cache)[1, :, :37], o_d)
    expected = np.einsum("bml,bld->bmd", p.astype(np.float64), keys.astype(np.float64))
    assert rel_err(o_d.get(), expected) < (HALF_REL if out_dtype == np.float16 else REL)

    x, w = half(g.standard_normal((70, 96))), half(g.standard_normal((40, 96)))
    y_d = cp.zeros((70, 40), out_dtype)
    matmul_nt(cp.asarray(x), cp.asarray(w), y_d)
    assert rel_err(y_d.get(), x.astype(np.float64) @ w.astype(np.float64).T) < HALF_REL
    with pytest.raises(ValueError, match="do not agree"):
        matmul_nt(cp.asarray(x), cp.asarray(w[:, :50]), y_d)


def test_fp32_products_match_numpy_and_mixed_types_are_refused(gpu):
    """The prefill path's router product is fp32 throughout (`blas.matmul_nt` on fp32 rows and weights),
    as close to float64 as fp32 sums get; fp32 rows against an fp16 weight are refused, not widened."""
    cp, _, _ = gpu
    from strata_runtime.cuda.blas import matmul_nt

    g = rng()
    x, w = g.standard_normal((37, 256)).astype(np.float32), g.standard_normal((128, 256)).astype(np.float32)
    y = cp.full((37, 128), cp.nan, cp.float32)
    matmul_nt(cp.asarray(x), cp.asarray(w), y)
    assert rel_err(y.get(), x.astype(np.float64) @ w.astype(np.float64).T) < 1e-6
    with pytest.raises(TypeError, match="all fp32"):
        matmul_nt(cp.asarray(x), cp.asarray(half(w)), y)


def peaked_logits(g: np.random.Generator, rows: int, v: int) -> np.ndarray:
    """Logits shaped like a trained model's: a broad body and, per row, 1 to 40 tokens 4 to 20 logits above
    it, so top-p keeps few tokens."""
    logits = g.standard_normal((rows, v)) * 2
    for r in range(rows):
        hot = g.choice(v, int(g.integers(1, min(41, v))), replace=False)
        logits[r, hot] += g.uniform(4, 20, hot.size)
    return logits.astype(np.float32)


@pytest.mark.parametrize("v", [151_936, 5_000])
def test_choose_gathering_keeps_the_token(gpu, v):
    """A row whose top-k or top-p is known to keep few tokens has a superset of them gathered into shared
    memory before its cuts and draw: the token must be the one the whole-row path draws, bit for bit, with
    ties at the k-th logit and at the top-p cut, a u of 0 and just under 1, top-k that leaves more than the
    gather holds, min-p on half the rows, and logits flat (top-p keeps thousands) and peaked (top-p keeps a
    few). The split form
    (the passes before the gather over slices of the row in parallel) draws the same token as one block."""
    from strata_runtime.cuda.choices import CHOOSE_GATHER

    cp, kern, _ = gpu
    g = rng()
    rows = 64
    gathered_rows = 0
    for trial in range(8):
        if trial < 4:
            logits = (g.standard_normal((rows, v)) * 3).astype(np.float32)
        else:
            logits = peaked_logits(g, rows, v)
        if trial % 2:
            logits = np.round(logits * 2) / 2  # coarse logits: many ties at every cut
        inv_temp = g.uniform(0.3, 2.0, rows).astype(np.float32)
        top_k = g.choice([1, 2, 20, 50, 200, CHOOSE_GATHER - 1, CHOOSE_GATHER + 500], rows).astype(np.int32)
        top_p = np.where(g.random(rows) < 0.3, 1.0, g.uniform(0.05, 0.99, rows)).astype(np.float32)
        top_p[2:4] = 1e-30  # the top token alone stays
        u = g.random(rows).astype(np.float32)
        u[:2] = [0.0, np.float32(1.0) - np.float32(2**-24)]
        min_p = np.where(g.random(rows) < 0.5, -np.inf, np.log(g.uniform(0.01, 0.5, rows))).astype(np.float32)
        gathered_rows += int(((top_k < v) & (top_k < CHOOSE_GATHER)).sum())
        args = [cp.asarray(a) for a in (logits, inv_temp, u, top_k, top_p)]
        outs = []
        for gather, split in ((True, True), (True, False), (False, False)):
            out_d = cp.full(rows, -1, cp.int64)
            kern.choose(*args, out_d, gather=gather, split=split, log_min_p=cp.asarray(min_p))
            outs.append(out_d.get())
        np.testing.assert_array_equal(outs[0], outs[1], err_msg="split against one block")
        np.testing.assert_array_equal(outs[1], outs[2], err_msg="gathered against the whole row")
        assert (outs[0] >= 0).all() and (outs[0] < v).all()
        top = np.flatnonzero(logits[2] == logits[2].max())  # ties at the max: top-k may cut to one of them
        assert outs[0][2] in top and outs[0][3] in np.flatnonzero(logits[3] == logits[3].max())
    assert gathered_rows > 100


def test_split_choice_gathers_where_a_cut_fits(gpu):
    """The split form's first steps (``_split_prep``) gather a row's candidates wherever one block would:
    peaked rows under top-k 20, or top-p 0.8 alone, gather at least the tokens that stay and no more than
    fit; a row with temperature alone, or a top-k beyond the gather's room, gathers nothing (the merge
    then reads the whole row). Its max and argmax are the row's."""
    from strata_runtime.cuda.choices import CHOOSE_GATHER, CHOOSE_PREP_BYTES

    cp, kern, ref = gpu
    g = rng()
    rows, v = 6, 151_936
    logits = peaked_logits(g, rows, v)
    logits_d = cp.asarray(logits)
    cap = np.int32(CHOOSE_GATHER)

    def prep(t: float, k: int, p: float) -> np.ndarray:
        words = kern._split_prep(logits_d, None, t, None, k, None, p, None, -np.inf, cap).get()
        return words.view(np.uint8).reshape(rows, CHOOSE_PREP_BYTES)

    for t, k, p in ((1 / 0.7, 20, 0.8), (1 / 0.7, 0, 0.8)):
        raw = prep(t, k, p)
        mx = raw[:, 0:4].copy().view(np.float32)[:, 0]
        arg, n = raw[:, 4:8].copy().view(np.int32)[:, 0], raw[:, 8:12].copy().view(np.int32)[:, 0]
        np.testing.assert_array_equal(arg, logits.argmax(axis=1))
        np.testing.assert_array_equal(mx, logits.max(axis=1))
        weights = [ref.staying_weights(logits[r], float(np.float32(t)), k, p) for r in range(rows)]
        stay = [int((w > 0).sum()) for w in weights]
        assert ((n == -1) | ((n >= np.array(stay)) & (n <= CHOOSE_GATHER))).all(), (n, stay)
        assert (n >= 0).sum() >= rows // 2, n
        if k:  # top-k's rule in counts alone: the tightest cut mx - 2^(j - 1) with k tokens at or above it
            for r in range(rows):
                counts = [int((logits[r] >= mx[r] - np.float32(2.0 ** (j - 1))).sum()) for j in range(7)]
                fit = next((c for c in counts if c >= k), None)
                assert n[r] == (fit if fit is not None and fit <= CHOOSE_GATHER else -1), (r, counts, n[r])
    for t, k, p in ((1.0, 0, 1.0), (1.0, CHOOSE_GATHER + 1, 1.0), (0.0, 20, 0.8)):
        n = prep(t, k, p)[:, 8:12].copy().view(np.int32)[:, 0]
        assert (n == -1).all(), (t, k, p, n)


@pytest.mark.parametrize(("rows", "v"), [(1, 151936), (6, 5000), (3, 33)])
def test_choose_matches_twin(gpu, rows, v):
    """Argmax rows exactly; draws (with and without top-k, top-p and min-p, whose cut the twin computes as
    the kernel does, in float32) exactly but where u falls within float32
    rounding of a boundary between two staying tokens' cumulative weights (the kernel computes weights in
    float32, the twin in float64)."""
    cp, kern, ref = gpu

    g = rng()
    for trial in range(24):
        flat = trial % 3
        logits = (g.standard_normal((rows, v)) * 3).astype(np.float32) if flat else peaked_logits(g, rows, v)
        inv_temp = np.where(g.random(rows) < 0.3, 0.0, g.uniform(0.3, 2.0, rows))
        top_k = np.where(g.random(rows) < 0.5, 0, g.integers(1, min(v, 200), rows)).astype(np.int32)
        top_p = np.where(g.random(rows) < 0.5, 1.0, g.uniform(0.05, 0.99, rows)).astype(np.float32)
        lmp = np.where(g.random(rows) < 0.5, -np.inf, np.log(g.uniform(0.005, 0.6, rows))).astype(np.float32)
        if trial == 1:
            logits[:, : v // 3] = logits[:, :1]  # many ties at one logit
        if trial == 2:
            top_p[:] = 1e-30  # a share of the total that rounds to 0: the top token alone stays
        u = g.random(rows)
        if trial == 0:
            u[0] = 0.0  # the first token with weight
        out_d = cp.full(rows, -1, cp.int64)
        kern.choose(
            cp.asarray(logits),
            cp.asarray(inv_temp, cp.float32),
            cp.asarray(u, cp.float32),
            cp.asarray(top_k),
            cp.asarray(top_p),
            out_d,
            log_min_p=cp.asarray(lmp),
        )
        u32 = u.astype(np.float32)
        t32 = inv_temp.astype(np.float32)
        got, want = out_d.get(), ref.choose_tokens(logits, t32, u32, top_k, top_p, lmp)
        for r in range(rows):
            if got[r] == want[r]:
                continue
            assert inv_temp[r] > 0, f"argmax row {r} differs"
            w = ref.staying_weights(logits[r], float(t32[r]), int(top_k[r]), float(top_p[r]), float(lmp[r]))
            assert w[got[r]] > 0, f"row {r}: the kernel drew a token the cuts remove"
            cdf = np.cumsum(w)
            edge = cdf[min(got[r], want[r])]
            assert abs(edge - float(u32[r]) * cdf[-1]) < 1e-5 * cdf[-1], (r, got[r], want[r])


@pytest.mark.parametrize("v", [151_936, 5_000, 33])
def test_choose_gives_a_token_of_the_vocabulary_for_rows_holding_nan(gpu, v):
    """NaN logits (a model whose activations overflowed) never make a row choose outside the vocabulary:
    greedy rows take the argmax kernels' rule (a NaN below every number, the first index of a row of NaNs),
    and sampled rows, whose weights then hold no total to draw from, a staying token, or the argmax. Before,
    such a row chose -1 (sampled) or 2^31 - 1 (greedy), which the next chained window's embedding read far
    outside its table: an illegal address that ends every later launch in the process. Both the split and
    the one-block kernels, with and without the cuts."""
    cp, kern, _ = gpu
    g = rng()
    rows = 6
    logits = (g.standard_normal((rows, v)) * 3).astype(np.float32)
    logits[0, :] = np.nan  # every logit
    logits[1, v // 2] = np.nan  # one, among numbers
    logits[2, ::3] = np.nan
    logits[3, :] = np.nan
    logits[3, v - 1] = -np.inf
    logits[4, 1:] = np.nan
    logits[5, :] = np.nan
    logits[5, v // 3] = 2.0
    for inv_temp, top_k, top_p in (
        (0.0, 0, 1.0),
        (1.0, 0, 1.0),
        (0.7, 20, 0.8),
        (1.3, 0, 0.5),
        (1.0, 3, 1.0),
    ):
        for split in (True, False):
            out_d = cp.full(rows, -7, cp.int64)
            kern.choose(
                cp.asarray(logits),
                cp.full(rows, inv_temp, cp.float32),
                cp.asarray(g.random(rows), cp.float32),
                cp.full(rows, top_k, cp.int32),
                cp.full(rows, top_p, cp.float32),
                out_d,
                split=split,
            )
            got = out_d.get()
            assert ((got >= 0) & (got < v)).all(), (inv_temp, top_k, top_p, split, got)
            want = [argmax_below_nan(row) for row in logits]
            if inv_temp == 0:
                np.testing.assert_array_equal(got, want)
            else:  # the rows without a number, or with one alone: that one, or the first NaN
                assert got[0] == 0 and got[5] == v // 3, (inv_temp, top_k, top_p, split, got)


@pytest.mark.parametrize(("rows", "e", "k"), [(4, 8, 2), (4, 128, 8), (3, 60, 4)])
def test_routing_rows_holding_nan_choose_distinct_experts_as_the_twin_ranks_them(gpu, rows, e, k):
    """A router row holding NaN still routes to k distinct experts of the layer: a NaN ranks below every
    number, NaNs among themselves by index, as the twin's stable sort of the negated logits orders them.
    Before, a NaN counted no logit above it, so the NaNs shared rank 0 and some of the top k had no expert:
    ``moe_gate_up_any`` (small models, routing inside) then read the address table at an index its shared
    memory held from before, and jumped to whatever it found there."""
    from strata_runtime.cuda.experts import resident_experts

    cp, kern, ref = gpu
    g = rng()
    logits = g.standard_normal((rows, e)).astype(np.float32)
    logits[0, :] = np.nan
    logits[1, ::2] = np.nan
    logits[2, 1:] = np.nan
    idx_d, w_d = cp.full((rows, k), -1, cp.int32), cp.full((rows, k), cp.nan, cp.float32)
    kern.route_topk(cp.asarray(logits), True, idx_d, w_d)
    idx, w = np.empty((rows, k), np.int32), np.empty((rows, k), np.float32)
    ref.route_topk(logits, True, idx, w)
    np.testing.assert_array_equal(idx_d.get(), idx)
    h, inter = 64, 64  # small: the kernels that route inside
    x, nw, _, gate_up, down, resid = _moe_inputs(g, rows, e, h, inter)
    experts = resident_experts(cp.asarray(gate_up), cp.asarray(down), cp)
    idx_d = cp.full((rows, k), -1, cp.int32)
    h_d = cp.zeros((rows * k, inter), cp.float32)
    kern.moe(
        cp.asarray(x),
        cp.asarray(nw),
        cp.asarray(logits),
        True,
        1e-6,
        experts,
        cp.asarray(resid),
        idx_d,
        w_d,
        h_d,
    )
    cp.cuda.get_current_stream().synchronize()  # an address read off the table faults here
    np.testing.assert_array_equal(idx_d.get(), idx)


@pytest.mark.parametrize("v", [8, 151_936])
def test_signed_zeros_tie_at_the_cuts_as_the_twin_orders_them(gpu, v):
    """-0.0 and +0.0 are equal logits: at a top-k or top-p cut they tie and go by index, as the twin (and the
    host's rule) order them. The kernel's keys once put +0 above -0: top-k 2 then cut the -0 tokens it must
    keep, and a top-p cut inside the zeros kept the +0 ones before the -0 ones before them."""
    cp, kern, ref = gpu
    row = np.full(v, -20.0, np.float32)
    row[:8] = [1.0, -0.0, 0.0, -0.0, 0.0, -3.0, -4.0, -5.0]
    logits = np.repeat(row[None, :], 2, axis=0)
    w = np.exp(row.astype(np.float64) - 1.0)
    inside = float(np.float32((w[0] + 1.5 * w[1]) / w.sum()))  # the cut falls among the four zeros
    for top_k, top_p, kept in ((2, 1.0, [0, 1, 2, 3, 4]), (0, inside, [0, 1, 2]), (3, inside, [0, 1, 2])):
        want = np.empty(logits.shape)
        ref.distribution(logits, 1.0, top_k, top_p, want)
        assert np.flatnonzero(want[0]).tolist() == kept, (top_k, top_p)
        for split in (True, False):
            got = cp.full(logits.shape, np.nan, cp.float64)
            kern.distribution(cp.asarray(logits), 1.0, top_k, top_p, got, split=split)
            assert np.flatnonzero(got.get()[0]).tolist() == kept, (top_k, top_p, split)


DISTRIBUTION_CASES = [  # (temperature, top_k, top_p, min_p): Qwen3's sampling, each cut alone, none
    (0.7, 20, 0.8, 0.0),
    (1.0, 0, 0.95, 0.0),
    (0.6, 0, 0.5, 0.0),
    (1.3, 300, 1.0, 0.0),
    (0.5, 0, 1.0, 0.0),
    (1.0, 1, 0.5, 0.0),
    (2.0, -1, 0.05, 0.0),  # top_k -1: V - 1
    (0.8, 50, 0.999, 0.0),
    (1.0, 0, 1.0, 0.05),  # min-p alone, and with top-p and top-k
    (0.7, 0, 0.9, 0.1),
    (1.5, 40, 1.0, 0.02),
]


def _mass_before(ref, row: np.ndarray, inv_temp: float, top_k: int, lmp: float) -> np.ndarray:
    """For each token of a row of logits, the share of the weight top-k and min-p keep that lies before it in
    the top-p cut's order (descending logit, then ascending index)."""
    w = ref.staying_weights(row, inv_temp, top_k, 1.0, lmp)
    order = np.lexsort((np.arange(row.size), -row.astype(np.float64)))
    before = np.empty_like(w)
    before[order] = np.cumsum(w[order]) - w[order]
    return before / w.sum()


@pytest.mark.parametrize("v", [151_936, 5_000, 37])
def test_distribution_is_the_one_choose_draws_from(gpu, v):
    """``distribution_rows`` against its twin on flat, coarse (ties at every cut) and peaked logits, over
    temperature, top-k, top-p and min-p together and alone: the same tokens stay, but where the mass before a
    token is within float32 rounding of top-p (the kernel's cut sums float32 weights); the probabilities
    agree to float32 rounding (the kernel's weights) and sum to 1; every element is written; the gathered
    path and the split form give the whole row's bits; and draws at the same uniforms from it and by
    ``choose_rows`` give the same tokens."""
    cp, kern, ref = gpu
    g = rng()
    rows, edges, cut_rows = 4, 0, 0
    for trial in range(9):
        kind = ("flat", "coarse", "peaked")[trial % 3]
        logits = peaked_logits(g, rows, v) if kind == "peaked" else (g.standard_normal((rows, v)) * 3)
        if kind == "coarse":
            logits = np.round(logits * 2) / 2
        logits = np.asarray(logits, np.float32)
        logits_d = cp.asarray(logits)
        for temperature, top_k, top_p, min_p in DISTRIBUTION_CASES:
            k, inv_temp = v - 1 if top_k < 0 else top_k, float(np.float32(1 / temperature))
            lmp = log_min_p(min_p)
            outs = []
            for gather, split in ((True, True), (True, False), (False, False)):
                out_d = cp.full((rows, v), np.nan, cp.float64)
                kern.distribution(
                    logits_d, inv_temp, k, top_p, out_d, gather=gather, split=split, log_min_p=lmp
                )
                outs.append(out_d.get())
            got = outs[0]
            assert np.array_equal(outs[1], got), "the split form differs from one block's"
            assert np.array_equal(outs[2], got), "the gathered path differs from the whole row's"
            want = np.empty((rows, v))
            ref.distribution(logits, inv_temp, k, top_p, want, log_min_p=lmp)
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=0, atol=1e-12)
            for r in range(rows):
                differ = np.flatnonzero((got[r] > 0) != (want[r] > 0))
                if differ.size:
                    gap = np.abs(_mass_before(ref, logits[r], inv_temp, k, lmp)[differ] - np.float32(top_p))
                    assert top_p < 1 and gap.max() < 1e-5, (kind, temperature, k, top_p, r, differ[:5])
                    edges += 1
                    continue
                cut_rows += int((want[r] == 0).any())
                np.testing.assert_allclose(got[r], want[r], rtol=2e-5, atol=1e-12)
            u = g.random(rows).astype(np.float32)
            chosen = cp.full(rows, -1, cp.int64)
            t_d, k_d, p_d = (cp.full(rows, x, dt) for x, dt in ((inv_temp, "f4"), (k, "i4"), (top_p, "f4")))
            kern.choose(logits_d, t_d, cp.asarray(u), k_d, p_d, chosen, log_min_p=cp.full(rows, lmp, "f4"))
            drawn = [int(np.searchsorted(np.cumsum(got[r]), u[r], side="right")) for r in range(rows)]
            assert sum(a == b for a, b in zip(chosen.get().tolist(), drawn, strict=True)) >= rows - 1
    assert cut_rows > 80 and edges <= 2


def _at_an_edge(w: np.ndarray, u: float, got: int, want: int) -> bool:
    """Whether draws ``got`` and ``want`` from weights w at u may differ by rounding alone: u times the total
    lies within 1e-9 of the total from the cumulative weight at the lower of the two."""
    cdf = np.cumsum(w)
    return abs(cdf[min(got, want)] - u * cdf[-1]) < 1e-9 * cdf[-1]


@pytest.mark.parametrize("v", [151_936, 4096, 37])
def test_inverse_cdf_and_sampled_verification_kernels_match_their_twins(gpu, v):
    """``inverse_cdf_rows`` and ``verify_sampled_rows`` against their NumPy twins: the draw from unnormalised
    float64 weights with zeros (a top-k cut) at uniforms of 0, just under 1 and between, read through a
    stride; and the acceptance of slots whose proposals hold or not, whose residual is empty (p = q with a
    proposal of zero probability), several slots in one launch. The count kept is exact; a token differs only
    where its uniform falls within rounding of a token's edge."""
    cp, kern, ref = gpu
    g = rng()
    rows = 6
    w = g.random((rows, v)) * (g.random((rows, v)) < 0.3)
    w[:, 0] = 0.0
    w[:, 1] = 0.5  # every row has weight
    grid = g.random((rows, 3))
    grid[0, 1], grid[1, 1] = 0.0, 1.0 - 2**-40
    u = grid[:, 1]
    got = cp.full(rows, -1, cp.int64)
    kern.inverse_cdf(cp.asarray(w), cp.asarray(grid)[:, 1], got)
    want = np.empty(rows, np.int64)
    ref.inverse_cdf(w, u, want)
    for r, (a, b) in enumerate(zip(got.get().tolist(), want.tolist(), strict=True)):
        assert a == b or _at_an_edge(w[r], u[r], a, b), (r, a, b)
        assert w[r, a] > 0

    s, n = 3, 4
    kept, residual_empty = [], 0
    for trial in range(16):
        logits = (g.standard_normal((s * n, v)) * 2).astype(np.float32)
        p = np.empty((s * n, v))
        ref.distribution(logits, 1.0, min(40, v - 1), 1.0, p)
        draft = logits.reshape(s, n, v)[:, :-1] + g.standard_normal((s, n - 1, v)).astype(np.float32)
        q = np.empty((s * (n - 1), v))
        ref.distribution(draft.reshape(-1, v), 1.0, min(40, v - 1), 1.0, q)
        tokens = np.zeros(s * n, np.int64)
        for i in range(s):
            for j in range(n - 1):
                tokens[i * n + j + 1] = int(
                    np.searchsorted(np.cumsum(q[i * (n - 1) + j]), g.random(), "right")
                )
        if trial % 4 == 3:  # slot 0: q = p and a first proposal neither gives weight to: an empty residual
            q[: n - 1] = p[: n - 1]
            tokens[1] = int(np.flatnonzero(p[0] == 0)[0])
            residual_empty += 1
        uniforms = g.random((s, 2 * n - 1))
        acc, first = cp.full(s, -1, cp.int64), cp.full(s, -1, cp.int64)
        args = [cp.asarray(a) for a in (p, q, tokens, uniforms)]
        kern.verify_sampled(*args, acc, first)
        want_a, want_f = np.empty(s, np.int64), np.empty(s, np.int64)
        ref.verify_sampled(p, q, tokens, uniforms, want_a, want_f)
        np.testing.assert_array_equal(acc.get(), want_a)
        for i in range(s):
            a, f, wf = int(want_a[i]), int(first.get()[i]), int(want_f[i])
            after = np.maximum(p[i * n + a] - q[i * (n - 1) + a], 0) if a < n - 1 else p[i * n + a]
            after = after if after.sum() > 0 else p[i * n + a]
            assert f == wf or _at_an_edge(after, uniforms[i, n - 1], f, wf), (trial, i, f, wf)
            assert after[f] > 0
        kept += want_a.tolist()
    assert min(kept) == 0 and max(kept) == n - 1 and residual_empty == 4


@pytest.mark.parametrize("v", [151936, 1000, 37])
def test_mask_logits_matches_twin(gpu, v):
    """A grammar's masks on some rows of a window, in place, bit for bit against the NumPy twin: each
    masked row keeps exactly the tokens its packed mask sets (a few, or most), the other rows are untouched,
    and the argmax of a masked row is an allowed token."""
    cp, kern, ref = gpu
    g = rng()
    rows, w = 6, (v + 31) // 32
    for trial in range(4):
        logits = (g.standard_normal((rows, v)) * 4).astype(np.float32)
        masked = np.sort(g.choice(rows, 2 + trial, replace=False)).astype(np.int64)
        share = 0.002 if trial % 2 else 0.9  # a key's few allowed tokens, or free text's many
        allowed = g.random((masked.size, w * 32)) < share
        allowed[:, 0] = True  # at least one
        bits = np.packbits(allowed, axis=1, bitorder="little").view("<u4").astype(np.uint32)
        out_d = cp.asarray(logits)
        kern.mask_logits(out_d, cp.asarray(masked), cp.asarray(bits))
        want = logits.copy()
        ref.mask_logits(want, masked, bits)
        got = out_d.get()
        assert np.array_equal(got, want)
        assert np.array_equal(np.isfinite(want[masked]), allowed[:, :v])
        untouched = np.setdiff1d(np.arange(rows), masked)
        assert np.array_equal(got[untouched], logits[untouched])
        assert allowed[np.arange(masked.size), np.argmax(got[masked], axis=1)].all()


@pytest.mark.parametrize("v", [151936, 1000, 37])
def test_adjust_logits_and_count_tokens_match_twin(gpu, v):
    """The logit bias and penalties of some rows of a window, in place, bit for bit against the NumPy twin
    (both compute in float64 without fused multiply-adds and round once), with and without a repetition
    penalty over counts that mark prompt tokens; the token counts, with a slot and token repeated,
    exactly."""
    cp, kern, ref = gpu
    g = rng()
    slots, rows = 4, 6
    for trial in range(4):
        counts = np.where(g.random((slots, v)) < 0.05, g.integers(1, 9, (slots, v)), 0).astype(np.int32)
        bias = np.where(g.random((slots, v)) < 0.02, g.uniform(-100, 100, (slots, v)), 0.0)
        logits = (g.standard_normal((rows, v)) * 4).astype(np.float32)
        adjusted = np.sort(g.choice(rows, 3 + trial % 3, replace=False)).astype(np.int64)
        slot = g.integers(0, slots, adjusted.size).astype(np.int64)
        freq, pres = g.uniform(-2, 2, adjusted.size), g.uniform(-2, 2, adjusted.size)
        out_d = cp.asarray(logits)
        dev = [cp.asarray(a) for a in (adjusted, slot, counts, bias, freq, pres)]
        kern.adjust_logits(out_d, *dev)
        want = logits.copy()
        ref.adjust_logits(want, adjusted, slot, counts, bias, freq, pres)
        assert np.array_equal(out_d.get(), want)
        assert not np.array_equal(want[adjusted], logits[adjusted])  # something changed
        untouched = np.setdiff1d(np.arange(rows), adjusted)
        assert np.array_equal(out_d.get()[untouched], logits[untouched])

        # Rows of a speculative window: each also counts up to 7 of the window's tokens (its proposals),
        # drawn from the tokens the slots already count and from new ones, with repeats.
        tokens = np.concatenate([np.flatnonzero(counts[0])[:4], g.integers(0, v, 6)]).astype(np.int64)
        tokens = g.permutation(np.resize(tokens, 10))
        extra_from = g.integers(0, 3, adjusted.size).astype(np.int64)
        extra_count = g.integers(0, 8, adjusted.size).astype(np.int32)
        extra_count[0] = 7
        out_d = cp.asarray(logits)
        extras = [cp.asarray(a) for a in (tokens, extra_from, extra_count)]
        kern.adjust_logits(out_d, *dev, *extras)
        with_extras = logits.copy()
        proposals = (tokens, extra_from, extra_count)
        ref.adjust_logits(with_extras, adjusted, slot, counts, bias, freq, pres, *proposals)
        assert np.array_equal(out_d.get(), with_extras)
        assert not np.array_equal(with_extras, want)  # the proposals counted

        # A repetition penalty per row (1 on some: none), over counts with prompt tokens marked (alone, and
        # beside times generated), with the proposals counted as seen too.
        marked = counts + np.where(g.random((slots, v)) < 0.1, ref.PROMPT_SEEN, 0).astype(np.int32)
        reps = np.where(g.random(adjusted.size) < 0.3, 1.0, g.uniform(0.5, 2.0, adjusted.size))
        reps[0] = 1.3
        dev_marked = [cp.asarray(a) for a in (adjusted, slot, marked, bias, freq, pres)]
        out_d = cp.asarray(logits)
        kern.adjust_logits(out_d, *dev_marked, *extras, repetition=cp.asarray(reps))
        repeated = logits.copy()
        ref.adjust_logits(repeated, adjusted, slot, marked, bias, freq, pres, *proposals, repetition=reps)
        assert np.array_equal(out_d.get(), repeated)
        assert not np.array_equal(repeated, with_extras)  # the repetition penalty changed rows

        n = 300
        cs = g.integers(0, slots, n).astype(np.int64)
        ct = g.integers(0, min(v, 50), n).astype(np.int64)  # few tokens: many repeats
        add = g.integers(1, 4, n).astype(np.int32)
        counts_d = cp.asarray(counts)
        kern.count_tokens(counts_d, cp.asarray(cs), cp.asarray(ct), cp.asarray(add))
        ref.count_tokens(counts, cs, ct, add)
        assert np.array_equal(counts_d.get(), counts)


@pytest.mark.parametrize(("n", "k"), [(5003, 2048), (1001, 272), (37, 512), (151936, 2048)])
def test_gemv_i8_matches_twin_and_its_rows_are_batch_invariant(gpu, n, k):
    """The MTP head's 8-bit LM head (``spec.draft_head = "int8"``): the kernel against its NumPy twin at
    every row count a window takes, on a quantized head (one of the vocabulary's size), and each row the
    same bits whichever rows share its launch."""
    from strata_runtime.models.ops.int8 import linear_int8, quantize_rows

    cp, kern, _ = gpu
    g = rng()
    q, scale = quantize_rows(np, half(g.standard_normal((n, k)) * 0.05))
    x = (g.standard_normal((8, k)) * 3).astype(np.float32)
    q_d, s_d, x_d = cp.asarray(q), cp.asarray(scale), cp.asarray(x)
    alone = []
    for rows in range(1, 9):
        out_d = cp.full((rows, n), cp.nan, cp.float32)
        kern.gemv_i8(q_d, s_d, x_d[:rows], out_d)
        want = np.empty((rows, n), np.float32)
        linear_int8(np, q, scale, x[:rows], want)
        assert rel_err(out_d.get(), want) < REL, rows
        alone.append(out_d.get()[-1])
    for rows in range(1, 9):
        out_d = cp.full((1, n), cp.nan, cp.float32)
        kern.gemv_i8(q_d, s_d, x_d[rows - 1 : rows], out_d)
        assert np.array_equal(out_d.get()[0], alone[rows - 1]), rows
