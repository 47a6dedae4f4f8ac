"""A window to run: which slots' rows it carries, at which positions, and which of them decide a token.

A `Job` is one window: prompt rows (a chunk of one slot's prompt, and in serial windows the whole rest of
other short prompts), or the decode rows (token plus proposals) of one or more slots, each slot's rows an
`Entry`. The scheduler builds jobs; the executor runs them as flights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ..layout import Layout
from ..model import Adjusts, Draws, log_min_p
from .device_spec import DeviceSpec
from .slot import Slot
from .speculative import Proposals

CHAINED = -1
"""The token of a chained window's row: the window before chose it on the device, where this window reads
it (`strata_runtime.engine.flight.Chained`); the host learns it when that window is finished."""


@dataclass
class Entry:
    """One slot's rows in a window."""

    slot: Slot
    kind: Literal["prefill", "decode"]
    tokens: list[int]
    proposals: Proposals = field(default_factory=lambda: Proposals([], []))
    pos: int = -1
    """The KV position of the first row (the slot's length when it is -1 at creation); a streamed prompt
    chunk starts past the chunks still in flight."""
    ends_prompt: bool = False
    """A prefill chunk that ends its prompt: its last row decides the first generated token."""
    masked: bool = False
    """Rows of a request held to a grammar (its decode rows, or the last row of its prompt), chosen on the
    device over the tokens the grammar allows (`Job.masks`, or for a chained window
    `strata_runtime.engine.executor.Executor._chained_masks`): the host reads the chosen tokens, not the
    logits, and verifies the proposals by them, or the device decides them (a speculative window decided
    there)."""
    by_host: bool = False
    """A prompt's last row whose token the host chooses from its logits, as it chooses a verified row's (the
    scheduler's `first_tokens_on_device` off, for comparison); else the device chooses it (`on_device`)."""
    drawn_to: int = 0
    """Its request's numbers drawn (`Sampler.drawn`) once the window was launched: what deciding the rows
    adds to them follows (`Sampler.kept`)."""

    def __post_init__(self) -> None:
        if self.pos < 0:
            self.pos = self.slot.length

    @property
    def on_device(self) -> bool:
        """A decode row with no proposals, or the last row of a prompt: the device chooses its token (after
        the request's logit bias and penalties, `strata_runtime.model.adjust`, and counts it for them), and
        the host reads the chosen token and neither the logits nor a verification; not for a request with a
        grammar (its rows are `masked`), nor where a spent think budget forces the next token, nor for a
        prompt read again after a recovery, whose next token is known (`Slot.resume_token`)."""
        sampler = self.slot.sampler
        if self.kind == "prefill":
            return (
                self.ends_prompt
                and not self.by_host
                and self.slot.resume_token is None
                and not sampler.host_only
            )
        return not self.proposals.tokens and not sampler.host_only

    @property
    def compared(self) -> bool:
        """A sampled request's looked-up proposals (`Proposals.looked_up`; no bias, penalty or grammar): the
        device draws every row's token as it draws any, and the host keeps the proposals while each equals
        the draw at the row before it, then that row's draw. For proposals certain of their tokens this is
        the rejection rule: a proposal holds with the target's probability of it, and the token after the
        last one that held is drawn from the target without it. So the host reads tokens, not logits."""
        sampler = self.slot.sampler
        return (
            self.kind == "decode"
            and self.proposals.looked_up
            and not sampler.greedy
            and not sampler.adjusts
            and not sampler.host_only
        )

    @property
    def chosen_on_device(self) -> bool:
        """Every row's token is the device's choice (`on_device`, `masked` or `compared`)."""
        return self.on_device or self.masked or self.compared


@dataclass
class Job:
    """One window."""

    kind: str
    """``prefill``, ``solo``, ``serial``, ``batch-mtp``, ``pipelined`` or ``pipelined-mtp``."""
    entries: list[Entry]
    paused: bool = False
    """A decode window without proposals because its slots' drafts seldom hold (`DraftGauge`): it would
    have drafted otherwise."""
    spec_on_device: bool = False
    """A speculative window decided on the device (`strata_runtime.engine.device_spec`): every entry is a
    slot's token and the same number of proposals. A window chained to one
    has `CHAINED` tokens and proposals, and placeholder positions (each entry's ``pos`` is the slot's length
    when it was built)."""
    caught_up: int = 0
    """Rows the drafting heads read in catch-up passes for this window (rows deferred while a slot did not
    draft): before it was launched, to draft its proposals, and when it was finished, where a drafter's
    deferred rows reached their bound."""
    looked: set[int] = field(default_factory=set)
    """Slots whose text was looked up for this window (``spec.method = "ngram"``), whether the lookup found
    proposals or not: its outcome is counted, so the slot takes no silent probe from this window."""
    rates: tuple[float, ...] | None = None
    """A solo window of a request alone whose depth the adaptive choice decided: the expected tokens a
    millisecond of each depth when it was chosen (`strata_runtime.engine.speculative.DraftGauge.rates`)."""
    draft_ms: float = 0.0
    """Host wall time drafting its proposals before it was launched (catch-up passes included)."""
    finish_ms: float = 0.0
    """Host wall time finishing it: reading its tokens, verifying and committing them."""

    def device_spec(self) -> DeviceSpec | None:
        """The shape of the window's decision on the device, when it is decided there, with each sampled
        slot's uniforms [2n - 1], drawn now from its generator (in launch order, so a seed gives the same
        text on every run)."""
        if not self.spec_on_device:
            return None
        n = len(self.entries[0].tokens)
        spec = DeviceSpec(tuple(e.slot.id for e in self.entries), n)
        if all(e.proposals.looked_up for e in self.entries):
            return self._lookup_spec(spec)
        samplers = [e.slot.sampler for e in self.entries]
        if any(s.adjusts for s in samplers):
            spec.penalties = tuple(
                (s.params.frequency_penalty, s.params.presence_penalty, s.params.repetition_penalty)
                if s.adjusts
                else None
                for s in samplers
            )
        if any(not s.greedy for s in samplers):
            spec.params = tuple(None if s.greedy else s.params for s in samplers)
            spec.uniforms = np.array(
                [[0.0 if s.greedy else s.uniform() for _ in range(2 * n - 1)] for s in samplers]
            )
        return spec

    def _lookup_spec(self, spec: DeviceSpec) -> DeviceSpec:
        """A looked-up window's decision (`strata_runtime.engine.device_spec.decide_lookup`): the lengths of
        its runs, and, where the host launched it, each slot's text up to its token that the device's
        history lacks (`TextLookup.on_device`, which then holds it all)."""
        for e in self.entries:
            lookup = e.slot.lookup
            assert lookup is not None and not e.slot.sampler.adjusts
            spec.lookup = (lookup.shortest, lookup.longest)
            if e.tokens[0] == CHAINED:
                continue
            assert len(lookup) == e.pos + 1, "the host's lookup follows the whole reply before it proposes"
            lookup.device_missed = False  # the host found these proposals
            if lookup.on_device < len(lookup):
                spec.sync.append((e.slot.id, lookup.on_device, lookup.text(lookup.on_device, len(lookup))))
                lookup.on_device = len(lookup)
        return spec

    def layout(self) -> Layout:
        return Layout.of([(e.slot.id, len(e.tokens), e.pos) for e in self.entries])

    def token_array(self) -> np.ndarray:
        ids = np.array([t for e in self.entries for t in e.tokens], dtype=np.int64)
        assert not (ids == CHAINED).any(), "a chained window's tokens are on the device"
        return ids

    @property
    def rows(self) -> int:
        return sum(len(e.tokens) for e in self.entries)

    def draws(self) -> Draws | None:
        """For each needed row, what the device draws it with (`strata_runtime.models.ops.choose.Draws`:
        1 / temperature, a uniform drawn now from the slot's generator, in launch order, top-k, top-p,
        min-p), or
        the argmax (1 / temperature 0); None when no row is drawn there."""
        if not any(e.chosen_on_device and not e.slot.sampler.greedy for e in self.entries):
            return None
        inv_temp: list[float] = []
        uniform: list[float] = []
        top_k: list[int] = []
        top_p: list[float] = []
        min_p: list[float] = []
        for e in self.entries:
            rows = len(e.tokens) if e.kind == "decode" else int(e.ends_prompt)
            sampler = e.slot.sampler
            drawn = e.chosen_on_device and not sampler.greedy
            inv_temp += [sampler.inv_temperature if drawn else 0.0] * rows
            uniform += [sampler.uniform() if drawn else 0.0 for _ in range(rows)]
            top_k += [sampler.params.top_k if drawn else 0] * rows
            top_p += [sampler.params.top_p if drawn else 1.0] * rows
            min_p += [log_min_p(sampler.params.min_p if drawn else 0.0)] * rows
        arrays = (np.array(inv_temp), np.array(uniform), np.array(top_k, np.int64), np.array(top_p))
        return Draws(*arrays, np.array(min_p, np.float32))

    def adjusts(self) -> Adjusts | None:
        """The adjustments of the rows the device chooses or decides for requests with a logit bias or
        penalty (`strata_runtime.models.ops.adjust.Adjusts`; rows are indices into `needed`, which are the
        window's rows in a decode window): a row without proposals, or every row of a speculative window
        decided on the device (row j of a slot following its proposals 1..j). With what each such slot's
        counts on the device lack (`Sampler.device_update`: called now, in launch order); None when no row
        adjusts."""
        rows: list[int] = []
        slots: list[int] = []
        freq: list[float] = []
        pres: list[float] = []
        reps: list[float] = []
        extra_from: list[int] = []
        extra_count: list[int] = []
        chosen: list[bool] = []
        fresh: list[tuple[int, np.ndarray, np.ndarray]] = []
        counted: list[tuple[int, int, int]] = []
        at = 0  # the entry's first row among the needed ones
        for e in self.entries:
            sampler = e.slot.sampler
            n = len(e.tokens) if e.kind == "decode" else int(e.ends_prompt)
            if sampler.adjusts and (e.on_device or e.masked or self.spec_on_device):
                new, add = sampler.device_update()
                if new:
                    fresh.append((e.slot.id, *sampler.device_bias()))
                counted += [(e.slot.id, token, times) for token, times in add.items()]
                for j in range(n):
                    rows.append(at + j)
                    extra_from.append(at + 1)
                    extra_count.append(j)
                counts_choice = (e.on_device or e.masked) and not self.spec_on_device  # (decided: its kept)
                chosen += [counts_choice] * n
                slots += [e.slot.id] * n
                freq += [sampler.params.frequency_penalty] * n
                pres += [sampler.params.presence_penalty] * n
                reps += [sampler.params.repetition_penalty] * n
            at += n
        if not rows:
            return None
        c = np.array(counted, dtype=np.int64).reshape(-1, 3)
        return Adjusts(
            np.array(rows, np.int64),
            np.array(slots, np.int64),
            np.array(freq, np.float64),
            np.array(pres, np.float64),
            np.array(reps, np.float64),
            np.array(extra_from, np.int64),
            np.array(extra_count, np.int32),
            np.array(chosen, bool),
            tuple(fresh),
            (c[:, 0], c[:, 1], c[:, 2]),
        )

    def masks(self) -> tuple[np.ndarray, np.ndarray] | None:
        """For the rows of `Entry.masked` entries (indices into `needed`), the packed masks of the tokens
        their grammar allows there (`strata_runtime.structured.Matcher.bitmasks_after`: row j after the
        entry's first j proposals), computed now, from where each reply stands; None when no row is masked."""
        rows: list[int] = []
        bits: list[np.ndarray] = []
        at = 0
        for e in self.entries:
            n = len(e.tokens) if e.kind == "decode" else int(e.ends_prompt)
            if e.masked:
                grammar = e.slot.sampler.grammar
                assert grammar is not None
                rows += range(at, at + n)
                bits.append(grammar.bitmasks_after(e.proposals.tokens))
            at += n
        if not rows:
            return None
        return np.array(rows, np.int64), np.concatenate(bits)

    def needed(self) -> list[int]:
        """Rows whose logits decide a token: every decode row, and the last row of a prompt's final chunk
        (a long chunk's other rows would cost an LM-head product of their own for nothing)."""
        out: list[int] = []
        row = 0
        for e in self.entries:
            n = len(e.tokens)
            if e.kind == "decode":
                out += range(row, row + n)
            elif e.ends_prompt:
                out.append(row + n - 1)
            row += n
        return out

    @property
    def slot_ids(self) -> tuple[int, ...]:
        return tuple(e.slot.id for e in self.entries)
