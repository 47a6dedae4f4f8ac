"""A request's logit bias and repetition, presence and frequency penalties, applied where the logits are.

OpenAI's rule, with vLLM's and transformers' repetition penalty r between: ``logit_bias[t]`` is added to token
t's logit; a token seen so far (in the prompt or generated) has that x divided by r where it is above 0 and
multiplied by r otherwise; and a token generated c > 0 times so far loses ``frequency_penalty * c +
presence_penalty``. One arithmetic serves the host and the device, so that a token chosen on either side is
the same: in float64, ``x = l + bias``, then ``x / r`` or ``x * r`` where seen (r not 1), then ``x -
(frequency * c + presence)`` where c > 0, each step rounded once (no fused multiply-add), and the result
rounded once to float32, the logits' own type. The host's `strata_runtime.engine.sampling.Sampler.adjusted`
computes it from the request's own counts; the device keeps every slot's counts and bias
(`strata_runtime.model.adjust.TokenCounts`) and adjusts a window's rows before choosing their tokens, so that
a penalised request's windows run ahead like any other's.

On CPU devices the device's steps are `adjust_logits` and `count_tokens` (NumPy); on GPUs, the kernels of the
same names in kernels.cu.

A request held to a grammar has its rows masked there too (`mask_logits`, ``mask_logits`` of kernels.cu on a
GPU): each token the grammar does not allow becomes minus infinity, by the packed mask the host computed for
the row when it launched the window (`strata_runtime.structured.Matcher.bitmasks_after`).

The device's counts hold a prompt's tokens as `PROMPT_SEEN` added to their count (only for a request with a
repetition penalty): the penalty reads any nonzero count as seen, the other penalties the count below it.

`Adjusts` is what one window asks of the device. Its rows without proposals are chosen there and counted there
as they are chosen; a speculative window decided there counts the tokens it keeps
(`strata_runtime.engine.device_spec`). The tokens the host decided since the slot's last such window (a
prompt's first token, a window verified on the host) come with it and are counted first."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...reference.kernels import PROMPT_SEEN, adjust_logits, count_tokens, mask_logits

__all__ = ["PROMPT_SEEN", "Adjusts", "adjust_logits", "adjust_row", "count_tokens", "mask_logits"]


class Adjusts(NamedTuple):
    """The adjustments of one window's rows on the last stage's device (host arrays).

    ``rows`` [A]: which of the window's logit rows adjust, with each one's ``slot``, ``frequency`` and
    ``presence`` penalties and ``repetition`` penalty (1: none) [A], and the proposals it follows:
    ``extra_count`` [A] of the window's input tokens from row ``extra_from`` [A] on (a speculative window's
    row j follows proposals 1..j; a row without proposals, none). ``chosen_counts`` [A]: whether the row's
    chosen token is counted once chosen (a row without proposals; a speculative window counts what it keeps
    when it is decided). ``fresh``: the slots whose request adjusts there for the first time, each with its
    logit bias (token ids, values): their counts start from zero and the bias replaces the last request's.
    ``counted``: (slot, token, times) [M] each, tokens generated for a slot that its counts do not hold yet,
    added before the rows adjust.
    """

    rows: np.ndarray
    slot: np.ndarray
    frequency: np.ndarray
    presence: np.ndarray
    repetition: np.ndarray
    extra_from: np.ndarray
    extra_count: np.ndarray
    chosen_counts: np.ndarray
    fresh: tuple[tuple[int, np.ndarray, np.ndarray], ...]
    counted: tuple[np.ndarray, np.ndarray, np.ndarray]


def adjust_row(
    logits: np.ndarray,
    counts: dict[int, int],
    bias_ids: np.ndarray,
    bias: np.ndarray,
    frequency: float,
    presence: float,
    repetition: float = 1.0,
    seen: np.ndarray | None = None,
) -> np.ndarray:
    """One row's adjusted logits [V] (float32 values, as float64) from its logits [V], the request's token
    counts (token -> c > 0), its logit bias (ids and float64 values, each id once), its repetition penalty
    and the prompt's tokens ``seen`` (ids, each once): the rule above."""
    x = np.asarray(logits, dtype=np.float32).astype(np.float64)  # a copy
    if bias_ids.size:
        x[bias_ids] += bias
    if repetition != 1.0:
        hit = np.zeros(x.shape, dtype=bool)
        if seen is not None:
            hit[seen] = True
        if counts:
            hit[np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))] = True
        x[hit] = np.where(x[hit] > 0, x[hit] / repetition, x[hit] * repetition)
    if counts:
        ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        c = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
        x[ids] -= frequency * c + presence
    return x.astype(np.float32).astype(np.float64)
