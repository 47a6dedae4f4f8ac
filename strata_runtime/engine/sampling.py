"""Choosing tokens: greedy argmax, or temperature / top-k / top-p sampling from a per-request seeded RNG,
after a request's logit bias and presence / frequency penalties.

The adjustments come first, on the raw logits, as OpenAI and vLLM define them: ``logit_bias[t]`` is added to
token t's logit, and a token generated c > 0 times so far loses ``frequency_penalty * c + presence_penalty``
(`strata_runtime.models.ops.adjust`, whose arithmetic the device's kernel shares bit for bit). Temperature,
top-k and top-p then shape what is left; greedy takes the argmax of the adjusted logits.

The target's and the drafter's logits go through the same adjustments and the same `distribution`, so
speculative rejection sampling reproduces exactly the distribution a user asked for. A row of a speculative
window follows proposals that are not generated yet; `Sampler.adjusted` counts them as generated for the
rows after them, which is what the row's token would see if those proposals are accepted, and a row is only
ever used when they are.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..api import SamplingParams
from ..backend import Array
from ..model import adjust_row


def distribution(logits: Array, params: SamplingParams, xp: Any = np, *, sort_rows: bool = False) -> Array:
    """Next-token probabilities [n, V] (float64) after temperature, top-k and top-p, on ``xp`` arrays (NumPy
    on the host, CuPy for a window decided on the GPU: the same steps). Top-p sorts each whole row on the
    GPU and with ``sort_rows``; on the host it otherwise sorts a row's likeliest tokens (`nucleus_host`),
    for the same distribution."""
    x = xp.asarray(logits, dtype=xp.float64) / max(params.temperature, 1e-6)  # [n, V]
    if 0 < params.top_k < x.shape[-1]:
        kth = xp.partition(x, -params.top_k, axis=-1)[:, -params.top_k][:, None]  # [n, 1]
        x = xp.where(x < kth, -xp.inf, x)
    p = xp.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)  # [n, V]
    if params.top_p < 1.0:
        keep = nucleus(p, params.top_p, xp) if sort_rows or xp is not np else nucleus_host(p, params.top_p)
        p = xp.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def nucleus(p: Array, top_p: float, xp: Any = np) -> Array:
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


def inverse_cdf(probs: Array, u: Any, xp: Any = np) -> Any:
    """The token [V] -> index whose cumulative weight first exceeds ``u`` (in [0, 1)) times the total: a draw
    from ``probs`` (which need not sum to 1) at ``u``, on ``xp`` arrays (``u`` may be a device scalar)."""
    cdf = xp.cumsum(probs)
    return xp.minimum(xp.searchsorted(cdf, u * cdf[-1], side="right"), probs.shape[-1] - 1)


class Sampler:
    """One request's token chooser: greedy, or seeded sampling, after its logit bias and penalties.

    It counts the request's generated tokens (`record`), which the penalties read. Where its rows adjust on
    the device (`strata_runtime.model.adjust`), it also knows what the device's counts lack: every token
    until the first such window (``on_device`` is then False), then those the host decided.
    """

    def __init__(self, params: SamplingParams, seed: int) -> None:
        self.params = params
        self.greedy = params.temperature <= 0.0
        self.rng = np.random.default_rng(seed)
        self.adjusts = bool(params.presence_penalty or params.frequency_penalty or params.logit_bias)
        """The logits change before a token is chosen (a bias or a penalty is set)."""
        self.counts: Counter[int] = Counter()
        """How often each token was generated for this request so far."""
        bias: dict[int, float] = {}
        for token, value in params.logit_bias:  # a token named twice gets both biases
            bias[token] = bias.get(token, 0.0) + value
        self.bias_ids = np.array(list(bias), dtype=np.int64)
        self.bias = np.array(list(bias.values()), dtype=np.float64)
        self.on_device = False
        """Whether the last stage's device holds this request's counts and bias (after its first window
        that adjusts there)."""
        self.uncounted: list[int] = []
        """Tokens the host decided since the device's counts were last brought up to date."""

    @property
    def inv_temperature(self) -> float:
        """1 / temperature for a draw on the device; 0 for greedy (the argmax)."""
        return 0.0 if self.greedy else 1.0 / self.params.temperature

    @property
    def needs_logits(self) -> bool:
        """Whether choosing on the host needs the logits: sampling, or greedy over adjusted logits (a plain
        greedy choice is the device's argmax)."""
        return not self.greedy or self.adjusts

    def record(self, tokens: Iterable[int], counted: bool = False) -> None:
        """Tokens now generated for the request (the penalties count them); ``counted``: the device chose
        them and has counted them already."""
        if self.adjusts:
            tokens = list(tokens)
            self.counts.update(tokens)
            if self.on_device and not counted:
                self.uncounted += tokens

    def device_update(self) -> tuple[bool, dict[int, int]]:
        """What the device's counts lack before this request's next row adjusts there: (whether they start
        afresh, with the bias, token -> times to add). Called once for each such window, in launch order."""
        fresh = not self.on_device
        add = dict(self.counts) if fresh else dict(Counter(self.uncounted))
        self.on_device, self.uncounted = True, []
        return fresh, add

    def adjusted(self, logits: np.ndarray, drafted: Sequence[int] = ()) -> np.ndarray:
        """Logits [n, V] after the logit bias and the penalties, as float64 (a copy), float32 values where
        they change (`strata_runtime.models.ops.adjust`).

        ``drafted`` are proposals not generated yet that the rows follow: the last row follows all of them
        and each row before it one fewer (a verified window's row j follows proposals[:j]; a drafter's one
        row follows its whole chain so far). They count as generated for the rows that follow them.
        """
        if not self.adjusts:
            return np.asarray(logits, dtype=np.float64)
        rows = np.asarray(logits)
        freq, presence = self.params.frequency_penalty, self.params.presence_penalty
        first_row = rows.shape[0] - len(drafted)  # the first row that follows drafted[0]
        out = np.empty(rows.shape, dtype=np.float64)
        for j in range(rows.shape[0]):
            counts = self.counts + Counter(drafted[: max(0, j - first_row + 1)])
            out[j] = adjust_row(rows[j], counts, self.bias_ids, self.bias, freq, presence)
        return out

    def draw(self, probs: np.ndarray) -> int:
        """One token from a distribution [V]."""
        return int(inverse_cdf(probs, self.rng.random()))

    def uniform(self) -> float:
        return float(self.rng.random())
