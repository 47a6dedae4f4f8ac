"""The engine's self-check: one fixed greedy request whose log-probabilities say whether the model still
computes what it computed when the engine started.

`Engine.self_check` runs it alone: the first time to record what a sound engine gives, and after the engine
has recovered from a failed step (`Engine.recover`) to compare. The request asks for its prompt's
log-probabilities, so its whole prompt is read through every layer (no kept prefix stands in for it), and for
those of its reply, whose tokens come from decode windows. A model whose weights, caches or buffers were
left broken gives other numbers; a sound one gives the same, up to `TOLERANCE` (windows of other shapes
add in other orders).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ..api import Request, SamplingParams, TokenEvent, TokenLogprob

PROBE_PROMPT = 64
"""Prompt tokens of the probe (fewer where the context is shorter): enough that their routing reaches most
of a layer's experts (64 tokens of top-8 routing make 512 choices among 128 experts), so that a broken
expert shows."""
PROBE_REPLY = 3
"""Tokens the probe generates: the first from the prompt's last row, the others from decode windows."""
TOP = 2
"""Alternatives whose log-probabilities are compared at each position besides the token's own."""
TOLERANCE = 0.1
"""The most a log-probability may move between two readings of a sound engine, in nats. Windows of other
row counts sum in other orders, which in fp16 should move a log-probability far less; a broken weight, cache
or buffer moves them by tenths of a nat or more, or makes them NaN (one expert of the tiny preset scaled by
4: 0.35 to 1.8 in 31 of its 32 places)."""


def probe_request(vocab: int, context: int) -> Request:
    """The self-check's request: a fixed prompt of ids spread over the vocabulary (none 0), greedy, past
    any end-of-text id."""
    n = max(1, min(PROBE_PROMPT, context - PROBE_REPLY - 1))
    ids = tuple(1 + (7919 * (j + 1)) % max(vocab - 1, 1) for j in range(n))
    reply = max(1, min(PROBE_REPLY, context - n - 1))
    sampling = SamplingParams(logprobs=TOP, prompt_logprobs=TOP)
    return Request(ids, reply, sampling, request_id="self-check", ignore_eos=True)


@dataclass(frozen=True)
class Reading:
    """What the probe gave: each prompt token's log-probability after the tokens before it (all but the
    first), then each reply token's."""

    logprobs: tuple[TokenLogprob, ...]


def read(events: Iterable[TokenEvent]) -> Reading:
    """The probe's reading from its events; raises RuntimeError where the engine ended it with an error."""
    prompt: tuple[TokenLogprob, ...] = ()
    reply: list[TokenLogprob] = []
    for ev in events:
        if ev.finished == "error":
            raise RuntimeError(f"the self-check request failed: {ev.error}")
        prompt = prompt or ev.prompt_logprobs
        reply += ev.logprobs
    return Reading((*prompt, *reply))


def _near(a: float, b: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= TOLERANCE


def disagreement(start: Reading, now: Reading) -> str | None:
    """Where ``now`` departs from ``start`` by more than `TOLERANCE`, in words; None where it does not.

    Position by position: the same token with a log-probability within the tolerance, and each of
    ``start``'s alternatives that ``now`` also reports within it. Where the greedy reply takes another
    token, ``start`` must have rated that token within the tolerance of its own (a near tie, which windows
    of another shape may break the other way); the readings part there, and nothing after is compared."""
    if len(now.logprobs) != len(start.logprobs):
        return f"it gave {len(now.logprobs)} log-probabilities, against {len(start.logprobs)} at start"
    for i, (a, b) in enumerate(zip(start.logprobs, now.logprobs, strict=True)):
        where = f"position {i + 1}"
        if a.token != b.token:
            rated = dict(a.top).get(b.token)
            if rated is None or not _near(rated, a.logprob):
                return f"{where}: it chose token {b.token}, where at start it chose {a.token}"
            return None
        if not _near(a.logprob, b.logprob):
            return (
                f"{where}: token {a.token}'s log-probability is {b.logprob:.4g}, against {a.logprob:.4g} "
                "at start"
            )
        others = dict(b.top)
        for token, lp in a.top:
            if token in others and not _near(lp, others[token]):
                return (
                    f"{where}: alternative {token}'s log-probability is {others[token]:.4g}, against "
                    f"{lp:.4g} at start"
                )
    return None
