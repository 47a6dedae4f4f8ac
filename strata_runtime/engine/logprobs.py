"""Generated tokens' log-probabilities, for the requests that ask (`SamplingParams.logprobs`).

They are the model's own: the log softmax of the raw logits of the row that decided each token, before the
request's bias, penalties, temperature, top-k and top-p (vLLM's default, ``raw_logprobs``). A window that
holds such a request copies the raw logits of the rows that decide tokens to the host before anything
adjusts them in place (`strata_runtime.engine.executor.Executor`); the host computes each token's figure
here, in float64, when the window is decided. In a drafted window, the token kept at row j (an accepted
proposal or the token after them) gets row j's figure: the target's distribution at that position, whatever
proposed it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..api import TokenLogprob


def token_logprobs(raw: np.ndarray, tokens: Sequence[int], top: int) -> tuple[TokenLogprob, ...]:
    """Token ``tokens[j]``'s log-probability under row j of raw logits [>= len(tokens), V], with the ``top``
    most likely tokens of each row (most likely first; among equal logits the lower id first)."""
    out = []
    for j, token in enumerate(tokens):
        row = np.asarray(raw[j], dtype=np.float64)
        peak = row.max()
        lse = peak + np.log(np.exp(row - peak).sum())
        best: tuple[tuple[int, float], ...] = ()
        if top > 0:
            k = min(top, row.size)
            part = np.argpartition(-row, k - 1)[:k]
            order = part[np.lexsort((part, -row[part]))]
            best = tuple((int(t), float(row[t] - lse)) for t in order)
        out.append(TokenLogprob(int(token), float(row[int(token)] - lse), best))
    return tuple(out)
