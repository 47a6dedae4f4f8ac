"""The device's token choice (`strata_runtime.models.ops.choose`): the argmax, or an exact draw from the
tempered softmax at a uniform the host drew; and the window choosing the host's rows where it must.

The CUDA kernel is compared with this NumPy path in tests/test_cuda_kernels.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_runtime.api import SamplingParams
from strata_runtime.engine.sampling import Sampler, distribution
from strata_runtime.models.ops.choose import choose_tokens
from strata_runtime.models.ops.distribution import TEMPERATURE_FLOOR, log_min_p

P_THRESHOLD = 1e-3
"""A correct sampler fails a chi-square test this often (seeded, so a failure reproduces)."""


def test_a_row_of_zero_inverse_temperature_takes_the_argmax_lowest_index_on_ties() -> None:
    logits = np.array([[0.1, 2.0, 2.0, -1.0], [5.0, 0.0, 4.0, 5.0]], np.float32)
    got = choose_tokens(logits, np.zeros(2), np.array([0.99, 0.01]))
    assert got.tolist() == [1, 0]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_draws_at_uniform_points_follow_the_tempered_softmax(temperature) -> None:
    torch = pytest.importorskip("torch")  # for the chi-square survival function
    g = np.random.default_rng(5)
    v, trials = 12, 40_000
    logits = (g.standard_normal(v) * 2).astype(np.float32)
    rows = np.repeat(logits[None, :], trials, axis=0)
    got = choose_tokens(rows, np.full(trials, 1 / temperature), g.random(trials))
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    counts = np.bincount(got, minlength=v)
    expected = trials * p
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    p_value = float(torch.special.gammaincc(torch.tensor((v - 1) / 2.0), torch.tensor(chi2 / 2.0)))
    assert p_value > P_THRESHOLD, f"chi2 {chi2:.1f}, p = {p_value:.2e}"


def test_the_draw_is_the_inverse_cdf_at_u_in_token_order() -> None:
    logits = np.log(np.array([[0.5, 0.0, 0.25, 0.25]], np.float64) + 1e-300).astype(np.float32)
    one = np.ones(1)
    assert choose_tokens(logits, one, np.array([0.0])).tolist() == [0]
    assert choose_tokens(logits, one, np.array([0.49])).tolist() == [0]
    assert choose_tokens(logits, one, np.array([0.51])).tolist() == [2]  # token 1 has no weight
    assert choose_tokens(logits, one, np.array([0.76])).tolist() == [3]
    assert choose_tokens(logits, one, np.array([1.0])).tolist() == [3]  # rounded up to the total: the last


def test_a_sampler_adjusts_only_with_a_bias_or_penalty_and_gives_the_device_its_inverse_temperature() -> None:
    def adjusts(**kw: object) -> bool:
        return Sampler(SamplingParams(**kw), seed=0).adjusts  # type: ignore[arg-type]

    assert not adjusts(temperature=0.0) and not adjusts(temperature=0.8, top_p=0.9, top_k=40)
    assert adjusts(temperature=0.0, logit_bias=((3, 1.0),))
    assert adjusts(temperature=0.8, frequency_penalty=0.2) and adjusts(temperature=0.8, presence_penalty=0.2)
    assert Sampler(SamplingParams(temperature=0.5), 0).inv_temperature == 2.0
    assert Sampler(SamplingParams(temperature=0.0), 0).inv_temperature == 0.0


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"),
    [
        (4, 1.0, 0.0),
        (0, 0.7, 0.0),
        (6, 0.8, 0.0),
        (0, 0.05, 0.0),
        (0, 1.0, 0.1),
        (0, 0.8, 0.2),
        (6, 1.0, 0.3),
    ],
    ids=["k4", "p0.7", "k6-p0.8", "p0.05", "minp0.1", "p0.8-minp0.2", "k6-minp0.3"],
)
def test_top_k_top_p_and_min_p_draws_follow_the_hosts_distribution(top_k, top_p, min_p) -> None:
    """The device's cuts keep what `distribution` keeps, and its draws follow what that leaves."""
    torch = pytest.importorskip("torch")  # for the chi-square survival function
    g = np.random.default_rng(9)
    v, trials, temperature = 14, 30_000, 0.8
    logits = (g.standard_normal(v) * 1.5).astype(np.float32)
    rows = np.repeat(logits[None, :], trials, axis=0)
    got = choose_tokens(
        rows,
        np.full(trials, 1 / temperature),
        g.random(trials),
        np.full(trials, top_k),
        np.full(trials, top_p),
        np.full(trials, log_min_p(min_p), np.float32),
    )
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    p = distribution(logits[None, :], params)[0]
    if min_p:  # the cut removes some of what top-k and top-p alone keep
        wider = distribution(
            logits[None, :], SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        )
        assert np.count_nonzero(p) < np.count_nonzero(wider[0])
    counts = np.bincount(got, minlength=v)
    assert (counts[p == 0] == 0).all(), "a token the cuts remove was drawn"
    live = p > 0
    expected = trials * p[live]
    if live.sum() > 1:
        chi2 = float(((counts[live] - expected) ** 2 / expected).sum())
        dof = int(live.sum()) - 1
        p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(chi2 / 2.0)))
        assert p_value > P_THRESHOLD, f"chi2 {chi2:.1f}, p = {p_value:.2e}"
    else:
        assert counts[live].sum() == trials


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_top_after_temperature() -> None:
    """Min-p weighs probabilities after temperature (vLLM's order): at temperature 1 a token of 0.04 beside a
    top of 0.5 falls under min-p 0.1, at temperature 2 its share of the top (0.28) keeps it; what stays is
    renormalised, and top-p then weighs only that: min-p 0.45 leaves 0.5 and 0.26, where the top's 0.66
    reaches top-p 0.6 alone (over the whole row it takes two tokens). The device's twin keeps the same
    tokens."""
    from strata_runtime.reference.kernels import staying_weights

    probs = np.array([0.5, 0.2, 0.04, 0.26])
    logits = np.log(probs).astype(np.float32)[None, :]
    cold = distribution(logits, SamplingParams(temperature=1.0, min_p=0.1))[0]
    assert np.flatnonzero(cold).tolist() == [0, 1, 3]
    np.testing.assert_allclose(cold[[0, 1, 3]], probs[[0, 1, 3]] / 0.96, rtol=1e-6)
    warm = distribution(logits, SamplingParams(temperature=2.0, min_p=0.1))[0]
    assert np.count_nonzero(warm) == 4
    narrow = distribution(logits, SamplingParams(temperature=1.0, min_p=0.45, top_p=0.6))[0]
    assert np.flatnonzero(narrow).tolist() == [0]
    wide = distribution(logits, SamplingParams(temperature=1.0, top_p=0.6))[0]
    assert np.flatnonzero(wide).tolist() == [0, 3]
    for t, min_p, top_p, kept in [(1.0, 0.1, 1.0, [0, 1, 3]), (0.5, 0.2, 1.0, [0, 3]), (1.0, 0.45, 0.6, [0])]:
        w = staying_weights(logits[0], 1 / t, 0, top_p, log_min_p(min_p))
        assert np.flatnonzero(w).tolist() == kept, (t, min_p, top_p)
    assert log_min_p(0.0) == -np.inf
    ones = distribution(logits, SamplingParams(temperature=1.0, min_p=1.0))[0]
    assert np.flatnonzero(ones).tolist() == [0]  # min-p 1 keeps the top token (and its ties) alone


def test_ties_at_the_cuts_stay_as_the_host_keeps_them() -> None:
    """Top-k keeps every tie at the k-th logit; top-p keeps tied tokens in index order while the weight
    before each is under the cut."""
    logits = np.log(np.array([[0.1, 0.3, 0.3, 0.3]], np.float64)).astype(np.float32)
    one = np.ones(1)
    draws = [
        choose_tokens(logits, one, np.array([u]), np.array([2]), np.array([1.0]))[0]
        for u in np.linspace(0, 0.99, 50)
    ]
    assert set(draws) == {1, 2, 3}  # k = 2, three tied at the second largest: all stay
    # top_p 0.5: token 1 (0.3 before it is 0) and token 2 (0.3 < 0.5) stay, token 3 (0.6) does not.
    kept = {
        int(choose_tokens(logits, one, np.array([u]), np.array([0]), np.array([0.5]))[0])
        for u in np.linspace(0, 0.99, 50)
    }
    want = distribution(logits, SamplingParams(temperature=1.0, top_p=0.5))[0]
    assert kept == {1, 2} == set(np.flatnonzero(want).tolist())


@pytest.mark.parametrize("top_p", [1e-30, 1e-16])
def test_a_top_p_whose_share_rounds_to_nothing_keeps_the_top_token(top_p) -> None:
    """A top-p above 0 (as the API allows) whose share of the weights rounds to 0 in the cut's fixed point
    keeps the top token, as the smallest prefix reaching it is never empty: every draw is the argmax, and
    the host's distribution agrees. Nothing stayed before, and the draw failed the engine's step."""
    g = np.random.default_rng(31)
    logits = (g.standard_normal((5, 300)) * 3).astype(np.float32)
    uniform = np.array([0.0, 0.3, 0.5, 0.9, 1.0 - 2**-24], np.float32)
    got = choose_tokens(
        logits, np.ones(5, np.float32), uniform, np.zeros(5, np.int32), np.full(5, top_p, np.float32)
    )
    np.testing.assert_array_equal(got, logits.argmax(axis=1))
    want = distribution(logits, SamplingParams(temperature=1.0, top_p=top_p))
    np.testing.assert_array_equal(want.argmax(axis=1), logits.argmax(axis=1))
    assert (np.count_nonzero(want, axis=1) == 1).all()


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-7])
def test_a_vanishing_temperature_is_floored_where_the_device_reads_its_inverse(temperature) -> None:
    """Below `TEMPERATURE_FLOOR` the device's 1 / temperature (a float32) is the floor's, as the host's rule
    divides by it: finite (1e-300 overflowed float32 to infinity, and the device's weights to NaN), and the
    device's draws stay among the tokens the host's distribution keeps."""
    sampler = Sampler(SamplingParams(temperature=temperature), seed=1)
    assert sampler.inv_temperature == 1 / TEMPERATURE_FLOOR
    assert np.isfinite(np.float32(sampler.inv_temperature))
    g = np.random.default_rng(32)
    logits = (g.standard_normal((4, 200)) * 3).astype(np.float32)
    logits[:, 7] = logits.max(axis=1) + 1e-6  # within the floor's reach of the top
    inv = np.full(4, np.float32(sampler.inv_temperature))
    drawn = choose_tokens(logits, inv, np.array([0.0, 0.4, 0.8, 0.999], np.float32))
    kept = distribution(logits, SamplingParams(temperature=temperature))
    assert all(kept[r, t] > 0 for r, t in enumerate(drawn)), (drawn, np.flatnonzero(kept[0]))


def _logit_rows(g: np.random.Generator, kind: str, rows: int, v: int) -> np.ndarray:
    """Logits flat (normal, sd 3), coarse (ties at every value) or peaked (a few tokens far above a body)."""
    x = g.standard_normal((rows, v)) * (3 if kind != "peaked" else 2)
    if kind == "coarse":
        x = np.round(x * 2) / 2
    if kind == "peaked":
        for r in range(rows):
            hot = g.choice(v, int(g.integers(1, 40)), replace=False)
            x[r, hot] += g.uniform(4, 20, hot.size)
    return x.astype(np.float32)


@pytest.mark.parametrize("kind", ["flat", "coarse", "peaked"])
def test_the_hosts_top_p_gives_the_whole_row_sorts_distribution(kind) -> None:
    """`nucleus_host` sorts a few hundred candidates instead of the row: the distribution must be the one the
    whole-row sort gives, bit for bit, at every top-k, temperature and top-p, including top-p values at and
    just past the mass of the first candidates (where it must take more of them)."""
    from strata_runtime.models.ops.distribution import NUCLEUS_FIRST

    g = np.random.default_rng(11)
    v, rows = 40_000, 3
    logits = _logit_rows(g, kind, rows, v)
    cases = [
        SamplingParams(temperature=t, top_k=k, top_p=p)
        for t in (0.5, 1.0, 2.0)
        for k in (0, 20, 300, 10_000)
        for p in (0.05, 0.5, 0.8, 0.95, 0.999, 1 - 1e-12)
    ]
    # top-p at the mass of the first NUCLEUS_FIRST tokens of row 0, and within and just past the margin
    p0 = distribution(logits[:1], SamplingParams(temperature=1.0))[0]
    head = np.cumsum(np.sort(p0)[::-1])[NUCLEUS_FIRST - 1]
    cases += [SamplingParams(temperature=1.0, top_p=head + d) for d in (-1e-6, -1e-12, 0.0, 1e-12, 1e-7)]
    for c in cases:
        assert np.array_equal(distribution(logits, c), distribution(logits, c, sort_rows=True)), c


@pytest.mark.parametrize("kind", ["flat", "coarse", "peaked"])
def test_the_devices_distribution_is_the_hosts_but_at_a_cuts_rounding(kind) -> None:
    """What a sampled window decided on a GPU verifies against (``distribution_rows``, here its twin: the
    staying weights of the device's choice over their sum) is the host's `distribution`: the same tokens
    keep probability, but where the host's mass before a token is within float32 rounding of top-p, and the
    probabilities agree to the rounding of 1 / temperature in float32."""
    from strata_runtime.reference import kernels as reference

    g = np.random.default_rng(17)
    v, rows = 5_000, 4
    logits = _logit_rows(g, kind, rows, v)
    edges = cut = 0
    for temperature, top_k, top_p, min_p in [
        (0.7, 20, 0.8, 0.0),
        (1.0, 0, 0.95, 0.0),
        (0.6, 0, 0.5, 0.0),
        (1.3, 300, 1.0, 0.0),
        (2.0, 1, 0.3, 0.0),
        (1.0, 0, 1.0, 0.05),
        (0.7, 0, 0.9, 0.1),
        (1.5, 300, 1.0, 0.02),
    ]:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        want = distribution(logits, params)
        got = np.empty((rows, v))
        reference.distribution(logits, 1 / temperature, top_k, top_p, got, log_min_p=log_min_p(min_p))
        np.testing.assert_allclose(got.sum(axis=1), 1.0)
        for r in range(rows):
            differ = np.flatnonzero((got[r] > 0) != (want[r] > 0))
            if differ.size:
                untrimmed = distribution(
                    logits[r : r + 1], SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p)
                )[0]
                order = np.argsort(-untrimmed, kind="stable")
                before = np.empty(v)
                before[order] = np.cumsum(untrimmed[order]) - untrimmed[order]
                assert np.abs(before[differ] - top_p).max() < 1e-5, (temperature, top_k, top_p, r)
                edges += 1
                continue
            cut += int((want[r] == 0).any())
            np.testing.assert_allclose(got[r], want[r], rtol=1e-5, atol=1e-12)
    assert cut >= 20 and edges <= 1
