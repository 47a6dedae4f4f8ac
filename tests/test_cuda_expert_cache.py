"""The expert cache on a real GPU: greedy text as with every expert resident, swaps that keep the kernels'
address tables right, and the plan's memory cap.

Windows of at most 64 rows run the same decode kernels whether an expert sits in a VRAM slot or is read
from pinned host memory, so their greedy text must equal the all-resident run's exactly. A prompt chunk of
more than 64 rows runs one cuBLAS product per expert under a cache, where the all-resident path runs one
batched product over all of them: the same numbers up to cuBLAS's blocking, so that case is held to the
float32 reference's tolerance instead.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    return pytest.importorskip("cupy")


def _text(
    cp,
    *,
    cache: int | None,
    slots: int = 2,
    batch_mtp: bool = True,
    chunk: int = 64,
    adapt=True,
    draft_tokens: int = 3,
    **kw,
) -> str:
    """The small preset's profile on this GPU, its routed experts in a cache of ``cache`` slots (None: all
    resident)."""
    from rt_plans import float16_profile_text

    return float16_profile_text(
        vram_mib=cp.cuda.runtime.memGetInfo()[1] // (1 << 20),
        preset="small",
        slots=slots,
        batch_mtp=batch_mtp,
        draft_tokens=draft_tokens,
        context=512,
        prefill_chunk=chunk,
        expert_cache=cache,
        adapt=adapt if cache is not None else None,
        serve=True,
        **kw,
    )


def _plan(cp, **kw):
    """The resolved plan of `_text` (same keywords)."""
    from strata_cfg.plan.from_profile import resolve_text

    return resolve_text(_text(cp, **kw), "cache-test.toml").plan


def _generate(engine, prompts, tokens: int) -> list[list[int]]:
    from strata_runtime.api import Request

    handles = [engine.submit(Request(p, tokens)) for p in prompts]
    while engine.step():
        pass
    out = []
    for h in handles:
        got = []
        while not h.events.empty():
            got += h.events.get().token_ids
        out.append(got)
    return out


PROMPTS = [tuple(range(40, 90)), (72, 101, 108, 108, 111, 32) * 3, tuple(range(100, 133))]


@pytest.mark.parametrize("batch_mtp", [False, True])
def test_greedy_text_with_a_small_cache_on_the_gpu_equals_the_all_resident_run(cp, batch_mtp):
    from strata_runtime.engine import Engine

    resident = _generate(Engine(_plan(cp, cache=None, batch_mtp=batch_mtp)), PROMPTS, 24)
    engine = Engine(_plan(cp, cache=6, batch_mtp=batch_mtp, cache_policy={"keep_misses": False}))
    cached = _generate(engine, PROMPTS, 24)
    assert cached == resident
    stats = [s.experts.stats for s in engine.model.stages]
    assert sum(s.misses for s in stats) > 0 and sum(s.hits for s in stats) > 0
    assert sum(s.swaps for s in stats) > 0, "the adaptive tier moved experts on the GPU"
    # The kernels' tables: every expert's address is its slot's or its host copy's.
    for stage in engine.model.stages:
        store, tables = stage.experts, stage.cuda_experts
        assert tables is not None
        cp.cuda.Device(stage.device.index).synchronize()
        np.testing.assert_array_equal(tables.slot_of.get(), store.residency.slot_of)
        gu = tables.gate_up.get()
        for j in range(len(store)):
            for e in range(store.n_experts):
                if store.resident(j, e):
                    want = store.pool_gate_up[store.residency.slot_of[j, e]].data.ptr
                else:
                    want = store.host_gate_up[j][e].ctypes.data
                assert int(gu[j, e]) == want


def test_the_mtp_heads_layer_held_whole_on_the_gpu_gives_the_all_resident_text(cp, monkeypatch):
    """22 slots with the share a whole fixed layer may take raised to three quarters: the MTP head's layer
    holds its 16 experts in VRAM (its drafter reads them through the tables on the drafters' stream), the
    main layers share 6, and the greedy text with batch MTP is the all-resident run's."""
    from strata_cfg.schema import facts
    from strata_runtime.engine import Engine

    resident = _generate(Engine(_plan(cp, cache=None)), PROMPTS, 24)
    monkeypatch.setattr(facts, "MTP_WHOLE_MOST", 0.75)
    engine = Engine(_plan(cp, cache=22))
    last = engine.model.stages[-1]
    r = last.experts.residency
    assert len(r.fixed) == 1 and (r.slot_of[max(r.fixed)] >= 0).all()
    cached = _generate(engine, PROMPTS, 24)
    assert cached == resident
    assert sum(w.proposals for w in engine.windows) > 0 and r.stats.misses > 0
    assert (r.slot_of[max(r.fixed)] >= 0).all()
    cp.cuda.Device(last.device.index).synchronize()
    np.testing.assert_array_equal(last.cuda_experts.slot_of.get(), r.slot_of)


def test_a_conversation_copied_back_from_the_store_brings_its_experts_back_on_the_gpu(cp):
    """Three conversations over two slots under a cache of 24 experts that swaps, with a prefix store: each
    later turn copies its history back. With ``experts.recall_stored`` the cache's swaps for it are queued
    on the stage's stream before the turn's windows: the text is the same as without, the restored turns
    find more of their expert work in VRAM, and the kernels' tables end equal to the cache's."""
    from strata_runtime.engine import Engine

    runs = {}
    for recall in (False, True):
        engine = Engine(
            _plan(
                cp,
                cache=24,
                batch_mtp=False,
                prefix_store_mib=64,
                cache_policy={"recall_stored": recall, "keep_misses": False},
            )
        )
        rng = np.random.default_rng(5)
        said = [[int(t) for t in rng.integers(33, 126, 120)] for _ in range(3)]
        texts, hits = [], [0.0, 0.0]
        for turn in range(3):
            for conv in range(3):
                restores = engine.totals["prefix_restores"]
                for stage in engine.model.stages:
                    assert stage.cuda_experts is not None
                    stage.cuda_experts.settle()
                before = [(s.experts.stats.hits, s.experts.stats.misses) for s in engine.model.stages]
                (out,) = _generate(engine, [tuple(said[conv])], 12)
                for stage in engine.model.stages:
                    stage.cuda_experts.settle()
                after = [(s.experts.stats.hits, s.experts.stats.misses) for s in engine.model.stages]
                if turn:
                    assert engine.totals["prefix_restores"] == restores + 1
                    hits[0] += sum(h - h0 for (h0, _), (h, _) in zip(before, after, strict=True))
                    hits[1] += sum(h - h0 + m - m0 for (h0, m0), (h, m) in zip(before, after, strict=True))
                texts.append(out)
                said[conv] += out + [32, 97, 110, 100, 63, 32]
        for stage in engine.model.stages:
            cp.cuda.Device(stage.device.index).synchronize()
            np.testing.assert_array_equal(stage.cuda_experts.slot_of.get(), stage.experts.residency.slot_of)
        runs[recall] = texts, hits[0] / hits[1]
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] > runs[False][1] + 0.02, runs  # about 5 points on the CPU path


def test_a_long_prompt_chunk_under_a_cache_stays_within_the_references_tolerance(cp):
    """A 200-row chunk: misses copied into staging, one product per expert, against the all-resident path."""
    from strata_runtime.layout import Layout
    from strata_runtime.model import Model

    ids = np.random.default_rng(5).integers(1, 1000, 200)
    outs = []
    for cache in (None, 6):
        model = Model.from_plan(_plan(cp, cache=cache, chunk=256, batch_mtp=False))
        normed = model.forward(ids, Layout.of([(0, 200, 0)]))
        outs.append(model.logits(normed[-1:]).get())
    a, b = outs
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 5e-3  # fp16 products in another blocking
    assert int(a.argmax()) == int(b.argmax())


@pytest.mark.parametrize("lands", [True, False])
def test_a_prompt_chunks_rebalance_lands_before_the_first_window_after_it_on_the_gpu(cp, monkeypatch, lands):
    """A 200-row prompt chunk through the prefill path under a cache of 6 slots, then an 8-row window over
    its last tokens. The chunk's counts are handed over before the window is queued: the rebalance they
    bring has moved experts, and the window reads from host memory exactly the assignments the cache's
    tables send there (the window's own counters, read by hand). With the hand-over left to after the
    window (`CudaExperts.before_window` a no-op: the engine before it), either nothing has moved yet or
    the window read by tables the rebalance has since changed (it routes 32 assignments a layer over 16
    experts, so it uses the experts moved)."""
    from strata_runtime.cuda.experts import CudaExperts
    from strata_runtime.experts.cache import HOST
    from strata_runtime.layout import Layout
    from strata_runtime.model import Model

    if not lands:
        monkeypatch.setattr(CudaExperts, "before_window", lambda self: [])
    model = Model.from_plan(
        _plan(cp, cache=6, chunk=256, batch_mtp=False, cache_policy={"keep_misses": False})
    )
    (stage,) = model.stages
    tables, r = stage.cuda_experts, stage.experts.residency
    ids = np.random.default_rng(11).integers(1, 1000, 200)
    model.forward(ids, Layout.of([(0, 200, 0)]))
    model.forward(ids[-8:], Layout.of([(0, 8, 200)]))
    cp.cuda.Device(stage.device.index).synchronize()
    assert tables._read_done is None or tables._read_prompt  # the counters hold the window's alone
    counts, misses = tables.counts.get(), tables.misses.get()
    assert counts.sum() == 8 * 4 * stage.n_sparse  # 8 rows, 4 experts each, in every sparse layer
    expected = int(counts[r.tiers() == HOST].sum())
    read = int(misses[:, 0].sum() - misses[:, 1].sum())
    if lands:
        assert r.stats.swaps > 0
        assert read == expected
    else:
        assert r.stats.swaps == 0 or read != expected


def test_the_engine_holds_no_more_device_memory_than_the_plan_and_says_so_when_it_cannot(cp, monkeypatch):
    from strata_runtime.api import PlanMismatch
    from strata_runtime.engine import Engine
    from strata_runtime.model.placed import WeightStore

    plan = _plan(cp, cache=6)
    engine = Engine(plan)
    pool = cp.get_default_memory_pool()
    budget = plan.gpus[0].budget
    assert pool.get_limit() == budget.total - budget.reserve
    assert pool.total_bytes() <= pool.get_limit()
    del engine
    gc.collect()
    pool.free_all_blocks()  # nothing cached: every allocation of the next engine meets the cap
    monkeypatch.setattr(WeightStore, "limit", lambda self, plan, device: 1 << 20)
    try:
        with pytest.raises(PlanMismatch, match="does not fit cuda:0 within the plan's budget"):
            Engine(plan)
    finally:
        pool.set_limit(size=0)  # no cap for the tests that follow in this process


def test_the_cache_timeline_script_splits_a_streams_decode_time(cp, tmp_path) -> None:
    """``scripts/cache_timeline.py`` on a cache that holds part of the small preset's experts: it finds the
    timed request's decode windows (a token each after the prompt's), their misses over the host link, the
    waits for rebalances' copies and the work between two graphs."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    text = _text(cp, cache=6, slots=1, batch_mtp=False, draft_tokens=0)
    profile, out = tmp_path / "cached.toml", tmp_path / "split.json"
    profile.write_text(text)
    script = Path(__file__).resolve().parent.parent / "scripts" / "cache_timeline.py"
    run = subprocess.run(
        [sys.executable, str(script), str(profile), "--tokens", "24", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    split = json.loads(out.read_text())
    assert split["windows"] == 23  # a token a window after the prompt's, no drafting
    parts = split["ms_per_window_by_part"]
    graphs = parts["the layers' graphs"]
    link = parts["of them, the misses' bytes at the kernels' host read rate"]
    assert split["miss_mb_per_window"] > 0 and split["kernel_read_gbs"] > 1 and 0 < link < graphs
    assert parts["waiting for rebalances' copies"] >= 0
    assert parts["between graphs: LM head, the token's choice, the next embedding"] > 0
    assert 0 < split["graph_ms_median"] < split["ms_per_window"]
