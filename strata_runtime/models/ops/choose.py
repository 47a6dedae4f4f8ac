"""Choosing each row's token where the logits are: the argmax, or a draw at a uniform the host drew.

A row whose request needs nothing but the logits to choose (greedy, or plain temperature sampling, with no
logit bias, penalty, top-k or top-p) has its token chosen on the last stage's device, so that a decode window
can be queued before the host has read the token the window before it chose. A draw takes the first token
whose cumulative weight, in token order, exceeds ``u`` times the total weight, the weights being
``exp((logit - max) / temperature)``: the inverse of the distribution's CDF at ``u``, the rule the host's
`strata_runtime.engine.sampling.Sampler.draw` follows, so one uniform per row gives a token with exactly the
softmax distribution.

On virtual CPU devices this is the NumPy rule of `strata_runtime.reference.kernels.choose_tokens`, in
float64; the CUDA kernel ``choose_rows`` (kernels.cu, launched by `strata_runtime.cuda.head.CudaHead.choose`)
sums in float32 and may differ where ``u`` falls within rounding of a boundary between two tokens.
"""

from __future__ import annotations

from ...reference.kernels import choose_tokens

__all__ = ["choose_tokens"]
