"""The NumPy reference of the flash-attention prefill kernel against plain attention, on the CPU.

The gpu tests (test_cuda_flash.py) hold the kernel to this reference, so the reference is checked here, along
with the argument checks the launcher shares and the inputs that tell whether q_lo is read.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flash_inputs import REL, large_score_inputs, make_inputs, twin
from kernel_checks import rel_err, rng

from strata_cfg.schema.windows import FLASH_HEAD_DIMS
from strata_runtime.reference.flash import HEAD_DIMS, check_args
from strata_runtime.reference.flash import flash_prefill as reference_flash_prefill


def direct_attention(q, kc, vc, slot, pos0, scale) -> np.ndarray:
    """Row by row, head by head, in float64: the definition the twin must match."""
    n, n_q, d = q.shape
    g = n_q // kc.shape[1]
    out = np.zeros((n, n_q * d))
    for i in range(n):
        for h in range(n_q):
            keys = kc[slot, h // g, : pos0 + i + 1].astype(np.float64)
            values = vc[slot, h // g, : pos0 + i + 1].astype(np.float64)
            s = scale * keys @ q[i, h]
            p = np.exp(s - s.max())
            out[i, h * d : (h + 1) * d] = (p / p.sum()) @ values
    return out


@pytest.mark.parametrize(
    ("n", "n_q", "n_kv", "d", "pos0"),
    [(1, 2, 1, 16, 0), (9, 4, 2, 16, 5), (6, 8, 1, 32, 40), (5, 6, 3, 64, 2)],
)
def test_twin_matches_direct_attention(n, n_q, n_kv, d, pos0):
    g = rng()
    hi, lo, kc, vc = make_inputs(g, n, n_q, n_kv, d, pos0, q_scale=3.0)
    scale = 1 / math.sqrt(d)
    q = hi.astype(np.float64) + lo.astype(np.float64)
    ref = direct_attention(q, kc, vc, 1, pos0, scale)
    assert rel_err(twin(hi, lo, kc, vc, 1, pos0, scale), ref) < 1e-12
    out32 = np.full((n, n_q * d), np.nan, np.float32)  # any float output dtype
    reference_flash_prefill(hi, lo, kc, vc, 1, pos0, scale, out32)
    assert rel_err(out32, ref) < 1e-6


def test_twin_without_q_lo_is_fp16_q_attention():
    """q_lo None: the contract holds and the reference attends with q_hi alone, the fp16-q kernel's
    definition."""
    g = rng()
    n, n_q, n_kv, d, pos0 = 7, 4, 2, 32, 9
    hi, lo, kc, vc = make_inputs(g, n, n_q, n_kv, d, pos0, q_scale=3.0)
    scale = 1 / math.sqrt(d)
    ref = direct_attention(hi.astype(np.float64), kc, vc, 1, pos0, scale)
    assert rel_err(twin(hi, None, kc, vc, 1, pos0, scale), ref) < 1e-12
    assert rel_err(twin(hi, lo, kc, vc, 1, pos0, scale), ref) > 1e-6  # q_lo, when given, is read


def test_large_score_inputs_need_q_lo():
    """The inputs of the gpu q_lo test separate fp16 q from fp32 q by far more than fp16 output rounding
    does, so that test can tell whether the kernel reads q_lo."""
    g = rng()
    hi, lo, kc, vc, scale = large_score_inputs(g, 40, 4, 2, 64, 100)
    full = twin(hi, lo, kc, vc, 1, 100, scale)
    assert rel_err(twin(hi, np.zeros_like(lo), kc, vc, 1, 100, scale), full) > 4 * REL / 3
    assert rel_err(full.astype(np.float16), full) < REL / 10


def _valid_args() -> dict:
    return {
        "q_hi": np.zeros((3, 4, 16), np.float16),
        "q_lo": np.zeros((3, 4, 16), np.float16),
        "k_cache": np.zeros((3, 2, 12, 16), np.float16),
        "v_cache": np.zeros((3, 2, 12, 16), np.float16),
        "slot": 1,
        "pos0": 2,
        "out": np.zeros((3, 64), np.float16),
    }


@pytest.mark.parametrize(
    ("change", "name"),
    [
        ({"q_hi": np.zeros((3, 4, 16), np.float32)}, "q_hi"),
        (
            {
                k: np.zeros((*v.shape[:-1], v.shape[-1] * 3 // 2), np.float16)
                for k, v in _valid_args().items()
                if isinstance(v, np.ndarray)
            },
            "head dim",
        ),
        ({"q_lo": np.zeros((4, 4, 16), np.float16)}, "q_lo"),
        ({"k_cache": np.zeros((3, 2, 12, 32), np.float16)}, "k_cache"),
        (
            {
                "k_cache": np.zeros((3, 3, 12, 16), np.float16),
                "v_cache": np.zeros((3, 3, 12, 16), np.float16),
            },
            "k_cache",
        ),
        ({"v_cache": np.zeros((3, 2, 11, 16), np.float16)}, "v_cache"),
        ({"out": np.zeros((3, 63), np.float16)}, "out"),
        ({"out": np.zeros((3, 64), np.float32)}, "out"),
        ({"slot": 3}, "slot"),
        ({"pos0": 10}, "pos0"),
        ({"pos0": -1}, "pos0"),
    ],
)
def test_bad_arguments_are_named(change, name):
    args = _valid_args()
    assert check_args(**args) == (3, 4, 2, 16)
    args.update(change)
    with pytest.raises(ValueError, match=name):
        check_args(**args)


def test_the_launcher_takes_the_shape_the_devices_shared_memory_allows(monkeypatch):
    """`strata_runtime.cuda.flash.flash_prefill` asks the device for its SMs' shared memory and launches the
    instantiation, grid and shared memory of the shape that fits: two row tiles a warp on a Hopper SM, one on
    an SM with less (here a fake CuPy and a recording kernel cache; the kernels run on the GPU tests)."""
    from types import SimpleNamespace

    from fake_cupy import installed

    from strata_runtime.cuda import flash

    class OnDevice(np.ndarray):
        device = SimpleNamespace(id=0)

    launches: list[tuple[str, int, tuple, int]] = []

    class Recorder:
        def fn_with_shared(self, expr, smem):
            def launch(grid, block, args, shared_mem):
                launches.append((expr, smem, grid, shared_mem))

            return launch

    monkeypatch.setattr(flash, "flash_kernels_for", lambda device_id: Recorder())
    g = rng()
    hi, lo, kc, vc = (a.view(OnDevice) for a in make_inputs(g, 100, 8, 2, 128, 5))
    out = np.zeros((100, 8 * 128), np.float16).view(OnDevice)
    with installed():
        for sm in (flash.HOPPER_SM_SHARED, 164 * 1024):
            monkeypatch.setattr(flash, "sm_shared_bytes", lambda device_id, sm=sm: sm)
            for q_lo in (lo, None):
                flash.flash_prefill(hi, q_lo, kc, vc, 1, 5, 0.1, out)
    assert [(e, grid) for e, _, grid, _ in launches] == [
        ("flash_prefill<128, true, 2, 32>", (2, 4)),  # 100 rows x 4 heads a KV head, 128 rows a block
        ("flash_prefill<128, false, 2, 32>", (2, 4)),
        ("flash_prefill<128, true, 1, 64>", (2, 7)),  # 64 rows a block
        ("flash_prefill<128, false, 2, 32>", (2, 4)),  # fp16 q's 68 KiB blocks fit two to an A100's SM
    ]
    assert [smem for _, smem, _, _ in launches] == [shared for _, _, _, shared in launches]
    assert [smem for _, smem, _, _ in launches] == [102 * 1024, 68 * 1024, 68 * 1024, 68 * 1024]


def test_the_plans_fused_head_dims_are_the_kernels():
    """The resolver plans no score tile at `FLASH_HEAD_DIMS` on a GPU (strata_cfg imports no runtime), so
    they must be the head dims the fused kernel is instantiated for."""
    assert FLASH_HEAD_DIMS == HEAD_DIMS
