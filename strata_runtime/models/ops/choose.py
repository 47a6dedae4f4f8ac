"""Choosing each row's token where the logits are: the argmax, or a draw at a uniform the host drew.

A row without proposals to verify has its token chosen on the last stage's device (after its request's logit
bias and penalties, `strata_runtime.models.ops.adjust`), so that a decode window can be queued before the
host has read the token the window before it chose. Sampled, the row's weights are
``exp((logit - max) / temperature)`` of the tokens that stay after its top-k cut (the k largest logits and
their ties), its min-p cut (``(logit - max) / temperature`` at least ln(min_p), in float32: a weight at
least min_p) and its top-p cut (in descending order of logit, then ascending index, a token stays while the
weight before it is below top_p times the total), which is what the host's
`strata_runtime.engine.sampling.distribution` keeps. The draw takes the first staying token whose cumulative
weight, in token order, exceeds ``u`` times their total: the inverse of the distribution's CDF at ``u``, the
rule of the host's `strata_runtime.engine.sampling.Sampler.draw`, so one uniform per row gives a token with
exactly that distribution.

On virtual CPU devices this is `strata_runtime.reference.kernels.choose_tokens` (NumPy, float64 weights);
the CUDA kernel ``choose_rows`` (kernels.cu, launched by `strata_runtime.cuda.head.CudaHead.choose`) computes
weights in float32 and may differ where ``u`` or the top-p cut falls within rounding of a boundary between two
tokens. Both sum the weights for the top-p cut in 2^-40 fixed point, so the cut does not depend on the order
of the sum. On a vocabulary large enough to cut into slices, the kernel's passes over the whole row run over
the slices in parallel before one block per row finishes the choice (`strata_runtime.cuda.ops.Kernels.
choose`, "split"): the same token bit for bit, in a third to a half of the time when top-k is set.

A sampled speculative window decided on the device takes the whole distribution a choice would draw from
(the kernel ``distribution_rows``, `strata_runtime.cuda.ops.Kernels.distribution`: the same cuts and float32
weights, over their sum in float64): its proposals are drawn from it and verified against it, so a
request's tokens follow one rule on the device whether its windows draft or not. It replaces the CuPy
partition and whole-row sort the rule's array steps take, about a millisecond a call on an H200.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...reference.kernels import choose_tokens


class Draws(NamedTuple):
    """What the device needs to choose each needed row of a window: 1 / temperature (0: the argmax), the
    uniform the host drew, and the row's top-k (0: none), top-p (1: none) and min-p cut (its float32 log,
    `strata_runtime.models.ops.distribution.log_min_p`; minus infinity: none); each [R]."""

    inv_temp: np.ndarray
    uniform: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    log_min_p: np.ndarray


def choose_on_host(logits: np.ndarray, draws: Draws) -> np.ndarray:
    """The chosen token of each row of ``logits`` [R, V] by the NumPy rule."""
    d = draws
    return choose_tokens(logits, d.inv_temp, d.uniform, d.top_k, d.top_p, d.log_min_p)
