"""Speculative windows decided on the device: accept, catch the drafters up and draft the next window there.

A greedy speculative window (solo drafting, or batch MTP) holds S slots of ``n`` rows each: the slot's
token, then ``n - 1`` proposals. When no row needs the host (no logit bias, no penalty, no sampling), the
whole decision after the target's argmax runs on the last stage's device, on that stage's stream, right
after the window's chosen tokens (`decide`):

* **accept**: slot i keeps ``a_i + 1`` rows, where ``a_i`` is how many of its proposals, from the first,
  equal the target's choice at the row before (`leading_matches`);
* **catch up**: the MTP head runs over all ``n`` rows of every slot. Row j reads the target's choice at row
  j, which for every kept row is exactly the token that follows it (a kept proposal equals the choice
  before it), and the row's post-norm hidden state. Rows past ``a_i`` compute values nobody keeps: attention
  reads only positions up to a row's own, and the next window starts at the first rejected position, so it
  overwrites them;
* **draft**: the head's output at row ``a_i`` gives the next window's first proposal; each further one runs
  the head one position on, on its own previous proposal and output, as host drafting does.

What comes out is the next window's input tokens and positions, on the device, so that a window chained to
this one (`strata_runtime.engine.flight.Chained` without rows) is queued before the host has seen any of it.
The host learns the outcome when it finishes the window: it reads the accept counts, the window's input
tokens and positions, checks the device's decision against `strata_runtime.engine.speculative.verify`, and
accounts the KV (`strata_runtime.model.placed.Model.settle`). The same functions run on NumPy arrays on CPU
devices and on CuPy arrays on GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend import Array
from ..layout import Layout
from ..model import Model


@dataclass(eq=False)
class DeviceSpec:
    """What a speculative window decided on the device carries: its shape (known on the host at launch) and
    its arrays on the last stage's device (set while it runs), with their host copies for `finish`."""

    slots: tuple[int, ...]
    n: int
    """Rows per slot: its token, then ``n - 1`` proposals."""
    tokens: Array = None
    """The window's input ids [S n] (on the last device)."""
    positions: Array = None
    """The window's positions [S n] (on the last device)."""
    accepted: Array = None
    """How many proposals each slot keeps [S]."""
    next_tokens: Array = None
    """The next window's input ids [S n]: each slot's chosen token, then the proposals drafted after it."""
    next_positions: Array = None
    """The next window's positions [S n]: each slot's rows from its first rejected position on."""
    host: dict[str, np.ndarray] = field(default_factory=dict)
    """``accepted``, ``tokens`` and ``positions`` on the host (pinned copies the host did not wait for)."""


def leading_matches(xp: Any, tokens: Array, picks: Array) -> Array:
    """[S]: for windows of S slots, tokens and target choices [S, n] each, how many of each slot's
    proposals (tokens[:, 1:]) hold, from the first: proposal j holds while it equals picks[:, j - 1]."""
    s, n = tokens.shape
    if n == 1:
        return xp.zeros(s, dtype=xp.int64)
    match = (tokens[:, 1:] == picks[:, :-1]).astype(xp.int64)  # [S, n - 1]
    return xp.cumprod(match, axis=1).sum(axis=1)


def decide(model: Model, spec: DeviceSpec, chosen: Array, normed: Array, layout: Layout) -> None:
    """Decide ``spec``'s window from its chosen tokens [S n] and post-norm rows [S n, H] on the last
    device (current stream), leaving ``accepted``, ``next_tokens`` and ``next_positions`` there, and each
    slot's drafter as host drafting leaves it (row j: the hidden state and logits proposal j + 1 came from).
    ``layout`` gives the window's slots and row counts; its positions are ``spec.positions``."""
    mtp = model.mtp
    assert mtp is not None, "a window decided on the device drafts with the MTP head"
    xp = model.last.device.xp
    s, n = len(spec.slots), spec.n
    each, accepted, first, start = _accept(xp, spec.tokens, chosen, spec.positions, s, n)
    drafters = {slot: model.drafters[slot] for slot in spec.slots}
    dtype = drafters[spec.slots[0]].hidden.dtype
    out = mtp(drafters, chosen, normed, layout, positions=spec.positions, account=False)  # [S n, H]
    kept = out.reshape(s, n, -1)[each, accepted]  # [S, H]: the output at each slot's last kept row
    logits = mtp.logits(kept)  # [S, V]
    hidden = kept.astype(dtype)
    for i, slot in enumerate(spec.slots):
        drafters[slot].hidden[0:1] = hidden[i : i + 1]
        drafters[slot].logits[0:1] = logits[i : i + 1]
    proposals = [model.argmax(logits)]  # [S] each
    one_row = Layout.of([(slot, 1, 0) for slot in spec.slots])  # positions: `start` + j - 1
    for j in range(1, n - 1):
        head = mtp(drafters, proposals[-1], hidden, one_row, positions=start + (j - 1), account=False)
        logits = mtp.logits(head)  # [S, V]
        hidden = head.astype(dtype)
        for i, slot in enumerate(spec.slots):
            drafters[slot].hidden[j : j + 1] = hidden[i : i + 1]
            drafters[slot].logits[j : j + 1] = logits[i : i + 1]
        proposals.append(model.argmax(logits))
    spec.accepted = accepted
    spec.next_tokens, spec.next_positions = _next_window(xp, first, proposals, start, n)


def _accept(xp: Any, tokens: Array, chosen: Array, positions: Array, s: int, n: int) -> tuple[Array, ...]:
    """(slot index [S], accepted [S], each slot's next input [S], its first rejected position [S]) of a
    window of S slots of n rows: input ids, chosen ids and positions [S n]."""
    each = xp.arange(s)
    picks = chosen.reshape(s, n)
    accepted = leading_matches(xp, tokens.reshape(s, n), picks)
    return each, accepted, picks[each, accepted], positions.reshape(s, n)[:, 0] + accepted + 1


def _next_window(xp: Any, first: Array, proposals: list[Array], start: Array, n: int) -> tuple[Array, Array]:
    """The next window's input ids and positions [S n]: each slot's next input then its proposals, at
    consecutive positions from its first rejected one."""
    tokens = xp.stack([first, *proposals], axis=1).reshape(-1).astype(xp.int64)
    return tokens, (start[:, None] + xp.arange(n)).reshape(-1).astype(xp.int64)


def prepare(model: Model, shapes: set[tuple[int, int]]) -> None:
    """Run the array steps of `decide` once for each window shape (S slots, n rows) on dummy values, on the
    last stage's device. CuPy compiles a kernel the first time it meets an operation on arrays of a new
    kind of shape (a single slot's [1, n] reduces differently from [2, n]); done at start, no window waits
    for it (the first one-slot batch-MTP window waited about 0.4 s on an H200)."""
    device = model.last.device
    if not device.is_cuda or model.mtp is None:
        return
    xp, a = device.xp, model.args
    dtype = next(iter(model.drafters.values())).hidden.dtype
    with device.use():
        for s, n in sorted(shapes):
            ids = xp.zeros(s * n, xp.int64)
            each, accepted, first, start = _accept(xp, ids, ids, ids, s, n)
            rows = xp.zeros((s * n, a.hidden_size), xp.float32).reshape(s, n, -1)[each, accepted]
            rows.astype(dtype)
            _next_window(xp, first, [xp.zeros(s, xp.int64)] * (n - 1), start, n)
        xp.cuda.get_current_stream().synchronize()
