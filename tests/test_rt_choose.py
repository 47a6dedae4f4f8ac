"""The device's token choice (`strata_runtime.models.ops.choose`): the argmax, or an exact draw from the
tempered softmax at a uniform the host drew; and the window choosing the host's rows where it must.

The CUDA kernel is compared with this NumPy path in tests/test_cuda_kernels.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_runtime.api import SamplingParams
from strata_runtime.engine.sampling import Sampler
from strata_runtime.models.ops.choose import choose_tokens

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


def test_the_device_chooses_only_for_plain_greedy_or_plain_temperature_sampling() -> None:
    def chooses(**kw: object) -> bool:
        return Sampler(SamplingParams(**kw), seed=0).device_chooses  # type: ignore[arg-type]

    assert chooses(temperature=0.0) and chooses(temperature=0.8)
    assert not chooses(temperature=0.8, top_p=0.9)
    assert not chooses(temperature=0.8, top_k=40)
    assert not chooses(temperature=0.0, logit_bias=((3, 1.0),))
    assert not chooses(temperature=0.8, frequency_penalty=0.2)
    assert Sampler(SamplingParams(temperature=0.5), 0).inv_temperature == 2.0
    assert Sampler(SamplingParams(temperature=0.0), 0).inv_temperature == 0.0
