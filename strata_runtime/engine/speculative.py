"""Speculative decoding, read as draft -> verify -> accept/rewind.

* `draft` chains proposals from a slot's drafter: the first from its pending logits, each next one by
  running the MTP head on the previous proposal and the head's own previous output.
* `verify` compares the proposals with the target's rows of the same window. Greedy: accept while a
  proposal equals the target's argmax. Sampled: standard speculative rejection sampling (accept with
  min(1, p/q), otherwise resample from norm(max(0, p - q)); a bonus token from p when all are accepted), so
  the output has exactly the target's distribution. Both sides see the request's logit bias and penalties,
  each row as if the proposals before it were generated.
* `commit` is the only way a slot moves on: it rewinds the rejected rows' KV on every stage and in the
  drafter, then catches the drafter up on the accepted rows, which yields the next window's first proposal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from strata_cfg.schema.plan import DEFAULT_DRAFT_FLOOR
from strata_cfg.schema.windows import DEFER_MOST

from ..backend import Array, Device
from ..layout import Layout
from ..model import Model
from .depth import Holds, WindowCosts, best_depth, value, worth_switching
from .sampling import Sampler, distribution


@dataclass
class Proposals:
    """Drafted tokens and, when sampling, the drafter's distribution each was drawn from."""

    tokens: list[int]
    q: list[np.ndarray]
    forced: bool = False
    """The tokens a request's grammar forces next (`forced`), not a drafter's: verified as any proposals,
    each as if drawn from a q certain of it (``q`` stays empty), but not counted as drafting (its gauge,
    its acceptance)."""
    looked_up: bool = False
    """Tokens read from the request's own text (`strata_runtime.engine.lookup`): verified as drawn from a q
    certain of each (``q`` stays empty), and counted as drafting."""

    @property
    def certain(self) -> bool:
        """Whether each proposal was chosen for sure, not drawn (forced or looked up): ``q`` is 1 at it."""
        return self.forced or self.looked_up


def forced(sampler: Sampler, most: int) -> Proposals | None:
    """The tokens a grammar-held request's grammar forces next, at most ``most``, as proposals; None where
    it forces none (or holds no grammar).

    A grammar forces a stretch of text where it allows only one way on: a JSON schema's keys and the
    punctuation between them. Its tokens go into the window as proposals, so one window reads them all and
    chooses the token after them. They are verified like a drafter's, each row's token chosen over the
    tokens the grammar allows after the proposals before it; llguidance allows forced text only as it
    spells it, so every forced proposal holds, greedy or sampled (q is certain of the token, which the
    target's distribution over the one allowed token is too: `verify` reads it so, with no array), and the
    text is the text of one token a window.
    """
    grammar = sampler.grammar
    if grammar is None or most <= 0:
        return None
    tokens = grammar.forced(most)
    return Proposals(tokens, [], forced=True) if tokens else None


DRAFT_WARMUP = 8
"""Proposals a slot's estimate needs before it may pause drafting (until then it drafts)."""
DRAFT_PROBE_EVERY = 16
"""Windows without proposals after which a paused slot drafts again once, to measure again; the wait
doubles after each probe that leaves the estimate under the floor, up to `DRAFT_PROBE_MOST`."""
DRAFT_PROBE_MOST = 128
"""The longest wait between probes of a paused slot, in windows without proposals."""
SILENT_PROBE_FIRST = 1
"""Windows without proposals before a paused slot's first silent probe (`DraftGauge.silent`), and again
after each probe that holds: such a probe costs no window, only the head's pass beside the next one, so it
comes far sooner than `DRAFT_PROBE_EVERY`. At first proposals that hold about half the time the floor's
short average dips under it by chance every few windows (three misses in a row), and each such pause lasts
until a probe holds: at 8 windows apart, 35% of a request's windows went without proposals where drafting
paid."""
SILENT_PROBE_MOST = 8
"""The longest wait between two silent probes: the wait doubles after each probe that fails, from
`SILENT_PROBE_FIRST`, so a request whose drafts seldom hold (where drafting seldom pays) is not charged the
head's pass every window or two. Against a fixed interval of 2, `scripts/draft_floor_sim.py --intervals
2,1-8` (an H100's window times, each probe charged the head's pass, 1,000 requests a case) gives the same
tokens per second within 0.4% at first proposals that hold 42-80% of the time and in long stretches, 0.8%
fewer in short bursts, and 3% more at 20%; against probes 8 apart, 2-3% more at 42-56% and 1-2% fewer at
20-30%. On one H200, against probes every 2: +2.2% on the preset's 200-token requests, +1.0-1.2% where
41-45% of proposals hold or drafts rarely hold (docs/PERFORMANCE.md, "Silent probes: one window apart,
backing off")."""
DRAFT_WEIGHT = 1 / 4
"""Weight of each window's first proposal in the estimate: an exponential average over about the last 4
windows, so one probe whose proposal holds brings a paused slot back to the floor."""
LOOKUP_PROBE_WEIGHT = 1 / 8
"""Weight of an n-gram lookup's silent probe in the estimate (`strata_runtime.engine.lookup`): the host
probes after every paused window, so one probe that holds by chance must not bring drafting back (at 1/4 it
would, from any estimate); three in a row do, from none."""


HOLD_WARMUP = 4
"""Windows of earlier requests that reached a proposal position before what they measured there is a new
request's starting estimate (`DraftGauge.prior`)."""
HOLD_WEIGHT = 1 / 8
"""Weight of each new outcome in a position's estimate after the first 8 (a plain mean until then)."""
HOLD_SPAN = round((2 - HOLD_WEIGHT) / HOLD_WEIGHT)
"""How many windows the exponential average of `HOLD_WEIGHT` is worth as evidence (15): a position's
count of the request's own windows stops growing there, since older outcomes fade from its estimate."""
HOLD_PRIOR = 2
"""How many of the request's own windows its starting estimate at a position counts as: what earlier
requests measured there (`DraftGauge.prior`), or else the chance of the position before it (1 for the
first). Each of its own windows then moves the estimate at once, from the first."""
HOLD_OPTIMISM = 1.0
"""The depth is chosen on each position's chance raised to the upper end of its score interval, this many
standard errors wide (`DraftGauge.optimistic_holds`): a chance known from few windows counts as higher
than it may be, so a depth that might pay is drafted, and measured, instead of never being tried."""
HOLD_STALE = 32
"""Drafting windows after which a position none of them reached counts as unknown again (its estimate no
lower than that of the position before it), so that a depth given up in a hard stretch of text is tried again
once the text turns predictable."""


@dataclass
class DraftGauge:
    """Whether drafting pays for one slot, and how deep its solo windows draft.

    **Whether.** An exponential average of how often the first proposal of a window it verified held (in
    a batch-MTP window, its one proposal). Drafting pauses while the estimate is under ``floor`` (the plan's
    ``spec.draft_floor``, after `DRAFT_WARMUP` proposals). A deeper solo window's later proposals are
    tried only once those before them held, so they count in the chances by position (below), not here:
    counted here, three proposals that hold 60%, 55% and 50% of the time they are tried would read as 37%,
    and a window whose first proposal failed as 0 of 3, pausing drafting that pays. A window of k slots
    with one proposal each costs t(2k) for k(1 + a) tokens, against t(k) for k tokens without; on an H200
    t(2k)/t(k) is 1.28 to 1.6 for k = 1..4
    (docs/PERFORMANCE.md), so the default, 0.25, pauses only where drafting loses in every case measured.
    A paused slot drafts again for one window after `DRAFT_PROBE_EVERY` windows, so a request whose text
    turns predictable gets its drafts back; each probe that finds them still failing doubles the wait for
    the next (up to `DRAFT_PROBE_MOST`). A plain greedy request probes silently (``silent``): its windows
    keep no proposals, but after `silent_wait` of them the drafting head catches up and proposes the
    slot's next token, which the next window's token then confirms or not (`record` with ``silent``). A
    failed probe then costs the head's catch-up beside the next window, not a window of two rows and the host
    drafting before it, so the first comes at once and drafting may resume within a few windows of the text
    turning predictable; each that fails doubles the wait for the next, up to `SILENT_PROBE_MOST`.

    **How deep** (``costs``: the engine's `WindowCosts`, with ``spec.adaptive_depth``). For each proposal
    position j, the chance that proposal j holds once those before it held (`holds_up_to`), and from those,
    each at the upper end of its score interval (`optimistic_holds`), and the measured window times the solo
    depth with the most tokens per second (`strata_runtime.engine.depth`); depth 0 pauses drafting like the
    floor. The optimism matters where a depth is not drafted: only drafting measures its chances, so a
    request that starts from a low estimate (earlier requests' text) would otherwise never learn that its
    own proposals hold. Without ``costs`` a drafting solo window carries every proposal it has room for.

    Exactness does not depend on either: a window with or without proposals gives the same greedy text and
    the target's distribution."""

    floor: float = DEFAULT_DRAFT_FLOOR
    costs: WindowCosts | None = None
    most: int = 0
    """The plan's solo depth (``spec.draft_tokens - 1``)."""
    prior: Holds | None = None
    """What earlier requests of this kind measured (with ``costs``): a position this request has not
    measured yet starts from it; this request's outcomes feed it."""
    rate: float = 1.0
    seen: int = 0
    """Proposals verified so far."""
    idle: int = 0
    """Windows in a row without proposals."""
    wait: int = DRAFT_PROBE_EVERY
    """Windows without proposals before the next probe."""
    backoff: int = 1
    """How many times `DRAFT_PROBE_EVERY` the wait is while probes find drafting paying by the floor but
    not by the measured window times (`wait_longer`)."""
    probed: bool = False
    """Whether the last window with proposals was a probe."""
    own: Holds = field(default_factory=lambda: Holds(HOLD_WEIGHT))
    """What this request's proposals did, per position."""
    drafted: int = 0
    """Windows with proposals so far."""
    last_reached: list[int] = field(default_factory=list)
    """Per proposal position, ``drafted`` when a window last reached it."""
    silent: bool = False
    """Probe silently while paused (a plain greedy request: whether its first proposal holds is whether it
    equals the next token the target chooses)."""
    silent_wait: int = field(default_factory=lambda: SILENT_PROBE_FIRST)
    """Windows without proposals before the next silent probe: `SILENT_PROBE_FIRST`, doubled after each
    silent probe that fails (up to `SILENT_PROBE_MOST`), back to the first after one that holds."""

    def record(
        self, proposed: int, accepted: int, silent: bool = False, weight: float = DRAFT_WEIGHT
    ) -> None:
        """A verified window's ``proposed`` proposals, of which ``accepted`` held (0 and 0: a window without
        them); ``silent``: a silent probe's one proposal, which no window carried; ``weight``: the outcome's
        weight in the estimate."""
        if proposed == 0:
            self.idle += 1
            return
        if silent:
            self.silent_wait = (
                SILENT_PROBE_FIRST if accepted else min(2 * self.silent_wait, SILENT_PROBE_MOST)
            )
        probe = self.probe_due and not silent
        self.probed = probe
        self.idle = 0
        self.seen += proposed
        # The floor weighs the chance that a window's first proposal holds: a deeper solo window's later
        # proposals are tried only once the ones before them held, and count in `own` (per position).
        self.rate = (1 - weight) * self.rate + weight * (accepted > 0)
        self.drafted += 1
        for j in range(min(accepted + 1, proposed)):
            held = j < accepted
            self.own.record(j, held)
            if self.prior is not None:
                self.prior.record(j, held)
            if j == len(self.last_reached):
                self.last_reached.append(0)
            self.last_reached[j] = self.drafted
        if self.estimate >= self.floor and (self.most == 0 or self._best(self.most) > 0):
            self.wait = DRAFT_PROBE_EVERY
        elif probe and not silent:
            self.wait = min(2 * self.wait, DRAFT_PROBE_MOST)

    def wait_longer(self) -> None:
        """A window with proposals after which drafting still does not pay for a reason the gauge does not
        see (serial windows beat batch-MTP ones by their measured times): the next probe waits `backoff`
        times `DRAFT_PROBE_EVERY`, and each probe that finds it so doubles that, as a probe that finds the
        drafts under the floor does (`wait_as_usual` ends it)."""
        if self.probed:
            self.backoff = min(2 * self.backoff, DRAFT_PROBE_MOST // DRAFT_PROBE_EVERY)
        self.wait = max(self.wait, DRAFT_PROBE_EVERY * self.backoff)

    def wait_as_usual(self) -> None:
        self.backoff = 1

    @property
    def estimate(self) -> float:
        """The chance that a window's first proposal holds (optimistic, 1, until `DRAFT_WARMUP` proposals
        were seen)."""
        return self.rate if self.seen >= DRAFT_WARMUP else 1.0

    def hold(self, j: int) -> float:
        """The chance that proposal j holds once the ones before it held (`holds_up_to`)."""
        return self.holds_up_to(j + 1)[j]

    def own_windows(self, j: int) -> int:
        """The request's own windows that reached position j, counted up to `HOLD_SPAN`."""
        return min(self.own.reached[j] if j < len(self.own.reached) else 0, HOLD_SPAN)

    def evidence(self, j: int) -> float:
        """How many windows the estimate at position j rests on: `HOLD_PRIOR` for the starting estimate,
        and the request's own (`own_windows`)."""
        return HOLD_PRIOR + self.own_windows(j)

    def holds_up_to(self, depth: int) -> list[float]:
        """The chance that proposal j holds once the ones before it held, for j below ``depth``.

        A position starts from what earlier requests of this kind measured there (with a ``prior``, once
        `HOLD_WARMUP` of their windows reached it), else from the chance of the position before it (1 for
        the first), and that start counts as `HOLD_PRIOR` windows beside the request's own outcomes there
        (`Holds`; up to `HOLD_SPAN` of them), so every window that reached the position moves it. A
        position that `HOLD_STALE` drafting windows have not reached is estimated no lower than the one
        before it."""
        out: list[float] = []
        before = 1.0
        for j in range(depth):
            start = before
            if self.prior is not None:
                earlier = self.prior.known(j, HOLD_WARMUP)
                start = start if earlier is None else earlier
            own = self.own_windows(j)
            if own == 0:
                estimate = start
            else:
                estimate = (HOLD_PRIOR * start + own * self.own.chance[j]) / (HOLD_PRIOR + own)
                if j > 0 and self.drafted - self.last_reached[j] > HOLD_STALE:
                    estimate = max(estimate, before)
            out.append(estimate)
            before = estimate
        return out

    def optimistic_holds(self, depth: int) -> list[float]:
        """`holds_up_to`, each raised to the upper end of its Wilson score interval (`HOLD_OPTIMISM`
        standard errors, over the `evidence` it rests on): what the depth is chosen by."""
        holds = self.holds_up_to(depth)
        return [upper_bound(h, self.evidence(j), HOLD_OPTIMISM) for j, h in enumerate(holds)]

    @property
    def probe_due(self) -> bool:
        return self.idle >= self.wait

    @property
    def silent_probe_due(self) -> bool:
        """Whether a paused slot that probes ``silent``ly is due its next silent probe."""
        return self.silent and self.idle >= self.silent_wait

    @property
    def drafts(self) -> bool:
        """Whether this slot's next window should carry proposals (`drafting_pays` for it alone)."""
        return drafting_pays([self])

    def rates(self, room: int) -> tuple[float, ...] | None:
        """The expected tokens a millisecond of a solo window at each depth 0..``room``, as the depth is
        chosen (`optimistic_holds` over the measured window times, `strata_runtime.engine.depth.value`);
        None without ``costs`` or while a depth's time is not known. Recorded with each window the choice
        decided (`strata_runtime.engine.stats.WindowStat.rates`), so a run's windows say why they drafted
        as deep as they did."""
        if self.costs is None or room <= 0:
            return None
        holds = self.optimistic_holds(room)
        out = [value(holds, self.costs, d) for d in range(room + 1)]
        return None if any(v is None for v in out) else tuple(round(v, 4) for v in out if v is not None)

    def _best(self, room: int) -> int:
        """The solo depth that pays, at most ``room``, without probing: 0 under the floor."""
        if room <= 0 or self.estimate < self.floor:
            return 0
        return room if self.costs is None else best_depth(self.optimistic_holds(room), self.costs, room)

    def depth(self, room: int) -> int:
        """Proposals this slot's next solo window drafts, at most ``room``: the best depth, or, when that
        is 0 and a probe is due, a probe (one proposal; every one it has room for without ``costs``), unless
        it probes ``silent``ly."""
        best = self._best(room)
        if best == 0 and room > 0 and self.probe_due and not self.silent:
            return room if self.costs is None else 1
        return best

    def leaves(self, now: int, room: int, probe: bool = True) -> bool:
        """Whether a run of solo windows at ``now`` proposals (queued on the device, each after the one
        before) should end, so that the host launches one at another depth: the floor pauses drafting, a
        probe is due (with ``probe``, unless it probes ``silent``ly), or another depth beats ``now`` by
        `DEPTH_SWITCH`."""
        if now == 0 and probe and room > 0 and self.probe_due and not self.silent:
            return True
        best = self._best(room)
        if self.costs is None:
            return (best > 0) != (now > 0)  # drafting turns on or off; its depth is the room it has
        if best == now:
            return False
        if best == 0 and self.estimate < self.floor:
            return True
        return worth_switching(self.optimistic_holds(max(now, best)), self.costs, now, best)


def upper_bound(chance: float, windows: float, z: float) -> float:
    """The upper end of the Wilson score interval, ``z`` standard errors wide, of a chance estimated at
    ``chance`` from ``windows`` outcomes: above the estimate by about z·sqrt(chance(1 - chance)/windows),
    and above it at 0 too, where that standard error vanishes (1 at 1)."""
    if z <= 0 or windows <= 0:
        return chance
    zz = z * z / windows
    spread = z * math.sqrt(chance * (1 - chance) / windows + zz / (4 * windows))
    return min(1.0, (chance + zz / 2 + spread) / (1 + zz))


def drafting_pays(gauges: list[DraftGauge], probe: bool = True) -> bool:
    """Whether a window of these slots carries proposals: their estimates average at least the floor
    (a batch-MTP window gives every slot a proposal row), or, with ``probe``, a probe is due for one of
    them. A window chained behind a probe passes ``probe=False``: one probe is measured before another."""
    if not gauges:
        return False
    due = probe and any(g.probe_due for g in gauges)
    return due or sum(g.estimate for g in gauges) / len(gauges) >= gauges[0].floor


@dataclass(frozen=True)
class Verdict:
    """What a window decided for one slot: how many proposals held, and the tokens it emits."""

    accepted: int
    tokens: list[int]


def _choose(
    model: Model, sampler: Sampler, dev: Device, logits: Array, chain: list[int], on_device: bool = False
) -> tuple[int, np.ndarray | None]:
    """A proposal from one row of draft logits [V] (on ``dev``) that follows the proposals ``chain``: the
    argmax, or a draw from q, of the logits the verifier will adjust the same way.

    With ``on_device`` (the window is decided on the device, which computes q from the same logits) a
    sampled request without a bias or penalties draws on ``dev``, the last stage's, at the next uniform of
    its generator, as `Sampler.draw` would and as windows decided on the device draw (`Model.draw`): only
    the token comes back, not a vocabulary-wide row, and no q is kept."""
    if not sampler.needs_logits:
        with dev.use():
            return int(dev.xp.argmax(logits)), None
    if sampler.grammar is not None and sampler.greedy and not sampler.adjusts:
        # The argmax over what the grammar allows after the chain, masked on the device: a token comes
        # back, not a vocabulary-wide row.
        with dev.use():
            row = logits[None, :].copy()
            model.mask(row, np.zeros(1, np.int64), sampler.grammar.bitmask_last(chain))
            return int(model.argmax(row)[0]), None
    if on_device and not sampler.adjusts:
        with dev.use():
            q = model.distribution(logits[None, :], sampler.params)  # [1, V]
            return int(model.draw(q, dev.xp.asarray([sampler.uniform()], dtype=np.float64))[0]), None
    row = sampler.adjusted(dev.to_host(logits)[None, :], chain)  # [1, V]
    if sampler.greedy:
        return int(np.argmax(row[0])), None
    q = distribution(row, sampler.params)[0]
    return sampler.draw(q), q


def draft(
    model: Model, slot: int, token: int, depth: int, sampler: Sampler, on_device: bool = False
) -> Proposals:
    """Up to ``depth`` chained proposals for the tokens after ``token`` (the slot's next input).

    The drafter's pending logits (from its last catch-up) give the first; each further one runs the MTP head
    at the next position on (previous proposal, head's previous output). Those speculative MTP KV rows are
    rewound by the next `commit`. ``on_device``: the window is decided on the device (`_choose`).
    """
    drafter = model.drafters[slot]
    dev = drafter.device
    out = Proposals([], [])
    if depth <= 0:
        return out
    tok, q = _choose(model, sampler, dev, drafter.logits[0], out.tokens, on_device)
    out.tokens.append(tok)
    if q is not None:
        out.q.append(q)
    assert model.mtp is not None
    for j in range(1, depth):
        pos = drafter.length
        layout = Layout.of([(slot, 1, pos)])
        with dev.use():
            head = model.mtp({slot: drafter}, np.array([tok]), drafter.hidden[j - 1 : j], layout)  # [1, H]
            drafter.hidden[j : j + 1] = head
            drafter.logits[j : j + 1] = model.mtp.logits(head)
        tok, q = _choose(model, sampler, dev, drafter.logits[j], out.tokens, on_device)
        out.tokens.append(tok)
        if q is not None:
            out.q.append(q)
    return out


def verify_choices(picks: np.ndarray, proposals: list[int]) -> Verdict:
    """A greedy window's decision from the target's choices [n] at its rows: proposals hold, from the first,
    while each equals the choice at the row before it; the choice after the last one that held follows."""
    a = 0
    while a < len(proposals) and proposals[a] == int(picks[a]):
        a += 1
    return Verdict(a, [*proposals[:a], int(picks[a])])


def verify(target: np.ndarray, proposals: Proposals, sampler: Sampler) -> Verdict:
    """Decide a slot's window from the target's rows for its token and its n - 1 proposals.

    ``target`` is the rows' argmax [n] when the sampler does not need logits (plain greedy), else their
    logits [n, V] (host arrays), which get the request's bias and penalties first: row j as if proposals[:j]
    were generated, which they are whenever row j is read. Greedy then accepts while a proposal is the
    adjusted argmax, so greedy text is the same with and without drafting, penalties or not: the drafter's
    proposals are only proposals. Sampled, what the drafter drew a proposal from is its q, whatever it was.
    """
    n_prop = len(proposals.tokens)
    if sampler.needs_logits:
        target = sampler.adjusted(target, proposals.tokens)  # [n, V]
    if sampler.greedy:
        return verify_choices(target if target.ndim == 1 else np.argmax(target, axis=-1), proposals.tokens)
    p = distribution(target, sampler.params)  # [n, V]
    for j, tok in enumerate(proposals.tokens):
        # A forced or looked-up proposal's q is certain of its token (1 there, 0 elsewhere): no array.
        q_tok = 1.0 if proposals.certain else proposals.q[j][tok]
        if sampler.uniform() * q_tok < p[j, tok]:  # accept with probability min(1, p/q)
            continue
        if proposals.certain:
            residual = p[j].copy()
            residual[tok] = 0.0  # max(p - q, 0) where q is 1 at ``tok``
        else:
            residual = np.maximum(p[j] - proposals.q[j], 0.0)
        fix = sampler.draw(residual if residual.sum() > 0 else p[j])
        return Verdict(j, [*proposals.tokens[:j], fix])
    return Verdict(n_prop, [*proposals.tokens, sampler.draw(p[n_prop])])


def commit(
    model: Model,
    slot: int,
    base: int,
    kept_rows: int,
    normed: Array,
    next_tokens: list[int],
    tracked: bool,
    defer: bool = False,
) -> None:
    """Keep ``kept_rows`` rows of a window that started at position ``base``; drop the rest everywhere.

    ``normed`` are the window's post-final-norm rows of this slot [n, H] (on the last device) and
    ``next_tokens`` the token that follows each kept row. With ``tracked`` the slot's drafter is caught up
    on the kept rows, which leaves the next window's first proposal's logits in ``drafter.logits[0]``.
    With ``defer`` as well (a window without proposals), the rows are kept for `catch_up` to run before
    the slot next drafts, all in one pass of the MTP head: a slot that decodes without drafting (paused,
    or among others in serial windows) does not pay the head and its LM head every window.
    A window that keeps all its rows rewinds nothing: the next chunks of a prompt may already be in flight
    behind it, their KV counted on the stages they have reached.
    """
    if kept_rows < int(normed.shape[0]):
        model.rewind(slot, base + kept_rows)
    if not tracked:
        return
    drafter = model.drafters[slot]
    drafter.rewind(min(drafter.length + drafter.pending_rows, base))  # drafting may have run ahead
    if drafter.length + drafter.pending_rows != base:
        raise RuntimeError(
            f"slot {slot}: drafter holds {drafter.length} positions and {drafter.pending_rows} deferred "
            f"rows, window starts at {base}"
        )
    rows, tokens = normed[:kept_rows], [int(t) for t in next_tokens[:kept_rows]]
    with drafter.device.use():
        if defer and drafter.pending_rows + kept_rows <= DEFER_MOST:
            drafter.defer(rows, tokens)  # the window's buffers are reused
            return
        if drafter.pending_rows + kept_rows > drafter.deferred.shape[0]:
            catch_up(model, slot)  # rows this long (a prompt's chunk) take a pass of their own
        drafter.hold(rows, tokens)
    catch_up(model, slot)


def catch_up(model: Model, slot: int) -> None:
    """Run ``slot``'s deferred rows through the MTP head in one pass (on the drafters' device, current
    stream), which leaves the next window's first proposal's logits in ``drafter.logits[0]``."""
    drafter = model.drafters[slot]
    if not drafter.pending_rows:
        return
    assert model.mtp is not None
    base = drafter.length
    with drafter.device.use():
        rows, tokens = drafter.take()  # [k, H]
        k = len(tokens)
        drafter.caught_up += k
        head = model.mtp({slot: drafter}, np.asarray(tokens), rows, Layout.of([(slot, k, base)]))
        drafter.hidden[0:1] = head[k - 1 : k]
        drafter.logits[0:1] = model.mtp.logits(head[k - 1 : k])
