"""Choosing each row's token where the logits are: the argmax, or a draw at a uniform the host drew.

A row whose request needs nothing but the logits to choose (greedy, or plain temperature sampling, with no
logit bias, penalty, top-k or top-p) has its token chosen on the last stage's device, so that a decode window
can be queued before the host has read the token the window before it chose. A draw takes the first token
whose cumulative weight, in token order, exceeds ``u`` times the total weight, the weights being
``exp((logit - max) / temperature)``: the inverse of the distribution's CDF at ``u``, the rule the host's
`strata_runtime.engine.sampling.Sampler.draw` follows, so one uniform per row gives a token with exactly the
softmax distribution.

This is the NumPy path (virtual CPU devices), in float64; the CUDA kernel ``choose_rows`` of
`strata_runtime.cuda.kernels` sums in float32 and may differ where ``u`` falls within rounding of a boundary
between two tokens.
"""

from __future__ import annotations

import numpy as np


def choose_tokens(logits: np.ndarray, inv_temp: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """The chosen token of each row of ``logits`` [R, V]: the argmax (lowest index on ties) where
    ``inv_temp`` [R] is 0, else the draw at ``uniform`` [R] (in [0, 1)) from softmax(logits * inv_temp)."""
    out = np.empty(logits.shape[0], dtype=np.int64)
    for r, row in enumerate(np.asarray(logits, dtype=np.float64)):
        if inv_temp[r] <= 0:
            out[r] = int(np.argmax(row))
            continue
        weights = np.exp((row - row.max()) * float(inv_temp[r]))  # [V]
        cdf = np.cumsum(weights)
        at = int(np.searchsorted(cdf, float(uniform[r]) * cdf[-1], side="right"))
        out[r] = min(
            at, int(np.flatnonzero(weights)[-1])
        )  # u * total rounded up to the total: the last token
    return out
