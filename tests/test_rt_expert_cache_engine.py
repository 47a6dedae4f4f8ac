"""An expert cache changes where an expert's product is computed, never the result.

Through the engine on virtual CPU devices: with any cache size the resolver accepts, down to no slot at all,
every request's greedy tokens equal the all-resident run's, in every window mode, on one to three stages, for
the tiny and small presets, with prompts of several prefill chunks and staggered arrivals. The cache must
also really be one: the stage holds exactly the plan's slots, misses happen, the adaptive tier moves experts,
and a frozen cache never does.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rt_engine_helpers import MODES, collect, mode_plan

from strata_cfg.schema.plan import LaunchPlan
from strata_runtime.api import Request
from strata_runtime.engine import Engine

CHUNK = 8


def cache_plan(preset: str, stages: int, mode: str, cache: int | None, **kw: Any) -> LaunchPlan:
    """The plan of these tests' engines: ``cache`` slots a stage GPU (None: every expert resident), a
    context of 96 read in chunks of `CHUNK`; ``kw``: more `rt_plans.make_plan` keywords."""
    return mode_plan(mode, stages, preset=preset, context=96, prefill_chunk=CHUNK, expert_cache=cache, **kw)


@functools.cache
def engine(
    preset: str, stages: int, mode: str, cache: int | None, adapt: bool = True, keep: bool | None = None
) -> Engine:
    """``keep``: whether the cache keeps its misses (None: as the plan resolves; the small caches here
    swap by default, rule ``experts.keep-misses-small-cache``)."""
    policy = None if keep is None else {"keep_misses": keep}
    return Engine(cache_plan(preset, stages, mode, cache, adapt=adapt, cache_policy=policy))


def prompt(length: int, salt: int) -> tuple[int, ...]:
    return tuple(32 + (11 * i + 17 * salt) % 90 for i in range(length))


arrivals = st.lists(
    st.tuples(st.integers(0, 6), st.integers(1, 3 * CHUNK + 2), st.integers(1, 10)),  # step, length, tokens
    min_size=1,
    max_size=4,
)


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("mode", list(MODES))
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=arrivals, cache=st.sampled_from([0, 1, 3, 12]), keep=st.sampled_from([None, True]))
def test_greedy_text_with_any_cache_size_equals_the_all_resident_run(
    preset, stages, mode, schedule, cache, keep
):
    """Swapping (the default of caches this small) or keeping every miss, the text is the resident run's."""
    requests = [(at, Request(prompt(n, i), m, request_id=f"r{i}")) for i, (at, n, m) in enumerate(schedule)]
    cached = engine(preset, stages, mode, cache, keep=keep)
    if keep:
        assert all(stage.experts.residency.policy.keep_misses for stage in cached.model.stages)
    for stage, gpu in zip(cached.model.stages, cached.plan.gpus, strict=True):
        assert stage.experts.cached == (gpu.experts_resident < gpu.experts_total)
    assert cache == 12 or all(stage.experts.cached for stage in cached.model.stages)
    assert collect(cached, requests) == collect(engine(preset, stages, mode, None), requests)


@pytest.mark.parametrize("stages", [1, 2])
def test_each_stage_holds_exactly_the_plans_slots_and_every_expert_in_host_memory(stages):
    eng = engine("small", stages, "serial", 5)
    for stage, gpu in zip(eng.model.stages, eng.plan.gpus, strict=True):
        store = stage.experts
        assert store.slots == gpu.experts_resident == 5
        assert store.vram_bytes == 5 * store.expert_bytes
        experts = len(store) * store.n_experts
        assert experts == gpu.experts_total
        assert store.host_bytes == experts * store.expert_bytes
        # The layers read their experts through the store, never from the tensors they were built from.
        for layer in stage.layers:
            ex = getattr(layer.mlp, "experts", None)
            assert ex is None or ex.source is store


def test_the_adaptive_tier_moves_experts_and_serves_more_from_vram_than_a_frozen_one():
    """One request repeating a short phrase routes to few experts: adapting, by swaps or by keeping the misses
    the kernels read, serves more of its expert work from VRAM than a frozen cache, and moves fewer bytes
    over the host link. (With 6 slots of a stage's 64 experts, keeping moves more than swapping here.)"""
    phrase = prompt(6, 3) * 4
    figures = {}
    for name, policy in (("frozen", {"adapt": False}), ("swap", {}), ("keep", {"keep_misses": True})):
        plan = mode_plan(
            "serial", 2, preset="small", context=96, prefill_chunk=CHUNK, expert_cache=6, cache_policy=policy
        )
        eng = Engine(plan)
        collect(eng, [(0, Request(phrase, 40))])
        stats = [stage.experts.stats for stage in eng.model.stages]
        assert all(s.hits + s.misses > 0 for s in stats)
        moved = sum(s.swaps + s.kept for s in stats)
        assert (moved > 0) == (name != "frozen")
        hit_rate = sum(s.hits for s in stats) / sum(s.hits + s.misses for s in stats)
        figures[name] = hit_rate, sum(s.miss_bytes + s.swap_bytes for s in stats)
    assert figures["swap"][0] > figures["frozen"][0] + 0.1, figures
    assert figures["keep"][0] > figures["frozen"][0] + 0.05, figures
    assert figures["swap"][1] < figures["frozen"][1] and figures["keep"][1] < figures["frozen"][1], figures


@pytest.mark.parametrize("routing", ["uniform", "calibrated"])
def test_on_each_side_of_the_keep_line_the_plans_default_moves_fewer_bytes_over_the_link(routing):
    """One request through two stages, the second's cache at 1.5 and then 2.5 times top-k slots a layer
    (18 and 30 slots over its 3 layers of 16 experts, top-4): below the line of rule
    experts.keep-misses-small-cache the plan swaps by default, above it it keeps its misses, and on each
    side its choice moves fewer bytes over the host link than the other policy."""
    moved = {}
    for cache in (18, 30):
        for keep in (None, False, True):
            policy = None if keep is None else {"keep_misses": keep}
            eng = Engine(cache_plan("small", 2, "serial", cache, cache_policy=policy, routing=routing))
            collect(eng, [(0, Request(prompt(20, 7), 60))])
            stats = [stage.experts.stats for stage in eng.model.stages]
            moved[cache, keep] = sum(s.miss_bytes + s.swap_bytes for s in stats), eng.plan.experts.keep_misses
    assert moved[18, None] == moved[18, False] and not moved[18, None][1]  # the default swaps
    assert moved[30, None] == moved[30, True] and moved[30, None][1]  # the default keeps
    assert moved[18, False][0] < moved[18, True][0], moved
    assert moved[30, True][0] < moved[30, False][0], moved


def test_the_engine_reports_each_stages_cache():
    eng = engine("tiny", 2, "serial", 3)
    collect(eng, [(0, Request(prompt(20, 1), 8))])
    report = eng.stats()["experts"]
    assert [r["device"] for r in report] == ["cpu:0", "cpu:1"]
    for r, stage in zip(report, eng.model.stages, strict=True):
        assert r["cached"] and r["slots"] == 3
        assert r["hits"] + r["misses"] > 0
        assert r["miss_bytes"] == r["misses"] * stage.experts.expert_bytes
        assert r["hit_rate"] == pytest.approx(r["hits"] / (r["hits"] + r["misses"]))
    assert np.isclose(sum(r["hit_rate"] is not None for r in report), 2)


def test_benchmark_arms_share_one_cache_per_stage_and_a_memory_cap_that_grows_by_what_each_adds():
    from rt_plans import make_plan

    from strata_runtime.backend import Device
    from strata_runtime.model import Model
    from strata_runtime.model.placed import WeightStore

    store = WeightStore()
    kw = dict(preset="small", stages=2, context=64, prefill_chunk=16, expert_cache=4)
    serial = make_plan(slots=2, groups=1, **kw)
    pipelined = make_plan(slots=2, groups=2, **kw)
    a, b = Model.from_plan(serial, weights=store), Model.from_plan(pipelined, weights=store)
    for sa, sb in zip(a.stages, b.stages, strict=True):
        assert sa.experts is sb.experts and sa.experts.cached
    gpu = serial.gpus[0].budget
    first = gpu.total - gpu.reserve
    assert store.limits["cpu:0"] == first + pipelined.gpus[0].budget.kv + pipelined.gpus[0].budget.workspace
    # A third model of the same layout adds its own KV, drafters and workspace again.
    before = store.limits["cpu:0"]
    assert store.limit(serial, Device("cpu", 0)) == before + gpu.kv + gpu.drafters + gpu.workspace


def test_benchmark_arms_sharing_a_cache_each_adapt_by_their_own_plans_policy():
    """Arms that differ in the cache's policy share its slots; each arm's restore hands the cache its own
    policy, so a comparison of policies runs each one."""
    from rt_plans import make_plan

    from strata_runtime.experts.cache import Policy
    from strata_runtime.model.placed import WeightStore

    store = WeightStore()
    kw = dict(preset="small", context=64, prefill_chunk=16, expert_cache=4)
    a = Engine(make_plan(cache_policy={"max_swaps": 1, "keep_misses": True}, **kw), weights=store)
    b = Engine(
        make_plan(cache_policy={"max_swaps": 7, "swap_margin": 0.5, "keep_misses": False}, **kw),
        weights=store,
    )
    [sa], [sb] = a.model.stages, b.model.stages
    assert sa.experts is sb.experts
    state = a.expert_state()
    b.restore_experts(state)
    assert sb.experts.residency.policy == Policy(max_swaps=7, margin=0.5)
    a.restore_experts(state)
    assert sa.experts.residency.policy == Policy(max_swaps=1, keep_misses=True, decay=0.95)


def test_a_prompt_chunk_rebalances_the_cache_at_once_on_the_array_path_and_decode_windows_wait():
    """With rebalances otherwise far apart, the window that reads a prompt chunk (more rows than any graph
    window) moves the experts it routed to into VRAM at once; the one-row decode windows after it do not."""
    from rt_plans import make_plan

    policy = {"rebalance_every": 1000, "keep_misses": False}
    plan = make_plan(preset="small", context=64, prefill_chunk=16, expert_cache=4, cache_policy=policy)
    eng = Engine(plan)
    [stage] = eng.model.stages
    r = stage.experts.residency
    rebalances: list[int] = []
    rebalance = r.rebalance
    r.rebalance = lambda: rebalances.append(stage.experts.stats.windows) or rebalance()  # type: ignore[method-assign]
    eng.submit(Request(prompt(16, 3), 4))
    eng.step()  # the prompt's one chunk: 16 rows
    swapped = stage.experts.stats.swaps
    assert swapped > 0 and rebalances == [1]
    while eng.step():
        pass
    assert stage.experts.stats.windows > 1 and rebalances == [1] and stage.experts.stats.swaps == swapped


def test_a_restored_cache_holds_and_knows_what_it_did_so_a_rerun_serves_the_same():
    """Benchmark arms share a cache; each starts from the same contents, so the same requests run again
    after a restore are served exactly as the first time, hit for hit."""
    eng = engine("small", 2, "serial", 5)
    requests = [(0, Request(prompt(20, 7), 10)), (1, Request(prompt(9, 8), 10))]

    def served() -> list[tuple[int, int]]:
        return [(s.experts.stats.hits, s.experts.stats.misses) for s in eng.model.stages]

    start = eng.expert_state()
    before = served()
    first = collect(eng, requests)
    first_served = [(h - h0, m - m0) for (h, m), (h0, m0) in zip(served(), before, strict=True)]
    assert any(
        ((s.experts.residency.slot_of >= 0) != snap.resident).any()
        for s, snap in zip(eng.model.stages, start, strict=True)
    ), "the run moved experts"
    eng.restore_experts(start)
    eng.forget_prefixes()  # as the bench does: the rerun reads its prompts again
    for stage, snap in zip(eng.model.stages, start, strict=True):
        assert ((stage.experts.residency.slot_of >= 0) == snap.resident).all()
        np.testing.assert_array_equal(stage.experts.residency.scores, snap.scores)
    before = served()
    assert collect(eng, requests) == first
    assert [(h - h0, m - m0) for (h, m), (h0, m0) in zip(served(), before, strict=True)] == first_served


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("mode", ["serial", "batch-mtp"])
def test_a_cache_that_keeps_its_misses_gives_the_all_resident_text_and_copies_no_swap(stages, mode):
    """``experts.keep_misses`` on the array path: each expert a window reads from host memory takes a queued
    victim's slot (`Residency.admit`); no token changes, experts are kept and no swap is copied."""
    plan = mode_plan(
        mode,
        stages,
        preset="small",
        context=96,
        prefill_chunk=CHUNK,
        expert_cache=6,
        cache_policy={"keep_misses": True},
    )
    keeping = Engine(plan)
    requests = [
        (0, Request(prompt(20, 1), 10, request_id="a")),
        (2, Request(prompt(9, 2), 12, request_id="b")),
    ]
    assert collect(keeping, requests) == collect(engine("small", stages, mode, None), requests)
    for stage in keeping.model.stages:
        stats = stage.experts.stats
        assert stats.kept > 0 and stats.swaps == 0 and stats.swap_bytes == 0
        r = stage.experts.residency
        assert sorted(r.slot_of[r.slot_of >= 0].tolist()) == list(range(r.slots))  # each slot held once


def test_the_array_path_keeps_no_miss_of_a_prompt_chunk_and_keeps_the_decode_windows():
    """As on a GPU, where prompt chunks go through the prefill path, a window that holds a prompt chunk
    (more rows than any decode window) keeps none of its misses, queue or not; the decode windows do."""
    from rt_plans import make_plan

    policy = {"keep_misses": True}
    plan = make_plan(preset="small", context=64, prefill_chunk=16, expert_cache=4, cache_policy=policy)
    eng = Engine(plan)
    [stage] = eng.model.stages
    r = stage.experts.residency
    assert r.policy.keep_misses
    collect(eng, [(0, Request(prompt(16, 4), 6))])
    kept = r.stats.kept
    assert kept > 0  # the decode windows kept misses
    r.queue = r.victims()  # a full queue, which the next prompt chunk could take from
    eng.submit(Request(prompt(16, 9), 4))
    eng.step()  # the new prompt: one chunk of 16 rows, most of it read from host memory
    assert r.stats.prompt_misses > 0 and r.stats.kept == kept
