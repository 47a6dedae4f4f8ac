"""Choosing tokens: greedy argmax, or temperature / top-k / top-p sampling from a per-request seeded RNG.

The target's and the drafter's logits go through the same `distribution`, so speculative rejection
sampling reproduces exactly the distribution a user asked for.
"""

from __future__ import annotations

import numpy as np

from ..api import SamplingParams


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Next-token probabilities [n, V] (float64) after temperature, top-k and top-p."""
    x = np.asarray(logits, dtype=np.float64) / max(params.temperature, 1e-6)  # [n, V]
    if 0 < params.top_k < x.shape[-1]:
        kth = np.partition(x, -params.top_k, axis=-1)[:, -params.top_k][:, None]  # [n, 1]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)  # [n, V]
    if params.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")  # [n, V]
        sorted_p = np.take_along_axis(p, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each token
        keep_sorted = before < params.top_p  # the smallest prefix reaching top_p (never empty)
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return np.asarray(p)


class Sampler:
    """One request's token chooser: greedy, or seeded sampling."""

    def __init__(self, params: SamplingParams, seed: int) -> None:
        self.params = params
        self.greedy = params.temperature <= 0.0
        self.rng = np.random.default_rng(seed)

    def draw(self, probs: np.ndarray) -> int:
        """One token from a distribution [V]."""
        cdf = np.cumsum(probs)
        return int(min(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"), len(probs) - 1))

    def uniform(self) -> float:
        return float(self.rng.random())
