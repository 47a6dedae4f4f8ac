"""The calibrated routing model (strata_runtime.experts.routing) and the hashing and intended sets of its
kernel twin (strata_runtime.reference.routing): seeds, tables, sets, the router bias."""

from __future__ import annotations

import numpy as np
import pytest

from strata_runtime.experts import routing as r
from strata_runtime.reference import routing as twin

MASK = (1 << 64) - 1


def splitmix_finaliser(x: int) -> int:
    """An independent reference in Python integers (the kernel's contract), not the module's NumPy code."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def reference_uniform(seed: int, kind: int, layer: int, lane: int, attempt: int, pos: int) -> float:
    word = (kind << 60) | (layer << 48) | (lane << 40) | (attempt << 32) | pos
    return (splitmix_finaliser(seed ^ splitmix_finaliser(word)) >> 40) / 2**24


def test_hash_uniform_is_the_wrapping_uint64_integer_arithmetic_of_the_kernel():
    g = np.random.default_rng(7)
    seeds = [int(s) for s in g.integers(0, 2**63, 40)] + [MASK, 0]
    for s in seeds:
        kind, layer, lane, attempt = (
            int(g.integers(1, 3)),
            int(g.integers(0, 4096)),
            int(g.integers(0, 32)),
            int(g.integers(0, 32)),
        )
        pos = int(g.integers(0, 2**32))
        got = twin.hash_uniform(s, kind, layer, lane, attempt, pos)
        assert got.dtype == np.float32
        assert float(got) == reference_uniform(s, kind, layer, lane, attempt, pos)


def test_every_field_of_the_hash_word_changes_the_uniform():
    base = dict(seed=12345, kind=1, layer=3, lane=2, attempt=1, position=99)
    ref = float(twin.hash_uniform(**base))
    for field, other in (
        ("seed", 12346),
        ("kind", 2),
        ("layer", 4),
        ("lane", 3),
        ("attempt", 2),
        ("position", 100),
    ):
        assert float(twin.hash_uniform(**{**base, field: other})) != ref, field


def test_routing_seed_is_a_stable_hash_of_the_prompt_ids():
    assert r.routing_seed([1, 2, 3]) == r.routing_seed((1, 2, 3))
    assert r.routing_seed([1, 2, 3]) != r.routing_seed([1, 2, 4])
    assert r.routing_seed([1, 2, 3]) != r.routing_seed([3, 2, 1])
    assert 0 <= r.routing_seed([5] * 1000) < 2**64


def test_request_tables_are_a_proper_cdf_per_layer_and_differ_between_prompts():
    m = r.RoutingModel(6, 128, 8, model_seed=3)
    assert np.allclose(m.popularity.sum(axis=1), 1.0)
    # Zipf by rank, shuffled per layer: the same sorted values, different hot experts.
    assert np.allclose(np.sort(m.popularity[0]), np.sort(m.popularity[1]))
    assert len(set(m.popularity.argmax(axis=1).tolist())) > 1
    _, a = m.request([1, 2, 3])
    _, b = m.request([4, 5, 6])
    assert a.dtype == np.float32 and a.shape == (6, 128)
    assert (np.diff(a, axis=1) >= 0).all() and (a[:, -1] == 1.0).all()
    qa, qb = np.diff(a, axis=1, prepend=0), np.diff(b, axis=1, prepend=0)
    assert not np.allclose(qa, qb)
    # Skewed within a request: its 16 hottest experts hold far more than 16/128 of its mass.
    assert np.sort(qa, axis=1)[:, -16:].sum(axis=1).mean() > 0.5


@pytest.mark.parametrize(("n_experts", "top_k"), [(128, 8), (8, 2), (16, 4), (6, 6)])
def test_intended_sets_are_k_distinct_experts_and_a_pure_function_of_seed_layer_and_position(
    n_experts, top_k
):
    m = r.RoutingModel(4, n_experts, top_k, model_seed=1)
    seeds, cdfs = zip(*(m.request([p, p + 1]) for p in range(3)), strict=True)
    g = np.random.default_rng(2)
    rows = 400
    slot = g.integers(0, 3, rows)
    pos = g.integers(0, 5000, rows)
    pos[:100] = np.arange(100)
    table = np.stack(cdfs)  # [S, L, E]
    seed_arr = np.array(seeds, np.uint64)
    sets = twin.intended_sets(seed_arr[slot], table[slot, 2], 2, pos, top_k, 0.28, 64)
    assert sets.shape == (rows, top_k)
    assert ((sets >= 0) & (sets < n_experts)).all()
    assert (np.diff(np.sort(sets, axis=1), axis=1) > 0).all()  # distinct
    # Any subset of the rows, in any order, gets the same sets: no history, no dependence on neighbours.
    perm = g.permutation(rows)[:57]
    again = twin.intended_sets(seed_arr[slot[perm]], table[slot[perm], 2], 2, pos[perm], top_k, 0.28, 64)
    assert (again == sets[perm]).all()
    # And one request's own helper agrees.
    mine = slot == 1
    assert m.p_stay[2] == np.float32(0.28)
    assert (m.intended(seeds[1], cdfs[1], 2, pos[mine]) == sets[mine]).all()


def test_lanes_keep_their_expert_with_probability_p_stay_and_less_in_the_first_layer():
    m = r.RoutingModel(4, 128, 8, model_seed=0)
    seeds = np.full(4000, 99, np.uint64)
    pos = np.arange(4000)
    for layer in (0, 2):
        o = twin.lane_origins(seeds, layer, pos, 8, float(m.p_stay[layer]), 64)
        kept = (o[1:] == o[:-1]).mean()  # a lane kept its origin from t to t+1
        assert abs(kept - m.p_stay[layer]) < 0.02, (layer, kept)
    assert m.p_stay[0] < m.p_stay[1] < m.p_stay[2] == np.float32(0.28)


def test_a_lane_looks_back_at_most_lookback_positions():
    # p_stay = 1 never changes after position 0, so the origin is 0 within the lookback, then t - W + 1.
    pos = np.array([0, 5, 63, 64, 200])
    o = twin.lane_origins(np.full(5, 3, np.uint64), 1, pos, 2, 1.0, 64)
    assert o[:, 0].tolist() == [0, 0, 0, 1, 137]


def test_a_lane_whose_draws_all_collide_takes_the_next_free_expert():
    # All of q on expert 3: lane 0 draws 3, every attempt of the others collides, so they scan 4, 5, 6.
    cdf = np.zeros((1, 8), np.float32)
    cdf[0, 3:] = 1.0
    sets = twin.intended_sets(np.array([5], np.uint64), cdf, 0, np.array([10]), 4, 0.28, 64)
    assert sets.tolist() == [[3, 4, 5, 6]]
    cdf[0, 7:] = 1.0
    cdf[0, :7] = 0.0  # all on the last expert: the scan wraps around to 0
    assert twin.intended_sets(np.array([5], np.uint64), cdf, 0, np.array([10]), 3, 0.28, 64).tolist() == [
        [7, 0, 1]
    ]


@pytest.mark.parametrize(("n_experts", "top_k"), [(128, 8), (8, 2), (16, 4)])
def test_the_bias_makes_the_top_k_the_intended_set_and_keeps_the_real_logits_order_within_it(
    n_experts, top_k
):
    m = r.RoutingModel(3, n_experts, top_k, model_seed=4)
    tables = r.RoutingTables(m, slots=3)
    tables.admit(0, [1, 2, 3])
    tables.admit(2, [9, 9])
    g = np.random.default_rng(5)
    rows = 64
    logits = (g.standard_normal((rows, n_experts)) * 4).astype(np.float32)
    before = logits.copy()
    slots, pos = g.integers(0, 3, rows), g.integers(0, 2000, rows)
    out = r.apply_bias(logits, 1, slots, pos, tables)
    assert out is logits  # NumPy: in place
    want = twin.intended_sets(
        tables.seeds[slots], tables.cdf[slots, 1], 1, pos, top_k, float(m.p_stay[1]), 64
    )
    top = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    assert (np.sort(top, axis=1) == np.sort(want, axis=1)).all()
    # Within the chosen k the order is the router's own, and nothing else moved.
    assert (np.argsort(-before[np.arange(rows)[:, None], top], axis=1) == np.arange(top_k)).all()
    untouched = np.ones_like(logits, bool)
    untouched[np.arange(rows)[:, None], want] = False
    assert (logits[untouched] == before[untouched]).all()
    # The non-NumPy path (CuPy on the array path) gives the same numbers as a new array.
    fresh = before.copy()
    assert (r.apply_bias(fresh, 1, slots, pos, tables, xp=_NotNumpy) == logits).all()
    assert (fresh == before).all()


class _NotNumpy:
    """Stands in for an array module other than NumPy (its arrays are NumPy's here)."""

    asarray = staticmethod(np.asarray)


def test_admitting_a_prompt_sets_that_slot_only():
    m = r.RoutingModel(2, 16, 4, model_seed=0)
    t = r.RoutingTables(m, slots=2)
    empty = t.cdf[1].copy()
    t.admit(0, [4, 5, 6])
    seed, cdf = m.request([4, 5, 6])
    assert int(t.seeds[0]) == seed and (t.cdf[0] == cdf).all()
    assert (t.cdf[1] == empty).all() and int(t.seeds[1]) == r.routing_seed(())


def test_refuses_a_top_k_the_kernel_cannot_hold():
    with pytest.raises(ValueError, match="top-k"):
        r.RoutingModel(2, 64, 33, model_seed=0)
    with pytest.raises(ValueError, match="top-k"):
        r.RoutingModel(2, 4, 8, model_seed=0)


def test_the_twin_refuses_arguments_outside_the_kernels_contract():
    g = np.random.default_rng(9)
    logits = g.standard_normal((3, 16)).astype(np.float32)
    pos, slot = np.array([0, 5, 9], np.int32), np.array([0, 1, 0], np.int32)
    cdf = np.ones((2, 4, 16), np.float32)
    seeds = np.array([3, 4], np.uint64)
    twin.route_bias(logits.copy(), pos, slot, cdf, seeds, 3, 0.28, 4, 256.0, 64)  # a valid call
    with pytest.raises(ValueError, match="top-k 17"):
        twin.route_bias(logits, pos, slot, cdf, seeds, 3, 0.28, 17, 256.0, 64)
    with pytest.raises(ValueError, match="at layer 4"):
        twin.route_bias(logits, pos, slot, cdf, seeds, 4, 0.28, 4, 256.0, 64)
    with pytest.raises(ValueError, match="shapes"):
        twin.route_bias(logits, pos[:2], slot, cdf, seeds, 3, 0.28, 4, 256.0, 64)
    # The launcher's stricter contract: its dtypes and at most 256 experts.
    with pytest.raises(ValueError, match="pos must be C-contiguous int32"):
        twin.check_args(logits, pos.astype(np.int64), slot, cdf, seeds, 3, 4)
    wide = np.ones((2, 4, 300), np.float32)
    with pytest.raises(ValueError, match="at most 256"):
        twin.check_args(np.zeros((3, 300), np.float32), pos, slot, wide, seeds, 3, 4)


def test_device_tables_on_a_cpu_device_follow_the_host_tables_and_bias_through_the_twin():
    from strata_runtime.backend import Device
    from strata_runtime.cuda.routing import DeviceRouting

    model = r.RoutingModel(4, 16, 4, model_seed=1)
    host = r.RoutingTables(model, slots=3)
    device = DeviceRouting(host, Device.parse("cpu:0"))
    host.admit(1, [5, 6, 7])
    assert not (device.cdf[1] == host.cdf[1]).all()  # a copy: it changes only when loaded
    device.load(1)
    assert (device.cdf == host.cdf).all() and (device.seeds == host.seeds).all()
    g = np.random.default_rng(12)
    logits = (g.standard_normal((6, 16)) * 3).astype(np.float32)
    pos, slot = g.integers(0, 900, 6).astype(np.int32), np.array([0, 1, 1, 2, 1, 0], np.int32)
    want = logits.copy()
    r.apply_bias(want, 3, slot, pos, host)
    got = logits.copy()
    device.layer(3)(got, pos, slot)
    assert (got == want).all() and not (got == logits).all()
