"""Speculative windows decided on the device: accept, catch the drafters up and draft the next window there.

A speculative window (solo drafting, or batch MTP) holds S slots of ``n`` rows each: the slot's token, then
``n - 1`` proposals. When its slots all carry that many, the whole decision after the target's logits runs on
the last stage's device, on that stage's stream, right after the window's chosen tokens (`decide`). A slot
with a logit bias or penalties (which depend on every token emitted so far) has its rows adjusted before
they are chosen, each counting the proposals before it, from the slot's token counts on the device
(`strata_runtime.model.adjust`); its drafts are adjusted the same way, and what it keeps is counted:

* **accept**: a greedy slot keeps ``a_i + 1`` rows, where ``a_i`` is how many of its proposals, from the
  first, equal the target's choice at the row before (`leading_matches`); a sampled slot accepts each
  proposal with probability min(1, p/q) and draws the token after the kept ones from the residual
  (`strata_runtime.model.placed.Model.verify_sampled`, one kernel on a GPU), at uniforms the host drew from
  the request's seeded generator when it launched the window;
* **catch up**: the MTP head runs over all ``n`` rows of every slot. Row j reads the token that follows it
  if it is kept (a kept proposal, or at row ``a_i`` the token after the kept ones; for a greedy slot simply
  the target's choice at row j), and the row's post-norm hidden state. Rows past ``a_i`` compute values
  nobody keeps: attention reads only positions up to a row's own, and the next window starts at the first
  rejected position, so it overwrites them;
* **draft**: the head's output at row ``a_i`` gives the next window's first proposal (its argmax, or a draw
  from its distribution); each further one runs the head one position on, on its own previous proposal and
  output, as host drafting does.

What comes out is the next window's input tokens and positions, on the device, so that a window chained to
this one (`strata_runtime.engine.flight.Chained` without rows) is queued before the host has seen any of it.
The host learns the outcome when it finishes the window: it reads the accept counts, the token after them,
the window's input tokens and positions, checks a greedy slot's decision against
`strata_runtime.engine.speculative.verify`, and accounts the KV (`strata_runtime.model.placed.Model.settle`).
The same functions run on NumPy arrays on CPU devices and on CuPy arrays on GPUs; a sampled slot's
distributions come from `strata_runtime.model.placed.Model.distribution`, one kernel on a GPU.

Under n-gram lookup (``spec.method = "ngram"``) a solo window's proposals come from the request's own text,
and `decide_lookup` takes the place of the accept, catch-up and draft steps: it keeps the proposals by the
rows' choices, writes those into the slot's token history on the device, and looks the next window's
proposals up there (`strata_runtime.model.placed.Model.look_up`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..api import SamplingParams
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
    params: tuple[SamplingParams | None, ...] | None = None
    """Each slot's sampling (None for a greedy slot); None when every slot is greedy."""
    penalties: tuple[tuple[float, float, float] | None, ...] | None = None
    """Each slot's (frequency, presence, repetition) penalties where its request has a logit bias or
    penalty (None for the others); None when no slot has: its rows' logits are adjusted before they are
    chosen, its drafts' before they are drawn, and the tokens it keeps are counted
    (`strata_runtime.model.adjust`)."""
    uniforms: Any = None
    """Sampled windows: each slot's draws [S, 2n - 1] (host array at launch, then on the last device):
    n - 1 to accept the proposals, one for the token after them, n - 1 for the next window's proposals."""
    accepted: Array = None
    """How many proposals each slot keeps [S]."""
    first: Array = None
    """Each slot's token after its kept proposals [S]: the target's choice, or the sampled draw."""
    next_tokens: Array = None
    """The next window's input ids [S n]: each slot's chosen token, then the proposals drafted after it."""
    next_positions: Array = None
    """The next window's positions [S n]: each slot's rows from its first rejected position on."""
    host: dict[str, np.ndarray] = field(default_factory=dict)
    """``accepted``, ``first``, ``tokens`` and ``positions`` on the host (pinned copies the host did not wait
    for)."""
    lookup: tuple[int, int] | None = None
    """The shortest and longest runs an n-gram lookup matches, where the proposals are looked up in each
    slot's own text (``spec.method = "ngram"``) rather than drafted by the MTP head (`decide_lookup`)."""
    history: Array = None
    """Looked-up windows: every slot's tokens by position [slots, C] (int64, on the last device), which the
    decision writes each slot's chosen tokens into and looks the next proposals up in."""
    found: Array = None
    """Looked-up windows: whether each slot's lookup for the next window found a run [S] (where not, the
    next window's proposals only repeat the slot's last token, and the host ends the chain)."""
    sync: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    """Looked-up windows the host launched: (slot, first position, tokens) of each slot's text that its
    history lacks, written before the decision reads it."""


def leading_matches(xp: Any, tokens: Array, picks: Array) -> Array:
    """[S]: for windows of S slots, tokens and target choices [S, n] each, how many of each slot's
    proposals (tokens[:, 1:]) hold, from the first: proposal j holds while it equals picks[:, j - 1]."""
    s, n = tokens.shape
    if n == 1:
        return xp.zeros(s, dtype=xp.int64)
    match = (tokens[:, 1:] == picks[:, :-1]).astype(xp.int64)  # [S, n - 1]
    return xp.cumprod(match, axis=1).sum(axis=1)


def decide(
    model: Model, spec: DeviceSpec, chosen: Array, logits: Array, normed: Array, layout: Layout
) -> None:
    """Decide ``spec``'s window from its chosen tokens [S n] (each row's argmax), logits [S n, V] and
    post-norm rows [S n, H] on the last device (current stream), leaving ``accepted``, ``first`` (each
    slot's token after its kept proposals), ``next_tokens`` and ``next_positions`` there, and each slot's
    drafter as host drafting leaves it (row j: the hidden state and logits proposal j + 1 came from).
    ``layout`` gives the window's slots and row counts; its positions are ``spec.positions``."""
    if spec.lookup is not None:
        decide_lookup(model, spec, chosen)
        return
    mtp = model.mtp
    assert mtp is not None, "a window decided on the device drafts with the MTP head"
    xp = model.last.device.xp
    s, n = len(spec.slots), spec.n
    drafters = {slot: model.drafters[slot] for slot in spec.slots}
    assert not any(d.pending_rows for d in drafters.values()), "a drafting window's drafters are caught up"
    each = xp.arange(s)
    if spec.params is None:  # every slot greedy
        accepted, first = _accept(xp, spec.tokens, chosen, s, n)
        follow = chosen  # row j's next token: the target's choice, for every kept row
    else:
        accepted, first, follow = _accept_each(model, spec, chosen, logits, drafters)
    if spec.penalties is not None:  # before the drafts: they see what this window kept
        _count_kept(model, spec, accepted, first)
    start = spec.positions.reshape(s, n)[:, 0] + accepted + 1  # [S]: each slot's first rejected position
    dtype = drafters[spec.slots[0]].hidden.dtype
    out = mtp(drafters, follow, normed, layout, positions=spec.positions, account=False)  # [S n, H]
    kept = out.reshape(s, n, -1)[each, accepted]  # [S, H]: the output at each slot's last kept row
    draft = mtp.logits(kept)  # [S, V]
    hidden = kept.astype(dtype)
    proposals = [_propose(model, spec, draft, 0, [])]  # [S] each
    _keep_draft(drafters, spec, 0, hidden, draft)
    one_row = Layout.of([(slot, 1, 0) for slot in spec.slots])  # positions: `start` + j - 1
    # A window that ends near the context drafts proposals the next window has no room for (it is built with
    # fewer, or not at all): their rows run at the context's last position, which no kept row reads again
    # (a slot that has filled its context ends), instead of past the end of the drafters' KV.
    last = mtp.rope.context - 1
    for j in range(1, n - 1):
        at = xp.minimum(start + (j - 1), last)
        head = mtp(drafters, proposals[-1], hidden, one_row, positions=at, account=False)
        draft = mtp.logits(head)  # [S, V]
        hidden = head.astype(dtype)
        _keep_draft(drafters, spec, j, hidden, draft)
        proposals.append(_propose(model, spec, draft, j, proposals))
    spec.accepted, spec.first = accepted, first
    spec.next_tokens, spec.next_positions = _next_window(xp, first, proposals, start, n)


def decide_lookup(model: Model, spec: DeviceSpec, chosen: Array) -> None:
    """Decide a looked-up window (`DeviceSpec.lookup`) from its chosen tokens [S n] on the last device: each
    row's argmax, or for a sampled slot each row's draw (the window's rows are drawn as any sampled row is).

    A proposal holds while it equals the choice at the row before it, for a sampled slot as much as for a
    greedy one: a looked-up proposal is certain of its token, and for such a proposal the rejection rule is
    exactly that (it holds with the target's probability of it, and otherwise the row's draw, which is then
    some other token, is the target's distribution without it). Each slot's chosen tokens go into its history
    at the positions after its token's (where they are not kept, a later window overwrites them before any
    lookup reads them), and the next proposals are looked up in the text up to the token after the kept ones
    (`strata_runtime.model.placed.Model.look_up`)."""
    assert spec.lookup is not None and spec.history is not None
    assert spec.penalties is None, "a request with a logit bias or penalties verifies its lookups on the host"
    device = model.last.device
    xp, s, n = device.xp, len(spec.slots), spec.n
    history = spec.history
    for slot, at, tokens in spec.sync:
        history[slot, at : at + len(tokens)] = device.upload(tokens)
    picks = chosen.reshape(s, n).astype(xp.int64)
    accepted = leading_matches(xp, spec.tokens.reshape(s, n), picks)
    first = picks[xp.arange(s), accepted]
    base = spec.positions.reshape(s, n)[:, 0]  # [S]: each slot's token's position
    start = base + accepted + 1  # [S]: each slot's first rejected position, where ``first`` goes
    rows = device.upload(np.asarray(spec.slots, np.int64))
    history[rows[:, None], base[:, None] + xp.arange(1, n + 1)[None, :]] = picks
    shortest, longest = spec.lookup
    proposals, spec.found = model.look_up(history[rows], start + 1, shortest, longest, n - 1)
    spec.accepted, spec.first = accepted, first
    spec.next_tokens, spec.next_positions = _next_window(xp, first, list(proposals.T), start, n)


def _keep_draft(drafters: dict[int, Any], spec: DeviceSpec, j: int, hidden: Array, logits: Array) -> None:
    """Row j of each slot's drafter: the hidden state and logits proposal j + 1 is drawn from."""
    for i, slot in enumerate(spec.slots):
        drafters[slot].hidden[j : j + 1] = hidden[i : i + 1]
        drafters[slot].logits[j : j + 1] = logits[i : i + 1]


def _adjust(
    model: Model, spec: DeviceSpec, logits: Array, tokens: Array | None, at: list[tuple[int, int, int, int]]
) -> None:
    """Adjust rows of logits in place, each (slot i of the window, the row, where the proposals it follows
    start in ``tokens``, how many) by slot i's bias and penalties."""
    assert spec.penalties is not None
    pens = [spec.penalties[i] for i, *_ in at]
    assert None not in pens, "only the slots with a bias or penalties adjust"
    model.token_counts.adjust_rows(
        logits,
        np.array([row for _, row, _, _ in at], np.int64),
        np.array([spec.slots[i] for i, *_ in at], np.int64),
        np.array([p[0] for p in pens if p is not None], np.float64),
        np.array([p[1] for p in pens if p is not None], np.float64),
        tokens,
        np.array([start for _, _, start, _ in at], np.int64),
        np.array([count for *_, count in at], np.int32),
        np.array([p[2] for p in pens if p is not None], np.float64),
    )


def _kept_tokens(xp: Any, tokens: Array, accepted: Array, first: Array, n: int) -> tuple[Array, Array]:
    """The tokens slots kept [k n] and how many times each counts [k n] (int32): each slot's n - 1 proposals
    (tokens [k, n], the window's inputs), 1 where it was kept (j <= accepted [k]) and 0 where not, then the
    token after them (first [k]) once."""
    k = int(tokens.shape[0])
    kept = (xp.arange(1, n)[None, :] <= accepted[:, None]).astype(xp.int32)  # [k, n - 1]
    times = xp.concatenate([kept, xp.ones((k, 1), xp.int32)], axis=1).reshape(-1)
    ids = xp.concatenate([tokens[:, 1:], first[:, None].astype(tokens.dtype)], axis=1).reshape(-1)
    return ids, times


def _count_kept(model: Model, spec: DeviceSpec, accepted: Array, first: Array) -> None:
    """Count what the penalised slots kept (their kept proposals and the token after them) on the device."""
    assert spec.penalties is not None
    device = model.last.device
    xp, n = device.xp, spec.n
    idx = [i for i, pen in enumerate(spec.penalties) if pen is not None]
    with device.use():
        pick = device.upload(np.array(idx, np.int64))
        ids, times = _kept_tokens(xp, spec.tokens.reshape(-1, n)[pick], accepted[pick], first[pick], n)
        slots = device.upload(np.repeat(np.array([spec.slots[i] for i in idx], np.int64), n))
        model.token_counts.count(slots, ids, times)


def _propose(model: Model, spec: DeviceSpec, logits: Array, j: int, before: list[Array]) -> Array:
    """Each slot's proposal j + 1 [S] from draft logits [S, V]: the argmax, or for a sampled slot a draw
    from its distribution at the uniform drawn for it; a penalised slot's logits adjusted first (a copy),
    counting the proposals ``before`` it ([S] each), as host drafting adjusts them."""
    xp = model.last.device.xp
    if spec.penalties is not None:
        with model.last.device.use():
            logits = logits.copy()
            tokens = xp.stack(before, axis=1).reshape(-1) if before else None  # [S j]: slot i's at i * j
            at = [(i, i, i * j, j) for i, pen in enumerate(spec.penalties) if pen is not None]
            _adjust(model, spec, logits, tokens, at)
    if spec.params is None:
        return model.argmax(logits)
    picks = model.argmax(logits) if None in spec.params else None  # for the greedy slots among them
    out = []
    for i, params in enumerate(spec.params):
        if params is None:
            assert picks is not None
            out.append(picks[i])
        else:
            q = model.distribution(logits[i : i + 1], params)
            out.append(model.draw(q, spec.uniforms[i, spec.n + j : spec.n + j + 1])[0])
    return xp.stack(out).astype(xp.int64)


def _accept_each(
    model: Model, spec: DeviceSpec, chosen: Array, logits: Array, drafters: dict[int, Any]
) -> tuple[Array, Array, Array]:
    """(accepted [S], the token after the kept proposals [S], each row's next token [S n]) slot by slot,
    greedy slots as `_accept` decides them and sampled ones by `Model.verify_sampled`."""
    assert spec.params is not None and spec.uniforms is not None
    xp, n = model.last.device.xp, spec.n
    accepted, first, follow = [], [], []
    for i, params in enumerate(spec.params):
        rows = slice(i * n, (i + 1) * n)
        if params is None:
            a, f = _accept(xp, spec.tokens[rows], chosen[rows], 1, n)
            accepted.append(a[0])
            first.append(f[0])
            follow.append(chosen[rows])
            continue
        draft = drafters[spec.slots[i]].logits[: n - 1]  # what this window's proposals were drawn from
        if spec.penalties is not None and spec.penalties[i] is not None:  # as they were drawn: adjusted,
            draft = draft.copy()  # row k counting proposals 1..k
            _adjust(model, spec, draft, spec.tokens[rows], [(i, k, 1, k) for k in range(n - 1)])
        p, q = model.distribution(logits[rows], params), model.distribution(draft, params)
        a, f = model.verify_sampled(p, q, spec.tokens[rows], spec.uniforms[i])
        nxt = xp.concatenate([spec.tokens[rows][1:], f[None]])  # a kept row is followed by the next input
        nxt[a] = f
        accepted.append(a)
        first.append(f)
        follow.append(nxt)
    return xp.stack(accepted), xp.stack(first).astype(xp.int64), xp.concatenate(follow)


def _accept(xp: Any, tokens: Array, chosen: Array, s: int, n: int) -> tuple[Array, Array]:
    """(accepted [S], each slot's next input [S]) of a greedy window of S slots of n rows: its input ids
    and chosen ids [S n]."""
    picks = chosen.reshape(s, n)
    accepted = leading_matches(xp, tokens.reshape(s, n), picks)
    return accepted, picks[xp.arange(s), accepted]


def _next_window(xp: Any, first: Array, proposals: list[Array], start: Array, n: int) -> tuple[Array, Array]:
    """The next window's input ids and positions [S n]: each slot's next input then its proposals, at
    consecutive positions from its first rejected one."""
    tokens = xp.stack([first, *proposals], axis=1).reshape(-1).astype(xp.int64)
    return tokens, (start[:, None] + xp.arange(n)).reshape(-1).astype(xp.int64)


REHEARSED = SamplingParams(temperature=1.0, top_k=2, top_p=0.5)
"""The sampling `prepare` rehearses a sampled decision with: temperature, top-k and top-p together, so every
step `distribution` can take runs."""


def prepare(model: Model, shapes: set[tuple[int, int]], history: Array = None) -> None:
    """Run the array steps of `decide` once for each window shape (S slots, n rows) on dummy values, on the
    last stage's device: a greedy slot's, and a sampled slot's (`verify_sampled` and a draft's draw, with
    `REHEARSED`) for each n. CuPy compiles a kernel the first time it meets an operation on arrays of a new
    kind of shape (a single slot's [1, n] reduces differently from [2, n]: about 0.4 s of compiles for the
    greedy steps, timed alone on an H200); done at start, no window waits for it. On CPU devices the same
    steps run once and compile nothing."""
    device = model.last.device
    if history is not None:
        _prepare_lookup(model, shapes, history)
        return
    if model.mtp is None or not model.drafters or not shapes:
        return
    xp, a = device.xp, model.args
    dtype = next(iter(model.drafters.values())).hidden.dtype
    with device.use():
        for s, n in sorted(shapes):
            ids = xp.zeros(s * n, xp.int64)
            accepted, first = _accept(xp, ids, ids, s, n)
            start = ids.reshape(s, n)[:, 0] + accepted + 1
            rows = xp.zeros((s * n, a.hidden_size), xp.float32).reshape(s, n, -1)[xp.arange(s), accepted]
            rows.astype(dtype)
            _next_window(xp, first, [xp.zeros(s, xp.int64)] * (n - 1), start, n)
            pick = xp.arange(s)  # a penalised slot's kept tokens (`_count_kept`), without counting them
            _kept_tokens(xp, ids.reshape(-1, n)[pick], accepted[pick], first[pick], n)
            xp.stack([first] * (n - 1), axis=1).reshape(-1)  # the proposals a penalised draft follows
        slot = next(iter(model.drafters))  # its draft logits are read, never written
        for n in sorted({n for _, n in shapes}):
            spec = DeviceSpec((slot,), n, tokens=xp.zeros(n, xp.int64), params=(REHEARSED,))
            spec.uniforms = xp.full((1, 2 * n - 1), 0.5)
            logits = xp.zeros((n, a.vocab_size), xp.float32)
            _accept_each(model, spec, xp.zeros(n, xp.int64), logits, model.drafters)
            _propose(model, spec, logits[:1], 0, [])
        if device.is_cuda:
            xp.cuda.get_current_stream().synchronize()


def _prepare_lookup(model: Model, shapes: set[tuple[int, int]], history: Array) -> None:
    """`decide_lookup` once for each window shape, on a scratch history of the same width (the lookup kernel
    compiled, and CuPy's kernels for the steps around it)."""
    device = model.last.device
    xp = device.xp
    with device.use():
        for s, n in sorted(shapes):
            scratch = xp.zeros((s, history.shape[1]), xp.int64)
            spec = DeviceSpec(tuple(range(s)), n, lookup=(1, 1), history=scratch)
            spec.tokens = xp.zeros(s * n, xp.int64)
            spec.positions = xp.tile(xp.arange(n, dtype=xp.int64), s)
            spec.sync = [(0, 0, np.zeros(1, np.int64))]
            decide_lookup(model, spec, xp.zeros(s * n, xp.int64))
        if device.is_cuda:
            xp.cuda.get_current_stream().synchronize()
