"""The calibrated routing model reproduces Qwen3-30B-A3B's measured locality; random routing does not.

A seeded simulation of the defaults (9 prompts of 512 positions, 128 experts top-8, two mid-stack layers of
a 48-layer model) is measured with strata_runtime.experts.routing_stats and compared with the published
figures (`PUBLISHED`, sources in docs/RUNTIME.md). The same checks on random routing must fail, which shows
they can.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_runtime.experts import routing_stats as st
from strata_runtime.experts.routing import RoutingModel

E, K, PROMPTS, TOKENS, LAYERS = 128, 8, 9, 512, (12, 30)

TOLERANCE = st.Locality(
    # The published single figures come from three prompts (imp) whose per-prompt LRU hit rates spread over
    # 5 points (90.0-95.3%); across model seeds the simulation's own measures move by about 1-2 points.
    # A band of 4-5 points is about that spread, and far (25+ points) from what random routing gives.
    repeat=0.04,
    within_8=0.05,
    lru_40=0.045,  # the published range 90.0-95.3% with 2 points either side
    best_40=0.05,
    held_out_40=0.05,  # the published range is 68-73%
    # The oracle comes from another study (its own prompts and lengths); the model was tuned to the imp
    # figures, and the first simulation of this routing model was already 5.6 points under it at m = 16.
    oracle_4=0.06,
    oracle_16=0.06,
    oracle_64=0.06,
)


def misses(measured: st.Locality) -> dict[str, tuple[float, float]]:
    """The measures outside their tolerance: name -> (measured, published)."""
    got, want, tol = measured.as_dict(), st.PUBLISHED.as_dict(), TOLERANCE.as_dict()
    return {k: (round(got[k], 3), want[k]) for k in got if abs(got[k] - want[k]) > tol[k]}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = np.random.default_rng(11)
    return [g.integers(0, 32000, int(g.integers(5, 200))).tolist() for _ in range(PROMPTS)]


def test_the_calibrated_defaults_reproduce_the_published_locality(prompts):
    model = RoutingModel(48, E, K, model_seed=0)
    measured = st.measure(st.calibrated_traces(model, prompts, TOKENS, LAYERS), E)
    assert misses(measured) == {}, measured


def test_random_routing_fails_every_check():
    measured = st.measure(st.uniform_traces(np.random.default_rng(3), PROMPTS, TOKENS, 2, E, K), E)
    assert set(misses(measured)) == set(st.PUBLISHED.as_dict()), measured


def test_the_first_layer_is_less_persistent_than_mid_stack(prompts):
    model = RoutingModel(48, E, K, model_seed=0)
    first, mid = (
        st.measure(t, E)
        for t in (st.calibrated_traces(model, prompts[:4], 256, (layer,)) for layer in (0, 20))
    )
    assert first.repeat < mid.repeat - 0.05


def test_measures_on_a_hand_made_trace():
    # Two experts of 4, top-2: positions alternate {0,1}, {0,2}: expert 0 repeats, the other does not.
    t = np.array([[0, 1], [0, 2]] * 40)
    assert st.next_token_repeat([t], 4) == pytest.approx(0.5)
    assert st.reuse_within([t], 4, window=1) == pytest.approx(0.5)
    # Within 2 every choice repeats, except expert 2 the first time it appears (at position 1).
    assert st.reuse_within([t], 4, window=2) == pytest.approx(157 / 158)
    # 40% of 4 experts is 2 resident: LRU holds {0, last}; each position hits 0 and misses the other.
    assert st.lru_hit_rate([t], 4, warmup=2) == pytest.approx(0.5)
    assert st.best_coverage([t], 4) == pytest.approx((80 + 40) / 160)
    assert st.oracle_hit([t], 4, window=2) == pytest.approx(1.0)  # 2k = 4 experts hold everything
