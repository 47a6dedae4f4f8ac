"""A sampled row's distribution: the rule every sampled token, draft and verification follows.

Temperature, top-k and top-p shape a row of logits into next-token probabilities (`distribution`):

* x = logits / temperature, in float64;
* top-k (0 < k < V): a token whose x is below the k-th largest x gets nothing (ties at the k-th all stay);
* min-p (> 0): a token whose x is below max x + ln(min_p), whose probability is below min_p times the
  largest, gets nothing;
* p = exp(x - max x) over what stays, normalised;
* top-p (< 1): in order of probability, largest first and ties by token id, a token keeps its p while the
  mass strictly before it is below top_p (the smallest such prefix, never empty); what stays is normalised
  again.

A draw at a uniform u takes the first token whose cumulative probability exceeds u times the total
(`inverse_cdf`). A speculative window's proposals are kept or not against the target's distribution by
speculative rejection sampling (`verify_sampled`). This module is the rule on NumPy (and CuPy) arrays: the
host's choices and verifications follow it, and so does a window decided on a CPU device. On a GPU, a row
chosen on the device and a sampled window decided there both take the distribution of the device's choice
(`strata_runtime.models.ops.choose`, the kernels ``choose_rows`` and ``distribution_rows``): the same cuts
and weights, which it orders by logit rather than probability and whose top-p mass it sums in 2^-40 fixed
point from float32 weights, so the two differ only where a cut falls within rounding of a token's edge.
Such a window's draws and acceptance run as one kernel each there (``inverse_cdf_rows``,
``verify_sampled_rows``), whose sums differ from this module's only in rounding.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

TEMPERATURE_FLOOR = 1e-6
"""The least temperature a draw divides by: below it (above 0, which is greedy) a row's logits are divided by
this instead, which already leaves only the top token and those within about 1e-5 of it. On a device, 1 /
temperature is a float32, which a temperature under about 3e-39 would overflow to infinity, and its weights
to NaN (`inv_temperature`)."""


def inv_temperature(temperature: float) -> float:
    """1 / temperature, at most 1 / `TEMPERATURE_FLOOR`, for a temperature above 0."""
    return 1.0 / max(temperature, TEMPERATURE_FLOOR)


def log_min_p(min_p: float) -> float:
    """The min-p cut as a device's choice takes it: ln(min_p) rounded to float32, minus infinity for none
    (0). A token stays there while (logit - max logit) * (1 / temperature), in float32, is at least this."""
    return float(np.float32(np.log(min_p))) if min_p > 0 else -math.inf


def distribution(
    logits: Any,
    temperature: float,
    top_k: int,
    top_p: float,
    xp: Any = np,
    *,
    min_p: float = 0.0,
    sort_rows: bool = False,
) -> Any:
    """Next-token probabilities [n, V] (float64) of logits [n, V] after temperature, top-k, min-p and top-p,
    on ``xp`` arrays: NumPy on the host, CuPy where a GPU runs the same steps without the kernel. Top-p sorts
    each whole row on the GPU and with ``sort_rows``; on the host it otherwise sorts a row's likeliest
    tokens (`nucleus_host`), for the same distribution."""
    x = xp.asarray(logits, dtype=xp.float64) / max(temperature, TEMPERATURE_FLOOR)  # [n, V]
    if 0 < top_k < x.shape[-1]:
        kth = xp.partition(x, -top_k, axis=-1)[:, -top_k][:, None]  # [n, 1]
        x = xp.where(x < kth, -xp.inf, x)  # ties at the k-th largest all stay
    top = x.max(axis=-1, keepdims=True)
    if min_p > 0:
        x = xp.where(x - top < math.log(min_p), -xp.inf, x)  # the largest always stays
    p = xp.exp(x - top)
    p /= p.sum(axis=-1, keepdims=True)  # [n, V]
    if top_p < 1.0:
        keep = nucleus(p, top_p, xp) if sort_rows or xp is not np else nucleus_host(p, top_p)
        p = xp.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def nucleus(p: Any, top_p: float, xp: Any = np) -> Any:
    """Which tokens top-p keeps, [n, V] bool, from probabilities p [n, V]: in order of probability, largest
    first and ties by token id, the smallest prefix whose mass reaches ``top_p`` (never empty), found by
    sorting each whole row."""
    stable = {"kind": "stable"} if xp is np else {}  # CuPy's sort is stable
    order = xp.argsort(-p, axis=-1, **stable)  # [n, V]
    sorted_p = xp.take_along_axis(p, order, axis=-1)
    before = xp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each token
    keep = xp.zeros(p.shape, dtype=bool)
    keep[xp.arange(p.shape[0])[:, None], order] = before < top_p
    return keep


NUCLEUS_FIRST = 256
"""Tokens `nucleus_host` sorts first; it takes 16 times as many each time their mass falls short."""

NUCLEUS_MARGIN = 1e-9
"""How far past ``top_p`` the sorted candidates' mass must reach for `nucleus_host` to stop: far above the
rounding of a running sum over a vocabulary, so that no token after them could still be kept."""


def nucleus_host(p: np.ndarray, top_p: float) -> np.ndarray:
    """`nucleus` on the host without sorting whole rows, for the same distribution: it differs only where
    `nucleus` keeps tokens of zero probability (which a distribution weighs 0 either way).

    The m largest probabilities of a row, with every tie of the m-th, come first in the whole row's order,
    in the same order, so their running sums are the whole order's first ones (NumPy's cumulative sum adds
    left to right). Once those reach ``top_p`` by `NUCLEUS_MARGIN`, every token after them has at least that
    much mass before it and is cut. A row sorts its 256 most likely tokens (a partition of its nonzero
    probabilities finds them), then 4,096, and so on, and all of them only when nothing smaller reaches
    ``top_p``; the whole-row sort of a 151,936-token row is what this saves, about 18 ms."""
    keep = np.zeros(p.shape, dtype=bool)
    for r, row in enumerate(p):
        support = np.flatnonzero(row)  # after top-k, often a few tokens
        values = row[support]
        m = NUCLEUS_FIRST
        while True:
            if m < support.size:  # the m largest and their ties
                least = np.partition(values, support.size - m)[support.size - m]
                candidates = support[values >= least]
            else:
                candidates = support
            order = candidates[np.argsort(-row[candidates], kind="stable")]
            sorted_p = row[order]
            total = np.cumsum(sorted_p)
            if m >= support.size or total[-1] >= top_p + NUCLEUS_MARGIN:
                keep[r, order] = total - sorted_p < top_p
                break
            m *= 16
    return keep


def inverse_cdf(probs: Any, u: Any, xp: Any = np) -> Any:
    """The token [V] -> index whose cumulative weight first exceeds ``u`` (in [0, 1)) times the total: a draw
    from ``probs`` (which need not sum to 1) at ``u``, on ``xp`` arrays (``u`` may be a device scalar)."""
    cdf = xp.cumsum(probs)
    return xp.minimum(xp.searchsorted(cdf, u * cdf[-1], side="right"), probs.shape[-1] - 1)


def verify_sampled(xp: Any, p: Any, q: Any, tokens: Any, uniforms: Any) -> tuple[Any, Any]:
    """Speculative rejection sampling of one slot's window on ``xp`` arrays: (proposals kept, the token
    after them), both 0-d.

    ``p`` is the target's distribution at the window's n rows [n, V], ``q`` the distributions [n - 1, V] each
    proposal (``tokens[1:]``, of the window's input ids [n]) was drawn from, and ``uniforms`` [n] the draws:
    proposal j holds while ``uniforms[j] * q_j(token) < p_j(token)`` (accepted with probability min(1, p/q));
    the token after the kept ones comes from norm(max(0, p_a - q_a)) at the first rejection (p_a where that
    is empty), or from the last row's p when every proposal held, at ``uniforms[n - 1]``. The same rule as
    `strata_runtime.engine.speculative.verify`, with the uniforms drawn ahead, so the emitted tokens have
    exactly the target's distribution.
    """
    n = int(tokens.shape[0])
    rows = xp.arange(n - 1)
    proposed = tokens[1:]
    holds = (uniforms[: n - 1] * q[rows, proposed] < p[rows, proposed]).astype(xp.int64)  # [n - 1]
    accepted = xp.cumprod(holds).sum()
    after = xp.concatenate([xp.maximum(p[:-1] - q, 0.0), p[-1:]], axis=0)[accepted]  # [V]
    after = xp.where(after.sum() > 0, after, p[accepted])
    return accepted, inverse_cdf(after, uniforms[n - 1], xp)
