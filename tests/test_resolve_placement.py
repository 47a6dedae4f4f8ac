"""The auto split against brute force: it finds the smallest slowest-stage time among the splits that fit,
and prefers a split that keeps every expert resident."""

from __future__ import annotations

import itertools
import random

import pytest

from strata_cfg.resolve import sizes
from strata_cfg.resolve.placement import (
    MIB,
    Sizing,
    auto_split,
    faster_last,
    stage_need,
    stage_shapes,
    stage_times,
)
from strata_cfg.schema.facts import GpuFacts, ModelFacts
from strata_cfg.schema.presets import preset_config
from strata_cfg.schema.windows import ATTENTION_TILE_BYTES, FLASH_HEAD_DIMS, attention_tile_rows


def model(name: str) -> ModelFacts:
    return ModelFacts.from_config(preset_config(name), source=f"synthetic:{name}", dtype="float16")


def sizing(**over) -> Sizing:
    base = dict(
        context=2048,
        kv_dtype="float16",
        slots=2,
        drafters=2,
        with_mtp=True,
        mtp_passes=1,
        prefill_chunk=256,
        prefill_chunk_alone=256,
        reserve_first=700 * MIB,
        reserve_later=700 * MIB,
        cache=None,
        stores_scores=True,
    )
    return Sizing(**{**base, **over})


def fits(m: ModelFacts, bounds, gpus, sz: Sizing, *, resident: bool) -> bool:
    for i, (shape, gpu) in enumerate(zip(stage_shapes(bounds, m.num_hidden_layers), gpus, strict=True)):
        need = stage_need(m, shape, sz)
        reserve = sz.reserve_first if i == 0 else sz.reserve_later
        experts = need.experts if resident else min(need.experts, m.num_experts_per_tok * 8, m.num_experts)
        total = need.weights + need.kv + need.drafters + need.workspace + reserve + experts * m.expert_bytes()
        if total > gpu.vram_mib * MIB:
            return False
    return True


def brute_force(m: ModelFacts, gpus, sz: Sizing) -> tuple[float, bool] | None:
    n, s = m.num_hidden_layers, len(gpus)
    for resident in (True, False):
        best = None
        for bounds in itertools.combinations(range(2, n), s - 1):
            if fits(m, bounds, gpus, sz, resident=resident):
                t = max(stage_times(m, bounds, gpus, sz))
                best = t if best is None else min(best, t)
        if best is not None:
            return best, resident
    return None


def gpu(i: int, vram_mib: int, bw: float) -> GpuFacts:
    return GpuFacts(index=i, name=f"g{i}", vram_mib=vram_mib, bandwidth_gbs=bw)


@pytest.mark.parametrize("seed", range(12))
def test_auto_split_is_as_fast_as_the_best_split(seed):
    rng = random.Random(seed)
    m = model(rng.choice(["small", "qwen3-30b-a3b"]))
    n_gpus = rng.choice([2, 3]) if m.num_hidden_layers > 8 else rng.choice([2, 3, 4])
    gpus = [gpu(i, 200_000, rng.uniform(200, 5000)) for i in range(n_gpus)]
    sz = sizing(slots=rng.randint(1, 6), mtp_passes=rng.choice([0, 1, 3]), context=rng.choice([512, 4096]))
    found = auto_split(m, gpus, sz)
    assert found is not None
    bounds, resident = found
    best, best_resident = brute_force(m, gpus, sz)
    assert resident == best_resident
    assert max(stage_times(m, bounds, gpus, sz)) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("vram_mib", [34_000, 40_000, 20_480])
def test_auto_split_under_vram_prefers_every_expert_resident(vram_mib):
    m = model("qwen3-30b-a3b")
    gpus = [gpu(0, vram_mib, 760), gpu(1, vram_mib, 760)]
    sz = sizing()
    found = auto_split(m, gpus, sz)
    expected = brute_force(m, gpus, sz)
    assert (found is None) == (expected is None)
    if found is not None:
        bounds, resident = found
        assert resident == expected[1]
        assert fits(m, bounds, gpus, sz, resident=resident)
        assert max(stage_times(m, bounds, gpus, sz)) == pytest.approx(expected[0], rel=1e-9)


def test_faster_gpu_goes_last_only_beyond_five_percent():
    a, b = gpu(0, 1000, 1000), gpu(1, 1000, 1040)
    assert faster_last([b, a]) == [b, a]  # within 5%: device order kept
    c = gpu(2, 1000, 2000)
    assert faster_last([c, a, b]) == [a, b, c]


def test_workspace_holds_one_tile_of_stored_attention_scores_not_one_per_row():
    m = model("qwen3-30b-a3b")
    ctx, nh = 8192, m.num_attention_heads
    tile = attention_tile_rows(nh, ctx)
    assert 16 < tile < 4096  # a 4,096-row prompt window is read in several tiles at this context
    per_row = sizes.row_activation_bytes(m)

    def ws(rows: int) -> int:
        return sizes.workspace_bytes(m, context=ctx, prefill_rows=rows, last=False, stores_scores=True)

    # Below the tile, each more row adds its activations and its scores (fp32) and probabilities (fp16).
    assert ws(tile) - ws(tile - 100) == 100 * (per_row + nh * ctx * 6)
    # Past the tile, only its activations: the scores are one tile's, under the runtime's tile bound.
    assert ws(4096) - ws(2048) == 2048 * per_row
    assert ws(4096) - 4096 * per_row == tile * nh * ctx * 6 <= ATTENTION_TILE_BYTES
    # A longer context makes the tile shorter, never larger than the bound.
    assert sizes.attention_scores_bytes(m, context=4 * ctx, rows=4096) <= ATTENTION_TILE_BYTES


@pytest.mark.parametrize(
    ("backend", "head_dim", "stores"),
    [("cuda", 128, False), ("cuda", 16, False), ("cuda", 256, True), ("cuda", 96, True), ("cpu", 128, True)],
)
def test_prompt_attention_stores_scores_everywhere_but_the_fused_kernel(backend, head_dim, stores):
    """A GPU reads prompts through the fused kernel at its head dims, which stores no scores; head dims it
    lacks (cuBLAS over tiles of scores) and virtual CPU devices (the array path) store them."""
    m = model("qwen3-30b-a3b").model_copy(update={"head_dim": head_dim})
    assert sizes.stores_attention_scores(backend, m) == stores
    assert FLASH_HEAD_DIMS == (16, 32, 64, 128)  # the runtime's (test_rt_flash_reference.py holds them equal)


@pytest.mark.parametrize("last", [False, True])
def test_the_workspace_counts_a_score_tile_only_where_prompt_attention_stores_one(last):
    m = model("qwen3-30b-a3b")
    ctx, rows = 8192, 4096
    kw = dict(context=ctx, prefill_rows=rows, last=last, slots=2, graph_rows=512)
    fused = sizes.workspace_bytes(m, stores_scores=False, **kw)
    stored = sizes.workspace_bytes(m, stores_scores=True, **kw)
    assert stored - fused == sizes.attention_scores_bytes(m, context=ctx, rows=rows) > 0
    # Without the tile the chunk's rows, the graphs' rows and the last stage's logits and counts are left.
    head = 8 * m.vocab_size * 4 + 2 * m.vocab_size * sizes.TOKEN_COUNT_BYTES if last else 0
    assert fused == (rows + 512) * sizes.row_activation_bytes(m) + head
    # The stage's need carries it through `Sizing.stores_scores`.
    shape = stage_shapes([24], m.num_hidden_layers)[1 if last else 0]
    need = {
        flag: stage_need(m, shape, sizing(context=ctx, prefill_chunk_alone=rows, stores_scores=flag))
        for flag in (True, False)
    }
    assert need[True].workspace - need[False].workspace == stored - fused
