"""A second expert-cache tier on helper GPUs or the peer device, between VRAM and host memory.

The bookkeeping must keep both tiers of slots bijective and apart whatever the routing, rank the experts
(the hottest in VRAM, the next in the helper tier), trade places between the two tiers, and keep fixed
layers where they are. Through the engine on virtual CPU devices, greedy text with any split of the experts
across VRAM, helper slots and host memory equals the all-resident run, in every window mode the resolver
allows with helpers, and each tier really serves its share. On the CUDA path's Python (tests/fake_cupy.py)
the device tables must give each expert the address of where it is, which the stand-in kernels then read.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rt_engine_helpers import assert_reads_by_tier, collect, handed_to_cache
from rt_plans import make_plan
from test_rt_expert_cache import check_bijection
from test_rt_expert_cache_engine import arrivals, cache_plan, prompt

from strata_runtime.api import PlanMismatch, Request
from strata_runtime.backend import Device
from strata_runtime.engine import Engine
from strata_runtime.experts.cache import HELPER, HOST, VRAM, Policy, Reads, Residency, helper_fill
from strata_runtime.experts.store import ExpertStore
from strata_runtime.model.placed import helper_slots, proportional

# ---- the bookkeeping ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "experts", "slots", "helper"), [(3, 8, 5, 7), (4, 8, 16, 16), (2, 6, 1, 11)]
)
def test_the_helper_tier_starts_with_the_experts_vram_lacks_spread_evenly(layers, experts, slots, helper):
    r = Residency(layers, experts, slots, helper_slots=helper)
    check_bijection(r)
    both = ((r.slot_of >= 0) | (r.helper_of >= 0)).sum(axis=1)
    assert both.max() - both.min() <= 1, "VRAM and helper slots together are spread evenly over the layers"
    for j in range(layers):  # each layer's experts in id order: VRAM first, then the helper tier
        held = np.flatnonzero((r.slot_of[j] >= 0) | (r.helper_of[j] >= 0))
        assert held.tolist() == list(range(len(held)))


def test_a_helper_tier_larger_than_what_vram_lacks_is_refused():
    with pytest.raises(ValueError, match="helper slots"):
        helper_fill(np.full((2, 4), -1, np.int32), 9)


def test_a_stable_ranking_ends_with_the_hottest_in_vram_and_the_next_in_the_helper_tier():
    layers, experts = 2, 12
    r = Residency(layers, experts, 4, 1, Policy(every=1, margin=0.5), helper_slots=6)
    rng = np.random.default_rng(5)
    heat = rng.permutation(layers * experts).reshape(layers, experts).astype(np.float64) + 1  # distinct
    for _ in range(10):
        r.observe(heat)
        r.rebalance()
        check_bijection(r)
    order = np.argsort(-heat, axis=None)
    tiers = r.tiers().reshape(-1)[order]
    assert tiers.tolist() == [VRAM] * 4 + [HELPER] * 6 + [HOST] * 14


def test_a_hot_helper_expert_trades_places_with_the_coldest_vram_expert():
    r = Residency(1, 6, 2, 1, Policy(every=1, margin=0.0, max_swaps=1), helper_slots=2)
    assert r.tiers().tolist() == [[VRAM, VRAM, HELPER, HELPER, HOST, HOST]]
    r.observe(np.array([[5.0, 1.0, 0.0, 9.0, 0.0, 0.0]]))
    swaps = r.rebalance()
    assert len(swaps) == 1
    [swap] = swaps
    assert swap.tier == VRAM and swap.loaded == (0, 3) and swap.evicted == (0, 1)
    assert swap.source == 1, "expert 3 came from helper slot 1"
    assert r.helper_of[0, 1] == 1, "the evicted expert takes the newcomer's helper slot"
    assert r.stats.peer_swap_bytes == 1 and r.stats.swap_bytes == 1  # one copy over each link
    check_bijection(r)


def test_host_experts_replace_the_weakest_helper_residents_but_not_one_just_exchanged():
    r = Residency(1, 6, 1, 1, Policy(every=1, margin=0.0), helper_slots=2)  # VRAM {0}, helper {1, 2}
    r.observe(np.array([[1.0, 0.0, 6.0, 0.0, 4.0, 3.0]]))
    swaps = r.rebalance()
    # Expert 2 (helper) goes to VRAM, expert 0 takes its helper slot; expert 4 then replaces expert 1 in the
    # helper tier, and expert 0, just moved there, is spared although expert 5 beats it.
    assert [(s.tier, s.loaded, s.evicted) for s in swaps] == [
        (VRAM, (0, 2), (0, 0)),
        (HELPER, (0, 4), (0, 1)),
    ]
    assert r.tiers().tolist() == [[HELPER, HOST, VRAM, HOST, HELPER, HOST]]


def test_fixed_layers_keep_their_helper_slots_too():
    r = Residency(2, 8, 4, 1, Policy(every=1, margin=0.0), fixed=frozenset({1}), helper_slots=6)
    start = r.helper_of[1].copy(), r.slot_of[1].copy()
    counts = np.zeros((2, 8))
    counts[:, 5:] = 10
    for _ in range(4):
        r.observe(counts)
        r.rebalance()
    assert (r.helper_of[1] == start[0]).all() and (r.slot_of[1] == start[1]).all()
    assert all(r.tier(0, e) != HOST for e in (5, 6, 7)), "the other layer followed the routing"


def test_each_assignment_is_counted_in_the_tier_that_served_it():
    r = Residency(1, 6, 2, 100, Policy(adapt=False), helper_slots=2)  # VRAM {0, 1}, helper {2, 3}
    r.observe(np.array([[1.0, 2.0, 3.0, 0.0, 4.0, 5.0]]))
    s = r.stats
    assert (s.hits, s.helper_hits, s.host_reads, s.misses) == (3, 3, 9, 12)
    assert s.miss_bytes == 900 and s.helper_bytes == 300
    r.observe(np.array([[1.0, 0, 0, 0, 0, 0]]), reads=Reads(helper=1, host=0))  # as counted on the device
    assert (s.hits, s.helper_hits, s.host_reads) == (3, 4, 9)
    d = s.as_dict()
    assert d["peer_bytes"] == d["helper_bytes"] + d["peer_swap_bytes"] == 400
    assert d["hit_rate"] == pytest.approx(3 / 16)


@pytest.mark.parametrize("helper", [0, 4, 12])
def test_the_store_hands_out_the_host_tiers_weights_from_every_tier(helper):
    rng = np.random.default_rng(3)
    gate_up = [rng.standard_normal((6, 8, 4)).astype(np.float32) + 0.5 for _ in range(3)]  # [E, 2I, H]
    down = [rng.standard_normal((6, 4, 4)).astype(np.float32) - 0.5 for _ in range(3)]  # [E, H, I]
    helpers = [(Device("cpu", 1), helper // 2), (Device("cpu", 2), helper - helper // 2)]
    store = ExpertStore(
        Device("cpu", 0), [1, 2, 3], gate_up, down, 5, Policy(every=1, margin=0.0), helpers=helpers
    )
    assert store.helper_slots == min(helper, 13)  # never more than the experts VRAM lacks
    seen = set()
    for _ in range(10):
        store.observe(rng.poisson(1.5, (3, 6)).astype(np.float64))
        for j in range(3):
            for e in range(6):
                gu, dn = store.weights(j, e)
                np.testing.assert_array_equal(gu, gate_up[j][e])
                np.testing.assert_array_equal(dn, down[j][e])
                tier = store.tier(j, e)
                seen.add(tier)
                if tier == HELPER:
                    pool = store.helper.pools[store.helper._where[int(store.residency.helper_of[j, e])][0]]
                    assert np.shares_memory(gu, pool[1]), "a helper-tier expert is read from its helper slot"
    assert seen == ({VRAM, HOST} | ({HELPER} if helper else set()))
    if helper:
        assert store.stats.helper_hits > 0 and store.stats.peer_swap_bytes > 0


def test_helper_gpus_are_shared_among_the_stages_in_proportion_to_what_they_lack():
    assert proportional(10, [2, 8]) == [2, 8]
    assert proportional(7, [3, 3, 1]) == [3, 3, 1]
    assert proportional(4, [5, 5, 2]) == [2, 2, 0]  # equal remainders: the earlier first
    assert proportional(5, [1, 3, 6]) == [1, 1, 3]
    plan = make_plan(preset="small", stages=3, expert_cache=3, helpers=2, helper_vram_mib=3)
    shares = helper_slots(plan)
    lacking = [16 - 3, 16 - 3, 32 - 3]
    for gpu in plan.gpus[3:]:
        got = [n for parts in shares for d, n in parts if d == gpu.device]
        assert sum(got) == gpu.experts_resident > 0
    totals = [sum(n for _, n in parts) for parts in shares]
    assert all(t <= lack for t, lack in zip(totals, lacking, strict=True))
    assert totals[2] > totals[0], "the stage lacking most gets most"


# ---- through the engine ------------------------------------------------------------------------------


@functools.cache
def engine(preset: str, stages: int, mode: str, cache: int | None, helper: str | None, vram: int) -> Engine:
    kw = {"helpers": 1} if helper == "helper" else {"peer": True} if helper == "peer" else {}
    return Engine(cache_plan(preset, stages, mode, cache, helper_vram_mib=vram, **kw))


SETUPS = [  # (preset, stages, mode, helper kind): the resolver allows no peer device on a split, and no
    # batch MTP on a split with helpers
    ("tiny", 1, "solo", "peer"),
    ("tiny", 1, "batch-mtp", "helper"),
    ("tiny", 2, "serial", "helper"),
    ("small", 1, "serial", "peer"),
    ("small", 2, "pipelined", "helper"),
    ("small", 3, "serial", "helper"),
]


@pytest.mark.parametrize(("preset", "stages", "mode", "helper"), SETUPS)
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=arrivals, cache=st.sampled_from([0, 3]), vram=st.sampled_from([1, 2, 64]))
def test_greedy_text_with_any_split_across_the_three_tiers_equals_the_all_resident_run(
    preset, stages, mode, helper, schedule, cache, vram
):
    requests = [(at, Request(prompt(n, i), m, request_id=f"r{i}")) for i, (at, n, m) in enumerate(schedule)]
    tiered = engine(preset, stages, mode, cache, helper, vram)
    assert any(stage.experts.helper_slots for stage in tiered.model.stages)
    assert collect(tiered, requests) == collect(engine(preset, stages, mode, None, None, 1), requests)
    for stage in tiered.model.stages:
        assert_each_expert_reads_its_own_weights(stage.experts)


def assert_each_expert_reads_its_own_weights(store: ExpertStore) -> None:
    """Wherever an expert is, what the array path reads for it is its host copy (a synthetic model's layers
    add little to the residual, so a misplaced expert need not change a greedy token)."""
    for j in range(len(store)):
        for e in range(store.n_experts):
            for got, want in zip(store.weights(j, e), store.host_weights(j, e), strict=True):
                np.testing.assert_array_equal(got, want)


def test_every_tier_serves_its_share_and_the_engine_reports_it():
    eng = engine("small", 2, "serial", 3, "helper", 2)
    collect(eng, [(0, Request(prompt(30, 1), 16)), (1, Request(prompt(12, 2), 12))])
    report = eng.stats()["experts"]
    helper_gpu = eng.plan.gpus[2]
    assert helper_gpu.role == "helper"
    assert sum(r["helper_slots"] for r in report) == helper_gpu.experts_resident == 5
    for r, stage in zip(report, eng.model.stages, strict=True):
        store = stage.experts
        assert r["helper_devices"] == ({"cpu:2": store.helper_slots} if store.helper_slots else {})
        assert r["hits"] + r["misses"] == r["hits"] + r["helper_hits"] + r["host_reads"]
        assert r["helper_bytes"] == r["helper_hits"] * store.expert_bytes
        assert r["miss_bytes"] == r["host_reads"] * store.expert_bytes
        if store.helper_slots:
            assert r["hits"] > 0 and r["helper_hits"] > 0 and r["host_reads"] > 0
            assert isinstance(store.helper.slot(0)[0], np.ndarray)  # arrays of the helper cpu:N
    line = next(line for line in eng.startup if line.startswith("expert cache on cpu:1"))
    assert "more in the helper tier" in line and "on cpu:2" in line


def test_a_helper_tier_that_holds_every_missing_expert_leaves_host_memory_unread():
    eng = engine("tiny", 2, "serial", 3, "helper", 64)
    collect(eng, [(0, Request(prompt(20, 3), 12))])
    for stage in eng.model.stages:
        s = stage.experts.stats
        assert s.host_reads == 0 and s.miss_bytes == 0 and s.helper_hits > 0


def test_the_peer_device_holds_exactly_the_plans_experts_for_the_one_stage():
    plan = make_plan(preset="small", expert_cache=3, peer=True, helper_vram_mib=2)
    [stage] = Engine(plan).model.stages
    peer = plan.gpus[1]
    assert plan.experts.peer_device == peer.index and peer.experts_resident > 0
    assert stage.experts.helper_slots == peer.experts_resident
    assert stage.experts.helper.nbytes == peer.budget.experts


# ---- the CUDA path's Python --------------------------------------------------------------------------


@pytest.fixture
def fake_gpu():
    from fake_cupy import installed

    with installed(), np.errstate(all="ignore"):  # rows no kernel writes are NaN: quiet
        yield


def cuda_plan(**kw):
    from rt_plans import float16_profile_text

    from strata_cfg.plan.from_profile import resolve_text

    text = float16_profile_text(preset="small", context=256, prefill_chunk=96, **kw)
    return resolve_text(text, "cuda-tiers.toml").plan


GENERATED = 20
"""Tokens each of `greedy`'s requests generates: enough windows for the cache to move experts both ways."""


def greedy(plan) -> tuple[list[list[int]], Engine]:
    engine = Engine(plan)
    prompts = [tuple(range(40, 140)), (72, 101, 108, 108, 111) * 3, tuple(range(90, 60, -1))]  # 100: prefill
    handles = [engine.submit(Request(p, GENERATED)) for p in prompts]
    while engine.step():
        pass
    return [[t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in handles], engine


def assert_tables_point_where_each_expert_is(stage) -> None:
    """The device tables give each expert the address of its VRAM slot, helper slot or host copy, with the
    tier code the kernels count by; and the bytes at that address are the expert's."""
    store, tables = stage.experts, stage.cuda_experts
    r = store.residency
    codes = np.asarray(tables.slot_of)
    np.testing.assert_array_equal(
        codes, np.where(r.slot_of >= 0, r.slot_of, np.where(r.helper_of >= 0, -2 - r.helper_of, -1))
    )
    for j in range(len(store)):
        for e in range(store.n_experts):
            tier = store.tier(j, e)
            gate_up, down = store.host_weights(j, e) if tier == HOST else store.slot_weights(j, e)
            assert (
                int(tables.gate_up[j, e]) == gate_up.ctypes.data
                and int(tables.down[j, e]) == down.ctypes.data
            )
            if tier == HELPER:
                assert store.helper.device_of(int(r.helper_of[j, e])) != store.device
            at_gu, at_dn = tables.layers[j].weights(e)  # what the stand-in kernels read there
            np.testing.assert_array_equal(at_gu, store.host_weights(j, e)[0])
            np.testing.assert_array_equal(at_dn, store.host_weights(j, e)[1])


@pytest.mark.parametrize(
    ("kw", "helper"),
    [
        (
            {"stages": 1, "peer": True, "slots": 4, "groups": 1, "batch_mtp": True, "draft_tokens": 3},
            "cuda:1",
        ),
        ({"stages": 2, "helpers": 1, "slots": 2, "groups": 2, "draft_tokens": 3}, "cuda:2"),
    ],
    ids=["peer-batch-mtp", "helper-pipelined"],
)
def test_the_cuda_path_reads_the_helper_tier_through_its_tables_and_changes_no_token(fake_gpu, kw, helper):
    """Decode graphs, the prefill path (a 100-row chunk) and the MTP head over a cache whose experts are
    split across VRAM, a helper GPU and host memory: greedy text equals the all-resident run's, every tier
    served, exchanges moved experts both ways, and the tables point where each expert is."""
    resident, _ = greedy(cuda_plan(**kw))
    tiered, engine = greedy(cuda_plan(expert_cache=5, helper_vram_mib=1, **kw))
    assert tiered == resident and all(len(t) == GENERATED for t in tiered)
    assert f"peer access cuda:0 -> {helper}: enabled" in engine.startup
    for stage in engine.model.stages:
        assert stage.cuda_experts is not None and stage.experts.helper_slots > 0
        assert {str(d) for d in stage.experts.helper.devices} == {helper}
        s = stage.experts.stats
        assert s.hits > 0 and s.helper_hits > 0 and s.host_reads > 0
        assert s.helper_swaps > 0 and s.peer_swap_bytes > 0, "experts moved into both tiers"
        assert_tables_point_where_each_expert_is(stage)


def test_a_helper_the_stage_gpu_cannot_read_directly_is_refused_naming_the_key(fake_gpu):
    import cupy

    runtime = cupy.cuda.runtime
    can = runtime.deviceCanAccessPeer
    runtime.deviceCanAccessPeer = lambda a, b: {a, b} != {0, 1}
    try:
        with pytest.raises(
            PlanMismatch, match=r"experts\.peer_device = 1: cuda:0 cannot read cuda:1's memory"
        ):
            Engine(cuda_plan(expert_cache=5, peer=True, helper_vram_mib=1))
    finally:
        runtime.deviceCanAccessPeer = can


def test_the_kernels_count_each_assignment_in_the_tier_that_served_it(fake_gpu):
    """Decode graphs only (short prompts), a frozen cache: what the device counters hand to the cache, window
    after window, is exactly each expert's count in its tier (VRAM, helper, host)."""
    engine = Engine(cuda_plan(expert_cache=4, peer=True, helper_vram_mib=1, adapt=False, slots=2, groups=1))
    [stage] = engine.model.stages
    store = stage.experts
    tiers = store.residency.tiers()
    handed = handed_to_cache(store)
    handles = [engine.submit(Request(p, 20)) for p in (tuple(range(40, 60)), (72, 101, 108, 108, 111))]
    while engine.step():
        pass
    assert all(h.events.qsize() for h in handles)
    assert_reads_by_tier(handed, tiers)
    assert (store.residency.tiers() == tiers).all()
    s = store.stats
    assert s.hits > 0 and s.helper_hits > 0 and s.host_reads > 0 and s.swaps == 0


def test_a_prompt_chunks_routing_reaches_the_cache_at_the_next_window_and_all_of_it_once_idle(
    fake_gpu, monkeypatch
):
    """A prompt chunk through the prefill path counts its routing into the device counters, which are read
    at once, not after the cache's usual number of windows: the next window hands the chunk's every
    assignment to the cache. When the engine runs out of work it hands over the rest, so the cache has
    seen each row's k experts in every layer exactly once, in the tier that served it."""
    from strata_runtime.model.stage import Stage

    plan = cuda_plan(
        expert_cache=4, peer=True, helper_vram_mib=1, adapt=False, slots=1, groups=1, prefill_chunk_alone=96
    )
    engine = Engine(plan)
    [stage] = engine.model.stages
    store, tables = stage.experts, stage.cuda_experts
    assert tables is not None and stage.cuda_prefill is not None
    tiers = store.residency.tiers()
    handed = handed_to_cache(store)
    rows: list[int] = []
    forward = Stage.forward
    monkeypatch.setattr(
        Stage,
        "forward",
        lambda self, hidden, layout, *a, **k: (
            rows.append(layout.rows) or forward(self, hidden, layout, *a, **k)
        ),
    )
    engine.submit(Request(tuple(range(40, 140)), 12))  # its first chunk: 96 rows through the prefill path
    assert engine.step() and rows == [96] and not handed
    engine.step()
    per_row = engine.model.args.num_experts_per_tok * len(store)
    assert len(handed) == 1 and handed[0][0].sum() == 96 * per_row
    while engine.step():
        pass
    assert tables._read_done is None and tables._windows == 0  # nothing left unread
    assert sum(counts.sum() for counts, _ in handed) == sum(rows) * per_row
    assert_reads_by_tier(handed, tiers)


def test_a_prompt_chunks_hand_over_rebalances_the_cache_on_the_cuda_path(fake_gpu):
    """With rebalances otherwise far apart, the hand-over of a prompt chunk's counts (at the window after it)
    moves the experts the prompt routed to into VRAM at once, where the cache swaps."""
    policy = {"rebalance_every": 1000, "keep_misses": False}
    plan = cuda_plan(expert_cache=4, slots=1, groups=1, prefill_chunk_alone=96, cache_policy=policy)
    engine = Engine(plan)
    [stage] = engine.model.stages
    store = stage.experts
    engine.submit(Request(tuple(range(40, 140)), 12))  # its first chunk: 96 rows through the prefill path
    engine.step()
    assert store.stats.swaps == 0
    engine.step()  # hands the chunk's counts over
    assert store.stats.swaps > 0
    assert_tables_point_where_each_expert_is(stage)


def test_a_restored_cache_on_the_cuda_path_forgets_the_reads_counted_before(fake_gpu):
    """Benchmark arms share a stage's cache and each starts from a restore: what an arm counted (routing and
    the reads each tier served) must not be handed to the cache in the next arm's first window."""
    engine = Engine(cuda_plan(expert_cache=4, peer=True, helper_vram_mib=1, adapt=False, slots=2, groups=1))
    [stage] = engine.model.stages
    tables, store = stage.cuda_experts, stage.experts
    start = engine.expert_state()
    every = store.residency.policy.every
    tables.counts[0, 1] = 3.0  # what an arm's windows counted on the device
    tables.misses[0, :2] = (7.0, 2.0)
    for _ in range(every):  # the last one queues the counters' read, not yet handed over
        tables.after_window()
    engine.restore_experts(start)
    handed = handed_to_cache(store)
    tables.counts[0, 2] = 1.0  # the next arm's first window
    for _ in range(every + 1):
        tables.after_window()
    [(got, reads)] = handed
    want = np.zeros((len(store), store.n_experts))
    want[0, 2] = 1.0
    np.testing.assert_array_equal(got, want)
    assert reads == Reads(0, 0)


def test_the_warm_up_over_a_tiered_cache_changes_no_token_and_captures_every_stages_windows(fake_gpu):
    """`Engine.warm_up` on two stages whose experts are split across VRAM, a helper GPU and host memory: its
    windows of every row count (zeros as slot 0 among them) leave the greedy text of the all-resident run,
    every stage's windows replay graphs, and the tables still point where each expert is."""
    from strata_cfg.schema.windows import MAX_WINDOW_ROWS

    kw = {"stages": 2, "helpers": 1, "slots": 2, "groups": 2, "draft_tokens": 3}
    resident, _ = greedy(cuda_plan(**kw))
    engine = Engine(cuda_plan(expert_cache=5, helper_vram_mib=1, **kw))
    assert engine.warm_up() > 0
    every = frozenset(range(1, MAX_WINDOW_ROWS + 1))
    assert all(stage.cuda.captured == every for stage in engine.model.stages)
    prompts = [tuple(range(40, 140)), (72, 101, 108, 108, 111) * 3, tuple(range(90, 60, -1))]
    handles = [engine.submit(Request(p, GENERATED)) for p in prompts]
    while engine.step():
        pass
    warmed = [[t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in handles]
    assert warmed == resident
    for stage in engine.model.stages:
        assert_tables_point_where_each_expert_is(stage)
