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
