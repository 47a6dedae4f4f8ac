"""The causal flash-attention prefill kernel (`strata_runtime.cuda.flash`) against its NumPy twin.

Inputs are fresh random every run. The output is poisoned with NaN before each launch, and cache positions
the chunk must not read (past its last row, other slots) hold NaN, so an unwritten element or a read past
the causal limit fails. Bounds are relative Frobenius errors at fp16 level (`flash_inputs.REL`): P and the
output are rounded to fp16, everything else is fp32. The twin itself is checked in test_rt_flash_twin.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flash_inputs import REL, large_score_inputs, make_inputs, twin
from kernel_checks import rel_err, rng

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    return pytest.importorskip("cupy")


def run_kernel(cp, hi, lo, kc, vc, slot, pos0, scale) -> np.ndarray:
    """The kernel's output; ``lo`` None runs the fp16-q instantiation."""
    from strata_runtime.cuda.flash import flash_prefill

    n, n_q, d = hi.shape
    out = cp.full((n, n_q * d), cp.nan, cp.float16)
    q_lo = None if lo is None else cp.asarray(lo)
    flash_prefill(cp.asarray(hi), q_lo, cp.asarray(kc), cp.asarray(vc), slot, pos0, scale, out)
    return out.get()


PRECISIONS = pytest.mark.parametrize("split_q", [True, False], ids=["split-q", "fp16-q"])
"""Each test runs both precisions: q in two parts, and fp16 q."""


@pytest.fixture(params=["wide", "narrow"], autouse=True)
def shape(request, monkeypatch):
    """Each test runs both shapes: the one the GPU's shared memory allows (two 16-row tiles per warp on
    Hopper), and `NARROW` (one tile, 64 keys), which GPUs with less shared memory per SM run."""
    from strata_runtime.cuda import flash

    if request.param == "narrow":
        monkeypatch.setattr(flash, "sm_shared_bytes", lambda device_id: 0)
    return request.param


@PRECISIONS
@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("n", [1, 17, 130])
@pytest.mark.parametrize("pos0", [0, 5, 700])
def test_kernel_matches_twin(cp, d, group, n, pos0, split_q):
    g = rng()
    n_kv = 2
    hi, lo, kc, vc = make_inputs(g, n, n_kv * group, n_kv, d, pos0, q_scale=2.0)
    lo = lo if split_q else None
    scale = 1 / math.sqrt(d)
    assert rel_err(run_kernel(cp, hi, lo, kc, vc, 1, pos0, scale), twin(hi, lo, kc, vc, 1, pos0, scale)) < REL


@PRECISIONS
def test_slot_and_position_read_on_the_device_replace_the_numbers(cp, split_q):
    """With ``where`` the kernel takes the slot and first position from device memory, as a replayed graph
    of the prefill path gives them: the numbers passed are then wrong on purpose (slot 0 holds NaN), and
    the output must be the twin's at ``where``'s slot and position, the same bits as passing them."""
    from strata_runtime.cuda.flash import flash_prefill

    g = rng()
    n, pos0, d = 40, 300, 128
    hi, lo, kc, vc = make_inputs(g, n, 32, 4, d, pos0, slots=2, extra=64, q_scale=2.0)
    lo = lo if split_q else None
    scale = 1 / math.sqrt(d)
    args = (cp.asarray(hi), None if lo is None else cp.asarray(lo), cp.asarray(kc), cp.asarray(vc))
    out = cp.full((n, 32 * d), cp.nan, cp.float16)
    where = cp.asarray(np.array([1, pos0], np.int32))
    flash_prefill(*args, 0, 7, scale, out, where=where)
    direct = run_kernel(cp, hi, lo, kc, vc, 1, pos0, scale)
    assert np.array_equal(out.get(), direct)
    assert rel_err(out.get(), twin(hi, lo, kc, vc, 1, pos0, scale)) < REL
    with pytest.raises(ValueError, match="where must be"):
        flash_prefill(*args, 1, pos0, scale, out, where=where.astype(cp.int64))


@PRECISIONS
@pytest.mark.parametrize(
    ("n", "pos0", "d"), [(200, 2000, 128), (64, 64, 32), (3, 4093, 128), (333, 1000, 64)]
)
def test_kernel_matches_twin_model_heads(cp, n, pos0, d, split_q):
    """The production head layout (NQ = 32, NKV = 4, G = 8) over many key tiles, a tile-aligned chunk, a
    short chunk at the end of a 4k cache, and a chunk whose last block is partly past its rows."""
    g = rng()
    hi, lo, kc, vc = make_inputs(g, n, 32, 4, d, pos0, slots=2, extra=0, q_scale=2.0)
    lo = lo if split_q else None
    scale = 1 / math.sqrt(d)
    assert rel_err(run_kernel(cp, hi, lo, kc, vc, 1, pos0, scale), twin(hi, lo, kc, vc, 1, pos0, scale)) < REL


@PRECISIONS
@pytest.mark.parametrize(("d", "group"), [(16, 2), (128, 8), (64, 1)])
def test_rows_see_only_their_past(cp, d, group, split_q):
    g = rng()
    n, n_kv, pos0 = 90, 2, 40
    hi, lo, kc, vc = make_inputs(g, n, n_kv * group, n_kv, d, pos0)
    lo = lo if split_q else None
    scale = 1 / math.sqrt(d)
    before = run_kernel(cp, hi, lo, kc, vc, 1, pos0, scale)
    cut = int(g.integers(0, n - 1))  # rows 0..cut keep their keys; the positions of later rows change
    kc2, vc2 = kc.copy(), vc.copy()
    kc2[1, :, pos0 + cut + 1 : pos0 + n] = g.standard_normal((n_kv, n - cut - 1, d))
    vc2[1, :, pos0 + cut + 1 : pos0 + n] = g.standard_normal((n_kv, n - cut - 1, d))
    after = run_kernel(cp, hi, lo, kc2, vc2, 1, pos0, scale)
    np.testing.assert_array_equal(after[: cut + 1], before[: cut + 1])
    assert rel_err(after[cut + 1 :], before[cut + 1 :]) > 1e-2  # later rows do read those positions
    assert rel_err(after, twin(hi, lo, kc2, vc2, 1, pos0, scale)) < REL


@pytest.mark.parametrize("d", [16, 64, 128])
def test_kernel_uses_q_lo(cp, d):
    """With scores near 50, fp16 q alone is off by several times REL (test_rt_flash_twin checks the inputs
    do that); q_hi + q_lo must match the fp32-q reference far better."""
    g = rng()
    n, n_kv, pos0 = 70, 2, 300
    hi, lo, kc, vc, scale = large_score_inputs(g, n, 4 * n_kv, n_kv, d, pos0)
    ref = twin(hi, lo, kc, vc, 1, pos0, scale)  # fp32 q
    both = run_kernel(cp, hi, lo, kc, vc, 1, pos0, scale)
    hi_only = run_kernel(cp, hi, np.zeros_like(lo), kc, vc, 1, pos0, scale)
    assert rel_err(both, hi_only) > REL
    assert rel_err(both, ref) < rel_err(hi_only, ref) / 4
    assert rel_err(both, ref) < REL


@pytest.mark.parametrize("d", [16, 64, 128])
def test_fp16_q_instantiation_computes_fp16_q_attention(cp, d):
    """Without q_lo the kernel is held to fp16 q's attention at the same bound, on scores near 50 where that
    is several times REL from fp32 q's: it neither reads a q_lo nor keeps precision it does not claim."""
    g = rng()
    n, n_kv, pos0 = 70, 2, 300
    hi, lo, kc, vc, scale = large_score_inputs(g, n, 4 * n_kv, n_kv, d, pos0)
    fp16_q = run_kernel(cp, hi, None, kc, vc, 1, pos0, scale)
    assert rel_err(fp16_q, twin(hi, None, kc, vc, 1, pos0, scale)) < REL
    assert rel_err(fp16_q, twin(hi, lo, kc, vc, 1, pos0, scale)) > REL


def test_launcher_names_bad_arguments(cp):
    from strata_runtime.cuda.flash import flash_prefill

    g = rng()
    hi, lo, kc, vc = (cp.asarray(a) for a in make_inputs(g, 4, 4, 2, 16, 3))
    with pytest.raises(ValueError, match="out"):
        flash_prefill(hi, lo, kc, vc, 1, 3, 0.25, cp.empty((4, 64), cp.float32))
    with pytest.raises(ValueError, match="v_cache"):
        flash_prefill(hi, lo, kc, vc[:, :, 1:].copy(), 1, 3, 0.25, cp.empty((4, 64), cp.float16))
    with pytest.raises(ValueError, match="q_lo"):
        flash_prefill(hi, lo[:, :, :8].copy(), kc, vc, 1, 3, 0.25, cp.empty((4, 64), cp.float16))
    with pytest.raises(ValueError, match="out"):
        flash_prefill(hi, None, kc, vc, 1, 3, 0.25, cp.empty((4, 64), cp.float32))
