"""The expert cache's bookkeeping and weight placement, on the CPU.

`Residency` must keep its slot table a bijection between slots and resident experts whatever the routing,
adapt to what the routing uses (a hot set that fits ends up resident), respect its margin and swap bound,
and freeze when told. `ExpertStore` must hand out, for every expert at every moment, exactly the weights the
host tier holds for it, whether it sits in a slot or not.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_cfg.schema import facts
from strata_cfg.schema.facts import mtp_experts_whole
from strata_runtime.backend import Device
from strata_runtime.experts.cache import Policy, Residency, even_fill
from strata_runtime.experts.store import ExpertStore


def check_bijection(r: Residency) -> None:
    """Each tier's table (VRAM, helper) is a bijection onto its slots, the owners agree, and no expert is in
    both."""
    for table, owner, slots in ((r.slot_of, r.owner, r.slots), (r.helper_of, r.helper_owner, r.helper_slots)):
        assert int((table >= 0).sum()) == slots, "every slot holds exactly one expert"
        assert sorted(table[table >= 0].tolist()) == list(range(slots)), "no slot is held twice"
        for slot, (j, e) in enumerate(owner.tolist()):
            assert table[j, e] == slot, "owner and table agree"
    assert not ((r.slot_of >= 0) & (r.helper_of >= 0)).any(), "an expert is in one tier of slots at most"


@pytest.mark.parametrize(("layers", "experts", "slots"), [(3, 8, 5), (4, 8, 16), (2, 128, 77), (1, 4, 0)])
def test_even_fill_spreads_the_slots_over_the_layers(layers, experts, slots) -> None:
    table = even_fill(layers, experts, slots)
    per_layer = (table >= 0).sum(axis=1)
    assert per_layer.sum() == slots
    assert per_layer.max() - per_layer.min() <= 1
    assert sorted(table[table >= 0].tolist()) == list(range(slots))


@pytest.mark.parametrize(
    ("layers", "experts", "slots", "whole"), [(5, 8, 20, {4}), (9, 16, 100, {0, 8}), (3, 4, 4, {1})]
)
def test_even_fill_holds_the_whole_layers_and_spreads_the_rest(layers, experts, slots, whole) -> None:
    table = even_fill(layers, experts, slots, whole)
    per_layer = (table >= 0).sum(axis=1)
    assert all(per_layer[j] == experts for j in whole)
    rest = [int(per_layer[j]) for j in range(layers) if j not in whole]
    assert sum(rest) == slots - len(whole) * experts and max(rest) - min(rest) <= 1
    assert sorted(table[table >= 0].tolist()) == list(range(slots))
    with pytest.raises(ValueError, match="cannot hold"):
        even_fill(layers, experts, len(whole) * experts - 1, whole)


def test_the_mtp_heads_layer_is_held_whole_where_that_costs_at_most_an_eighth_of_the_slots() -> None:
    """A fixed layer never adapts: held whole (9 layers of 8 experts, 64 slots: 8 = an eighth), its experts
    all hit, however the routing moves the other layers; one slot fewer, it gets an even share again, and
    the plan's decision (``whole``) overrides the rule either way."""
    assert mtp_experts_whole(8, 64) and not mtp_experts_whole(8, 63) and not mtp_experts_whole(0, 64)
    r = Residency(9, 8, 64, 1, Policy(every=1, margin=0.0), fixed=frozenset({8}))
    assert (r.slot_of[8] >= 0).all() and (r.slot_of[:8] >= 0).sum() == 56
    counts = np.zeros((9, 8))
    counts[:, 4:] = 10  # the experts the even fill left out of the main layers (7 a layer: 0..6)
    for _ in range(4):
        r.observe(counts)
        assert all(s.loaded[0] != 8 and (s.evicted is None or s.evicted[0] != 8) for s in r.rebalance())
    assert (r.slot_of[8] >= 0).all()
    check_bijection(r)
    before = r.stats.misses
    r.observe(counts)
    assert r.stats.misses == before  # the main layers learned experts 4..7, the MTP head's are all there
    assert (Residency(9, 8, 63, 1, Policy(), fixed=frozenset({8})).slot_of[8] >= 0).sum() == 7
    assert (
        Residency(9, 8, 64, 1, Policy(), fixed=frozenset({8}), whole=False).slot_of[8] >= 0
    ).sum() == 8 - 1
    assert (Residency(9, 8, 40, 1, Policy(), fixed=frozenset({8}), whole=True).slot_of[8] >= 0).all()
    assert (Residency(9, 8, 7, 1, Policy(), fixed=frozenset({8}), whole=True).slot_of[8] >= 0).sum() == 0


def test_an_engine_with_its_mtp_heads_experts_held_whole_gives_the_requests_text(monkeypatch) -> None:
    """The demo model's MTP head under a cache of 20 of its 40 experts, with the share a whole fixed layer
    may take raised to a half: the head's layer holds all 8 of its experts, the main layers 3 each, and the
    greedy text with drafting is the request's alone."""
    from rt_engine_helpers import collect
    from rt_plans import make_plan
    from test_rt_engine import model_source, reference

    from strata_runtime.api import Request
    from strata_runtime.engine import Engine

    monkeypatch.setattr(facts, "MTP_WHOLE_MOST", 0.5)
    plan = make_plan(
        slots=1, draft_tokens=2, context=128, prefill_chunk=32, expert_cache=20, **model_source("austen")
    )
    eng = Engine(plan)
    r = eng.model.stages[-1].experts.residency
    assert r.fixed == {4} and (r.slot_of >= 0).sum(axis=1).tolist() == [3, 3, 3, 3, 8]
    prompt = tuple(b"She said to her sister that")
    assert tuple(collect(eng, [(0, Request(prompt, 24))])[0]) == reference("austen", prompt, 24)
    assert sum(w.proposals for w in eng.windows) > 0  # the head drafted, through its slots
    assert (r.slot_of[4] >= 0).all() and r.stats.misses > 0  # the main layers missed, the head's layer stayed


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    layers=st.integers(1, 4),
    experts=st.integers(2, 16),
    fill=st.floats(0.0, 0.95),
    helper_fill=st.sampled_from([0.0, 0.3, 1.0]),
    windows=st.integers(1, 30),
    margin=st.sampled_from([0.0, 0.5, 2.0]),
    max_swaps=st.integers(1, 8),
)
def test_the_slot_tables_stay_bijections_whatever_the_routing(
    seed, layers, experts, fill, helper_fill, windows, margin, max_swaps
) -> None:
    """With or without a helper tier (``helper_fill``: its share of the experts VRAM lacks)."""
    rng = np.random.default_rng(seed)
    slots = int(layers * experts * fill)
    helper = int((layers * experts - slots) * helper_fill)
    policy = Policy(every=2, margin=margin, max_swaps=max_swaps)
    r = Residency(layers, experts, slots, 100, policy, helper_slots=helper)
    for _ in range(windows):
        counts = rng.poisson(rng.uniform(0.1, 3.0, (layers, experts))).astype(np.float64)
        r.observe(counts)
        if r.due():
            before = r.scores.copy()
            swaps = r.rebalance()
            assert all(sum(s.tier == tier for s in swaps) <= max_swaps for tier in (0, 1)), "per tier"
            for s in swaps:
                assert before[s.loaded] >= before[s.evicted] + margin, (
                    "a swap beats the evicted by the margin"
                )
        check_bijection(r)


def test_a_hot_set_that_fits_ends_up_resident_and_every_assignment_hits() -> None:
    rng = np.random.default_rng(7)
    layers, experts, slots = 3, 16, 18  # 6 slots a layer at the start
    hot = [rng.choice(experts, size=5, replace=False) for _ in range(layers)]  # 15 hot experts in all
    r = Residency(layers, experts, slots, 1000, Policy(every=4))
    for _ in range(12):
        counts = np.zeros((layers, experts))
        for j in range(layers):
            counts[j, hot[j]] = rng.integers(1, 4, size=5)
        r.observe(counts)
        if r.due():
            r.rebalance()
    for j in range(layers):
        assert all(r.resident(j, int(e)) for e in hot[j])
    before = r.stats.misses
    counts = np.zeros((layers, experts))
    for j in range(layers):
        counts[j, hot[j]] = 1
    r.observe(counts)
    assert r.stats.misses == before, "once adapted, the hot set is served from VRAM"
    assert r.stats.miss_bytes == r.stats.misses * 1000


def test_a_frozen_cache_never_swaps_and_misses_what_it_does_not_hold() -> None:
    r = Residency(2, 8, 4, 10, Policy(adapt=False))
    start = r.slot_of.copy()
    counts = np.zeros((2, 8))
    counts[:, 6:] = 5  # only experts the initial fill left out
    for _ in range(10):
        r.observe(counts)
        assert r.rebalance() == []
    assert (r.slot_of == start).all()
    assert r.stats.hits == 0 and r.stats.misses == 10 * 20
    assert r.stats.hit_rate == 0.0


def test_swaps_prefer_the_strongest_newcomer_and_the_weakest_resident() -> None:
    r = Residency(1, 6, 3, 1, Policy(every=1, margin=0.0, max_swaps=1))  # experts 0, 1, 2 resident
    r.observe(np.array([[5.0, 0.0, 3.0, 1.0, 9.0, 0.0]]))
    [swap] = r.rebalance()
    assert swap.loaded == (0, 4) and swap.evicted == (0, 1)
    check_bijection(r)


def _store(slots: int | None, seed: int = 3) -> tuple[ExpertStore, list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    gate_up = [rng.standard_normal((6, 8, 4)).astype(np.float32) + 0.5 for _ in range(3)]  # [E, 2I, H]
    down = [rng.standard_normal((6, 4, 4)).astype(np.float32) - 0.5 for _ in range(3)]  # [E, H, I]
    store = ExpertStore(Device("cpu", 0), [1, 2, 3], gate_up, down, slots, Policy(every=1, margin=0.0))
    return store, gate_up, down


@pytest.mark.parametrize("slots", [None, 18, 7, 1])
def test_the_store_always_hands_out_the_host_tiers_weights(slots) -> None:
    store, gate_up, down = _store(slots)
    rng = np.random.default_rng(11)
    assert store.cached == (slots is not None and slots < 18)
    for _ in range(8):
        counts = rng.poisson(1.5, (3, 6)).astype(np.float64)
        store.observe(counts)
        for j in range(3):
            for e in range(6):
                gu, dn = store.weights(j, e)
                np.testing.assert_array_equal(gu, gate_up[j][e])
                np.testing.assert_array_equal(dn, down[j][e])
                if store.cached and store.resident(j, e):
                    assert not np.shares_memory(gu, gate_up[j]), "a resident expert is read from its slot"
    if store.cached:
        assert store.stats.swaps > 0, "the routing moved the cache"
        assert store.vram_bytes == store.slots * store.expert_bytes
        assert store.host_bytes == 18 * store.expert_bytes


def test_fixed_layers_keep_their_first_experts_whatever_the_routing() -> None:
    """The MTP head's layer (run on another stream) never moves, however hot its missing experts get."""
    r = Residency(3, 8, 9, 1, Policy(every=1, margin=0.0), fixed=frozenset({2}))
    start = r.slot_of[2].copy()
    counts = np.zeros((3, 8))
    counts[:, 5:] = 10  # experts the initial fill left out, in every layer
    for _ in range(6):
        r.observe(counts)
        swaps = r.rebalance()
        assert all(s.loaded[0] != 2 and (s.evicted is None or s.evicted[0] != 2) for s in swaps)
    assert (r.slot_of[2] == start).all()
    assert all(r.resident(j, e) for j in (0, 1) for e in (5, 6, 7))  # the others did follow the routing
    check_bijection(r)


def test_a_prompt_chunk_brings_a_rebalance_at_once_and_other_windows_wait_their_turn() -> None:
    """A prompt chunk's counts show what the request uses: the rebalance is due right after them, not
    ``every`` windows later (unless the policy says otherwise), and the count toward the next one restarts."""
    counts = np.zeros((2, 8))
    counts[:, 6:] = 40.0  # a prompt routed to experts the initial fill left out
    r = Residency(2, 8, 4, 1, Policy(every=4))
    r.observe(counts, prompt=True)
    assert r.due()
    swaps = r.rebalance()
    assert {s.loaded for s in swaps} == {(0, 6), (0, 7), (1, 6), (1, 7)}
    r.observe(counts)
    assert not r.due(), "an ordinary window waits for the policy's turn"
    late = Residency(2, 8, 4, 1, Policy(every=4, after_prompt=False))
    late.observe(counts, prompt=True)
    assert not late.due()


def test_the_plans_cache_policy_reaches_the_cache_and_its_defaults_are_the_runtimes() -> None:
    """The profile's ``experts`` keys set the policy; left out, the plan's defaults equal `Policy()`'s but for
    keeping misses and the decay that goes with it (a `Policy()` swaps, as the simulation's baseline), so
    the resolver's documented defaults are the ones that run; swapping, the decay is `Policy()`'s."""
    from rt_plans import make_plan

    from strata_runtime.model import Model

    kw = dict(preset="small", context=64, prefill_chunk=16, expert_cache=4)
    roomy = {**kw, "expert_cache": 32}  # 8 slots a layer of the stage's 4 x 16 experts: twice top-4
    assert Policy.of(make_plan(**roomy).experts) == Policy(keep_misses=True, decay=0.95)
    # One slot fewer, or the 4 of `kw`, is under twice top-k a layer: the cache swaps (rule
    # experts.keep-misses-small-cache), at the swapping decay.
    assert Policy.of(make_plan(**{**kw, "expert_cache": 31}).experts) == Policy()
    assert Policy.of(make_plan(**kw).experts) == Policy()
    assert Policy.of(make_plan(cache_policy={"keep_misses": False}, **roomy).experts) == Policy()
    keys = {
        "score_decay": 0.5,
        "rebalance_every": 3,
        "swap_margin": 1.5,
        "max_swaps": 7,
        "keep_misses": False,
    }
    [stage] = Model.from_plan(make_plan(cache_policy=keys, **kw)).stages
    assert stage.experts.residency.policy == Policy(decay=0.5, every=3, margin=1.5, max_swaps=7)


def test_at_most_max_swaps_move_at_a_rebalance_and_only_newcomers_that_beat_the_margin() -> None:
    """A prompt chunk routed to more new experts than ``max_swaps`` moves only the strongest of them in, and
    none whose score falls short of the evicted one's by the margin."""
    counts = np.zeros((1, 16))
    counts[0, 8:] = [9, 8, 7, 6, 5, 4, 2.5, 2.0]  # experts 0..7 resident with score 0
    r = Residency(1, 16, 8, 1, Policy(every=4, margin=3.0, max_swaps=4))
    r.observe(counts, prompt=True)
    assert [s.loaded for s in r.rebalance()] == [(0, 8), (0, 9), (0, 10), (0, 11)]
    r2 = Residency(1, 16, 8, 1, Policy(every=4, margin=3.0, max_swaps=16))
    r2.observe(counts, prompt=True)
    assert [s.loaded[1] for s in r2.rebalance()] == [8, 9, 10, 11, 12, 13]  # 2.5 and 2.0 fall short of 3


def test_a_rebalance_cut_at_max_swaps_goes_on_the_next_window_until_nothing_more_pays() -> None:
    """A prompt routed to more new experts than ``max_swaps`` moves them over several windows, the strongest
    first, one rebalance a window while more would pay (`Residency.backlog`), then waits ``every`` windows
    again; the experts that fall short of the margin never move."""
    counts = np.zeros((1, 16))
    counts[0, 8:] = [9, 8, 7, 6, 5, 4, 2.5, 2.0]  # experts 0..7 resident with score 0
    r = Residency(1, 16, 8, 1, Policy(every=4, margin=3.0, max_swaps=4, decay=1.0))
    r.observe(counts, prompt=True)
    assert [s.loaded[1] for s in r.rebalance()] == [8, 9, 10, 11]
    assert r.backlog and not r.due()
    r.observe(np.zeros((1, 16)))
    assert r.due(), "one window after a rebalance cut short"
    assert [s.loaded[1] for s in r.rebalance()] == [12, 13]  # 2.5 and 2.0 fall short of 3
    assert not r.backlog
    for _ in range(3):
        r.observe(np.zeros((1, 16)))
        assert not r.due()
    r.observe(np.zeros((1, 16)))
    assert r.due() and r.rebalance() == []
    exact = Residency(1, 16, 8, 1, Policy(every=4, margin=3.0, max_swaps=6, decay=1.0))
    exact.observe(counts, prompt=True)
    assert len(exact.rebalance()) == 6 and not exact.backlog, "the cap reached with nothing more to move"


CALIBRATED_REQUESTS = 8
"""Requests of `_calibrated`; the first half settle the cache."""


def _calibrated() -> tuple[list, int, np.random.Generator, list[list[int]]]:
    """Eight requests of 64 tokens under calibrated routing over 12 layers of 128 experts (top-8), seeded;
    the slots of 34% of the experts, the generator (for more traces) and the prompts."""
    from strata_runtime.experts.cache_sim import calibrated_requests
    from strata_runtime.experts.routing import RoutingModel

    layers, experts, k = 12, 128, 8
    g = np.random.default_rng(5)
    model = RoutingModel(layers, experts, k, model_seed=5)
    prompts = [g.integers(0, 32000, int(g.integers(20, 200))).tolist() for _ in range(CALIBRATED_REQUESTS)]
    return calibrated_requests(model, prompts, 64), int(0.34 * layers * experts), g, prompts


def test_a_cap_on_swaps_bounds_the_largest_rebalance_and_costs_little_once_it_goes_on() -> None:
    """On calibrated routing a cap of 32 swaps a rebalance moves at most 32 experts at once (a new
    request's prompt brings a shorter pause) and, going on at the next window, moves within 12% as many
    experts over the host link per token as 512 (without going on: about 19% more)."""
    from strata_runtime.experts.cache_sim import simulate

    calibrated, slots, g, prompts = _calibrated()
    n = CALIBRATED_REQUESTS
    wide = simulate(calibrated, slots, Policy(max_swaps=512), warm=n // 2)
    capped = simulate(calibrated, slots, Policy(max_swaps=32), warm=n // 2)
    assert wide.largest > 32 and capped.largest <= 32
    assert capped.link < 1.12 * wide.link


def test_the_default_policy_moves_fewer_experts_over_the_host_link_than_the_old_one() -> None:
    """On calibrated routing (each request its own hot set) the default policy learns a new request from its
    prompt and moves far fewer experts over the host link per token than the old one (decay 0.7, margin 1,
    at most 32 swaps), and on uniform routing (nothing to learn) it swaps no more than a few per cent."""
    from strata_runtime.experts.cache_sim import simulate, uniform_requests

    calibrated, slots, g, prompts = _calibrated()
    n = CALIBRATED_REQUESTS
    uniform = uniform_requests(g, [len(p) for p in prompts], 64, 12, 128, 8)  # as `_calibrated`'s shape
    old = Policy(decay=0.7, every=4, margin=1.0, max_swaps=32, after_prompt=False)
    new_c, old_c = (simulate(calibrated, slots, p, warm=n // 2) for p in (Policy(), old))
    assert new_c.link < 0.8 * old_c.link and new_c.hit_rate > old_c.hit_rate
    new_u, old_u = (simulate(uniform, slots, p, warm=n // 2) for p in (Policy(), old))
    assert new_u.link < 1.05 * old_u.link


def test_the_simulation_counts_an_expert_a_windows_rows_share_once() -> None:
    """Two streams routed to the same experts: a window's misses are its distinct experts outside VRAM."""
    from strata_runtime.experts.cache_sim import RequestTrace, simulate

    decode = np.full((4, 1, 2), 0)
    decode[:, 0, 1] = 3  # every position routes to experts 0 and 3 of the one layer
    req = RequestTrace(np.zeros((1, 4)), decode)
    out = simulate([req, req], 1, Policy(adapt=False), streams=2)  # expert 0 resident, 3 not
    assert out.hit_rate == 0.5 and out.misses == 0.5 and out.swaps == 0  # one read per window, 2 tokens


def test_a_rebalance_that_lands_late_leaves_the_windows_before_it_reading_its_newcomers_from_host() -> None:
    """A prompt that routes to experts 2 and 3 (of 4, 2 slots holding 0 and 1) brings them in at once; the
    decode windows read them from VRAM from the first, or, with the rebalance landing 3 windows late, from
    host memory in those 3 windows: 2 experts a window, over 8 tokens."""
    from strata_runtime.experts.cache_sim import RequestTrace, simulate

    prompt = np.array([[0.0, 0.0, 50.0, 50.0]])
    decode = np.tile(np.array([2, 3]), (8, 1, 1))  # [T, L, k]
    req = RequestTrace(prompt, decode)
    on_time = simulate([req], 2, Policy())
    late = simulate([req], 2, Policy(), lag=3)
    assert on_time.misses == 0 and on_time.hit_rate == 1.0 and on_time.swaps == late.swaps == 2 / 8
    assert late.misses == 3 * 2 / 8 and late.hit_rate == 1 - 3 / 8
    # The prompt's rebalance landing before the first decode window: on time again, whatever ``lag``.
    assert simulate([req], 2, Policy(), lag=3, prompt_lag=0) == on_time
    with pytest.raises(ValueError, match="lands 0 or more windows after it is decided, not -1"):
        simulate([req], 2, Policy(), lag=3, prompt_lag=-1)


def test_recalled_scores_add_to_the_decayed_ones_and_bring_a_rebalance_without_counting_any_work() -> None:
    """`Residency.recall` adds another moment's scores to the present ones decayed by one window, and the
    rebalance it makes due moves in the experts those scores rank highest; the statistics (what was served)
    do not change. A frozen or complete cache ignores it."""
    rng = np.random.default_rng(4)
    r = Residency(2, 8, 4, 1, Policy(every=4, margin=1.0))
    r.observe(rng.poisson(2.0, (2, 8)).astype(np.float64) + 0.5)
    r.rebalance()
    present, stats = r.scores.copy(), (r.stats.hits, r.stats.misses, r.stats.windows)
    recalled = np.zeros((2, 8))
    recalled[0, [1, 6]] = 50.0  # a conversation's experts, two a layer
    recalled[1, [2, 7]] = 60.0
    assert not r.due()
    r.recall(recalled)
    np.testing.assert_allclose(r.scores, present * 0.9 + recalled)
    assert (r.stats.hits, r.stats.misses, r.stats.windows) == stats
    assert r.due(), "the recall brings a rebalance at once, as a prompt chunk does"
    r.rebalance()
    assert all(r.resident(j, e) for j, e in ((0, 1), (0, 6), (1, 2), (1, 7)))
    check_bijection(r)
    for frozen in (Residency(2, 8, 4, 1, Policy(adapt=False)), Residency(2, 8, 16, 1)):
        before = frozen.scores.copy()
        frozen.recall(recalled)
        np.testing.assert_array_equal(frozen.scores, before)
        assert not frozen.due()


def test_the_store_hands_out_its_scores_and_a_recall_loads_the_experts_it_brings_in() -> None:
    """`ExpertStore.scores` is a copy of what the cache learned (None where nothing adapts), and
    `ExpertStore.recall` of scores taken from another store's routing moves those experts into slots, whose
    weights are the host tier's."""
    store, gate_up, down = _store(7)
    other, _, _ = _store(7)
    counts = np.zeros((3, 6))
    counts[:, 4:] = 9.0  # experts the first fill left out of some layers
    other.observe(counts)
    scores = other.scores()
    assert scores is not None and scores is not other.residency.scores
    swaps = store.recall(scores)
    assert swaps and all(store.resident(j, e) for j in range(3) for e in (4, 5))
    for j, e in ((j, e) for j in range(3) for e in (4, 5)):
        gu, dn = store.weights(j, e)
        np.testing.assert_array_equal(gu, gate_up[j][e])
        np.testing.assert_array_equal(dn, down[j][e])
        assert not np.shares_memory(gu, gate_up[j])
    assert _store(None)[0].scores() is None
    frozen = ExpertStore(Device("cpu", 0), [1], gate_up[:1], down[:1], 2, Policy(adapt=False))
    assert frozen.scores() is None


def _fewest_crossings(windows: list[set[int]], slots: int) -> int:
    """By exhaustive search: the fewest experts that cross the link over ``windows`` (each a set of needed
    experts) with ``slots`` slots, starting empty, each needed expert in no slot crossing once and then
    kept in a slot or not."""
    import itertools

    best = {frozenset(): 0}
    for need in windows:
        nxt: dict[frozenset[int], int] = {}
        for held, cost in best.items():
            step = cost + len(need - held)
            pool = sorted(held | need)
            for size in range(min(slots, len(pool)) + 1):
                for keep in itertools.combinations(pool, size):
                    kept = frozenset(keep)
                    if kept - held <= need and nxt.get(kept, step + 1) > step:
                        nxt[kept] = step
        best = nxt
    return min(best.values())


def test_the_foresight_bound_is_the_fewest_crossings_any_cache_could_make() -> None:
    """`foresight` on small random traces (one layer of 6 experts, 2 a row, 2 or 3 slots) moves exactly as
    few experts as an exhaustive search over every keep-or-evict choice finds; and on calibrated routing it
    is below what the default policy moves, as a bound must be."""
    from strata_runtime.experts.cache_sim import RequestTrace, calibrated_requests, foresight, simulate
    from strata_runtime.experts.routing import RoutingModel

    g = np.random.default_rng(11)
    for case in range(12):
        decode = np.stack([np.sort(g.choice(6, 2, replace=False)) for _ in range(9)])[:, None, :]  # [T, 1, 2]
        slots = 2 + case % 2
        out = foresight([RequestTrace(np.zeros((1, 6)), decode)], slots)
        want = _fewest_crossings([set(row[0].tolist()) for row in decode], slots)
        assert out.misses * len(decode) == pytest.approx(want), case
        assert out.swaps == 0
    layers, experts, k, n = 12, 128, 8, 8
    model = RoutingModel(layers, experts, k, model_seed=5)
    prompts = [g.integers(0, 32000, int(g.integers(20, 200))).tolist() for _ in range(n)]
    calibrated = calibrated_requests(model, prompts, 64)
    slots = int(0.34 * layers * experts)
    bound, default = (
        foresight(calibrated, slots, warm=n // 2),
        simulate(calibrated, slots, Policy(), warm=n // 2),
    )
    assert bound.link < default.link and bound.hit_rate > default.hit_rate


def test_kernels_that_keep_what_they_read_keep_the_expert_used_more() -> None:
    """`filled_on_miss` with one slot: expert 0 (used twice) is kept over expert 1 (used once since), so the
    third use of 0 is a hit; with a decay that forgets at once, each newcomer scores no lower than the one
    held and so is kept. On calibrated routing at 34% in VRAM it reads fewer experts over the link than the
    default policy moves, and no fewer than the foresight bound."""
    from strata_runtime.experts.cache_sim import (
        RequestTrace,
        filled_on_miss,
        foresight,
        simulate,
    )

    decode = np.array([0, 0, 1, 0]).reshape(4, 1, 1)  # [T, L, k]: one layer, one expert a row
    req = RequestTrace(np.zeros((1, 2)), decode)
    kept = filled_on_miss([req], 1, 1.0)  # reads: 0 (kept), hit, 1 (score 1 < 2: read only), hit
    assert kept.misses == 2 / 4 and kept.hit_rate == 2 / 4
    forgetful = filled_on_miss([req], 1, 0.0)  # 1 replaces 0, then 0 replaces 1
    assert forgetful.misses == 3 / 4
    calibrated, slots, g, prompts = _calibrated()
    n = CALIBRATED_REQUESTS
    filled = filled_on_miss(calibrated, slots, 0.95, warm=n // 2)
    default = simulate(calibrated, slots, Policy(), warm=n // 2)
    assert foresight(calibrated, slots, warm=n // 2).link < filled.link < default.link


def test_the_admission_rule_keeps_missing_experts_in_usable_victims_slots_in_order() -> None:
    """`admit` (the rule the GPU's ``moe_admit`` runs): the missing experts, in id order, take the usable
    queued slots in queue order; a victim that no longer holds its slot, or that this window routes to in
    the same layer, is passed over; ``taken`` moves past the last entry used, or past every entry looked
    at when too few were usable; experts already held or in a helper slot (code below -1) take none."""
    from strata_runtime.reference.keep import LOOKED_AT, Victims, admit

    slot_of = np.full((3, 8), -1, np.int32)
    slot_of[0, :4] = [0, 1, 2, 3]
    slot_of[1, :3] = [4, 5, 6]
    slot_of[2, 5] = -3  # a helper slot
    keys = [1 * 8 + 0, 0 * 8 + 2, 1 * 8 + 7, 0 * 8 + 3, 1 * 8 + 1, 0 * 8 + 0]
    slots = [4, 2, 9, 3, 5, 0]  # the third entry is stale: expert (1, 7) holds no slot
    queue = Victims(np.array(slots, np.int32), np.array(keys, np.int32), 0)
    # Layer 0 routes to 2 (held), 5, 6 (missing) and 3 (held, so its entry is passed over).
    moves = admit(slot_of, 0, np.array([6, 2, 5, 3, 5]), queue)
    assert moves == [(4, (1, 0), (0, 5)), (5, (1, 1), (0, 6))]
    assert queue.taken == 5
    assert slot_of[1, 0] == slot_of[1, 1] == -1 and slot_of[0, 5] == 4 and slot_of[0, 6] == 5
    assert slot_of[0, 2] == 2 and slot_of[0, 3] == 3  # routed here: kept their slots
    # Too few usable entries left: one expert kept, the rest not, and the queue is used up.
    moves = admit(slot_of, 2, np.array([1, 2, 5]), queue)
    assert moves == [(0, (0, 0), (2, 1))] and queue.taken == len(slots)
    assert slot_of[2, 5] == -3 and slot_of[2, 2] == -1
    assert admit(slot_of, 1, np.array([3]), queue) == []  # nothing left to take
    # At most LOOKED_AT entries are looked at: past them, nothing is usable this window.
    stale = Victims(np.full(LOOKED_AT + 1, 7, np.int32), np.full(LOOKED_AT + 1, 8 * 2 + 7, np.int32), 0)
    stale.slot[-1], stale.key[-1] = 6, 8 * 1 + 2
    assert admit(slot_of, 0, np.array([7]), stale) == [] and stale.taken == LOOKED_AT
    assert admit(slot_of, 0, np.array([7]), stale) == [(6, (1, 2), (0, 7))]


def test_keeping_misses_moves_fewer_experts_over_the_link_than_swapping_under_calibrated_routing() -> None:
    """The cache's own bookkeeping replayed on calibrated traces at 34% of the experts: keeping what the
    kernels read copies nothing, and crosses the link less than the default policy's misses and swaps,
    above the `foresight` bound; every decode window's misses are counted before the admission."""
    from strata_runtime.experts.cache import Policy
    from strata_runtime.experts.cache_sim import foresight, simulate

    requests, slots, _, _ = _calibrated()
    warm = len(requests) // 2
    swapping = simulate(requests, slots, Policy(), warm=warm, lag=1)
    keeping = simulate(requests, slots, Policy(keep_misses=True), warm=warm)
    bound = foresight(requests, slots, warm=warm)
    assert keeping.swaps == 0 and swapping.swaps > 0
    assert bound.link < keeping.link < 0.9 * swapping.link


def test_a_queue_of_victims_that_lands_late_leaves_the_windows_before_it_keeping_nothing() -> None:
    """Keeping misses with a queue of one victim, a rebalance every window: one layer of 8 experts, 2 slots
    (experts 0 and 1), the decode windows routing to 2, 2, 3, 3, 4, 4. On time, each newcomer is kept at
    its first window and found at its second: 3 misses in 6 windows. With each new queue landing 2 windows
    after its decision, expert 3's first window finds the queue used up and keeps nothing, its second keeps
    it (a miss again), and expert 4's first finds a queue whose victim (1) has left its slot already: 5
    misses. A prompt's queue lands on time in both (``prompt_lag=0``)."""
    from strata_runtime.experts.cache_sim import RequestTrace, simulate

    req = RequestTrace(np.zeros((1, 8)), np.array([2, 2, 3, 3, 4, 4]).reshape(6, 1, 1))
    policy = Policy(keep_misses=True, every=1, max_swaps=1, decay=0.5)
    on_time = simulate([req], 2, policy, lag=0, prompt_lag=0)
    late = simulate([req], 2, policy, lag=2, prompt_lag=0)
    assert on_time.misses == 3 / 6 and on_time.swaps == late.swaps == 0
    assert late.misses == 5 / 6


def test_a_queue_of_victims_half_taken_makes_the_next_rebalance_due_after_one_window() -> None:
    """Keeping misses with a queue of four victims (every resident): a window that keeps one expert leaves
    the next rebalance ``every`` windows away; one that keeps a second has taken half the queue
    (`QUEUE_REFRESH`), so a new queue is due after one window; the device's tables, learned with half the
    queue taken, do the same, and with less taken they do not."""
    r = Residency(2, 8, 4, 1, Policy(every=4, max_swaps=4, keep_misses=True))
    r.scores[...] = np.arange(16).reshape(2, 8)
    r.observe(np.zeros((2, 8)), windows=4)
    assert r.due() and r.rebalance() == [] and len(r.queue.slot) == 4
    assert [sw.loaded for sw in r.admit(1, np.array([5]))] == [(1, 5)]
    r.observe(np.zeros((2, 8)))
    assert not r.backlog and not r.due()
    assert [sw.loaded for sw in r.admit(1, np.array([6]))] == [(1, 6)] and r.stats.kept == 2
    r.observe(np.zeros((2, 8)))
    assert r.backlog and r.due()
    r.rebalance()
    r.observe(np.zeros((2, 8)))
    assert not r.due()
    r.learn(r.slot_of.copy(), taken=1, queued=4)
    assert not r.due()
    r.learn(r.slot_of.copy(), taken=2, queued=4)
    assert r.due()


def test_the_simulations_break_even_table_compares_both_policies_in_the_layer_shape_asked_for(
    monkeypatch, capsys
) -> None:
    """``scripts/cache_policy_sim.py --break-even``: one row a share, in the shape ``--experts`` and
    ``--top-k`` give (slots a layer and their multiple of top-k), each stream count's keeping / swapping
    figures and their ratio; a larger cache moves fewer experts under either policy."""
    import sys

    from script_loader import load_script

    sim = load_script("cache_policy_sim")
    argv = ["cache_policy_sim.py", "--layers", "16", "--requests", "4", "--tokens", "24", "--lag", "2"]
    argv += ["--experts", "16", "--top-k", "2", "--break-even", "0.125,0.5"]
    monkeypatch.setattr(sys, "argv", argv)
    sim.main()
    out = capsys.readouterr().out.splitlines()
    assert "16 layers x 16 experts, top-2" in out[0] and "2 windows late" in out[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out[3:]]
    assert [r[:3] for r in rows] == [["12%", "2.0", "1.00"], ["50%", "8.0", "4.00"]]
    moved = []
    for r in rows:
        for figures, ratio in ((r[3], r[4]), (r[5], r[6])):
            kept, swapped = (float(x) for x in figures.split(" / "))
            assert float(ratio) == pytest.approx(kept / swapped, rel=0.05)  # the figures are rounded
            moved.append((kept, swapped))
    small_one, small_two, large_one, large_two = moved
    for large, small in ((large_one, small_one), (large_two, small_two)):
        assert large[0] < small[0] and large[1] < small[1], moved


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--experts", "64"],
            "--experts and --top-k set the layer's shape of --break-even, which is not given",
        ),
        (
            ["--break-even", "0.1,x"],
            "--break-even: shares of the experts in VRAM, such as 0.1,0.2, not '0.1,x'",
        ),
        (
            ["--break-even", "0.1,1.5"],
            "--break-even: a share of the experts is above 0 and at most 1, not 1.5",
        ),
        (
            ["--break-even", "0.1", "--experts", "8", "--top-k", "9"],
            "--top-k: a token routes to 1 to --experts",
        ),
    ],
)
def test_the_simulation_refuses_a_break_even_it_cannot_run_by_name(
    monkeypatch, capsys, args, message
) -> None:
    import sys

    from script_loader import load_script

    sim = load_script("cache_policy_sim")
    monkeypatch.setattr(sys, "argv", ["cache_policy_sim.py", *args])
    with pytest.raises(SystemExit) as exc:
        sim.main()
    assert exc.value.code == 2 and message in capsys.readouterr().err
