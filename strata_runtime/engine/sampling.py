"""Choosing tokens: greedy argmax, or temperature / top-k / min-p / top-p sampling from a per-request seeded
RNG, after a request's logit bias and repetition, presence and frequency penalties.

The adjustments come first, on the raw logits, as OpenAI and vLLM define them: ``logit_bias[t]`` is added to
token t's logit; a token in the prompt or generated so far has that divided by ``repetition_penalty`` where
it is above 0 and multiplied by it otherwise; and a token generated c > 0 times so far loses
``frequency_penalty * c + presence_penalty`` (`strata_runtime.models.ops.adjust`, whose arithmetic the
device's kernel shares bit for bit). Temperature, top-k, min-p and top-p then shape what is left; greedy
takes the argmax of the adjusted logits.

The target's and the drafter's logits go through the same adjustments and the same `distribution`, so
speculative rejection sampling reproduces exactly the distribution a user asked for. A row of a speculative
window follows proposals that are not generated yet; `Sampler.adjusted` counts them as generated for the
rows after them, which is what the row's token would see if those proposals are accepted, and a row is only
ever used when they are.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..api import Reasoning, SamplingParams
from ..backend import Array
from ..masks import Layered, Place, clear_bits
from ..model import PROMPT_SEEN, adjust_row, inv_temperature, inverse_cdf, mask_logits
from ..model import distribution as rule
from ..structured import GrammarError


def distribution(logits: Array, params: SamplingParams, xp: Any = np, *, sort_rows: bool = False) -> Array:
    """Next-token probabilities [n, V] (float64) at a request's temperature, top-k, min-p and top-p: the rule
    of `strata_runtime.models.ops.distribution`, on ``xp`` arrays (NumPy on the host)."""
    t, k, p = params.temperature, params.top_k, params.top_p
    return rule(logits, t, k, p, xp, min_p=params.min_p, sort_rows=sort_rows)


class ThinkBudget:
    """Where a reply stands in a think block with a budget (`Reasoning`), for a request with no grammar: the
    block's tokens are chosen as any others (on the device, running ahead), except the one a spent budget
    makes ``</think>``, which the host chooses.

    That token's place is known from the start (`hold_at`): the budget's count of tokens after the block
    opens, which is the reply's first token, or the prompt where it opened the block. Windows never reach
    past it before the host has read what comes before it (`strata_runtime.engine.scheduler`); where the
    block is still open there, `forcing` is set and only ``</think>`` may be chosen. A reply that does not
    open the block with its first token, or closes it, is free from then on.
    """

    def __init__(self, reasoning: Reasoning) -> None:
        assert reasoning.budget is not None
        self.reasoning = reasoning
        self.state = "open" if reasoning.opened else "start"
        """``start`` (the reply may open a block), ``open`` (in it), ``done`` (closed, or never opened)."""
        self.used = 0
        """Tokens of the block so far, its opening tag not counted."""

    @property
    def hold_at(self) -> int | None:
        """The index, among the reply's tokens, of the token the host must choose (the block's close, where
        the budget is spent); None once the block is closed or was never opened."""
        if self.state == "done":
            return None
        budget = self.reasoning.budget
        assert budget is not None
        return budget + (0 if self.reasoning.opened else 1)

    @property
    def forcing(self) -> bool:
        """The budget is spent and the block still open: the next token is ``</think>``."""
        return self.state == "open" and self.used >= (self.reasoning.budget or 0)

    def record(self, tokens: Iterable[int]) -> None:
        """The reply goes on with ``tokens``; `GrammarError` where one passes a spent budget (windows that
        ran past the hold: a scheduling fault, ended as the request's error)."""
        for t in tokens:
            if self.state == "done":
                return
            if self.state == "start":
                self.state = "open" if t == self.reasoning.open_id else "done"
                continue
            if self.forcing and t != self.reasoning.close_id:
                raise GrammarError(f"token {t} passed the think block's budget of {self.reasoning.budget}")
            if t == self.reasoning.close_id:
                self.state = "done"
            else:
                self.used += 1


def banning(ids: np.ndarray, values: np.ndarray, banned: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A logit bias as (token ids, values) with tokens ``banned`` at minus infinity, whatever their bias
    was. In array steps (a membership table over the ids' range): ``banned`` may be most of a vocabulary,
    whose Python objects would hold the engine's thread for tens of milliseconds."""
    if not banned.size:
        return ids, values
    own = ~np.isin(ids, banned, kind="table")
    return np.concatenate([ids[own], banned]), np.concatenate([values[own], np.full(banned.size, -np.inf)])


class HoldStops(Layered):
    """A grammar whose reply is held off its stop tokens for its first ``least`` tokens (``min_tokens``): each
    row's mask also clears the stop tokens while the row is short of them, except where that would leave
    the row nothing (a grammar that allows only the end once its text is complete: the grammar wins,
    `strata_runtime.masks.Layered`). The count moves with the place, so masks of drafted rows, of chained
    windows and of a drafter's chain hold exactly the rows short of ``least``."""

    def __init__(self, grammar: Place, stops: np.ndarray, least: int, count: int = 0) -> None:
        super().__init__(grammar)
        self.stops, self.least, self.count = stops, least, count
        self.held = clear_bits(np.full(self.width, 0xFFFFFFFF, dtype=np.uint32), stops)
        """Every token but the stop tokens, packed."""

    def _layer(self) -> np.ndarray | None:
        return self.held if self.count < self.least else None

    def _layer_move(self, token: int) -> None:
        self.count += 1

    def copy(self) -> HoldStops:
        other = copy.copy(self)
        other.grammar = self.grammar.copy()
        return other


class Sampler:
    """One request's token chooser: greedy, or seeded sampling, after its logit bias and penalties.

    It counts the request's generated tokens (`record`), which the penalties read. Where its rows adjust on
    the device (`strata_runtime.model.adjust`), it also knows what the device's counts lack: every token
    until the first such window (``on_device`` is then False), then those the host decided.
    """

    def __init__(
        self,
        params: SamplingParams,
        seed: int,
        grammar: Place | None = None,
        prompt: Sequence[int] = (),
        stops: Iterable[int] = (),
        vocab: int = 0,
        banned: Iterable[int] = (),
        allowed_in_masks: bool = False,
    ) -> None:
        """``grammar``: the reply's place in its grammar (`strata_runtime.structured`), or among its bad
        words of several tokens (`strata_runtime.bad_words`), or both, where the request has them: its rows
        are masked to the tokens they allow, and its proposals drawn and verified by the host. ``prompt``:
        the request's prompt, whose tokens a repetition penalty counts as seen.
        ``stops``: the tokens that end the reply, which ``min_tokens`` holds off. ``vocab``: the vocabulary's
        size, whose tokens outside ``allowed_token_ids`` get a bias of minus infinity. ``banned``: tokens
        that get one too (one-token bad words, `strata_runtime.bad_words`). ``allowed_in_masks``: the
        ``grammar``'s masks hold ``allowed_token_ids`` instead (beside a grammar, where they give way rather
        than leave a row nothing)."""
        if 0 < vocab <= params.top_k:  # a cut at the vocabulary's size or past it cuts nothing (the device's
            params = dataclasses.replace(params, top_k=0)  # arrays take the cut as a 64-bit integer)
        self.params = params
        self.grammar = grammar
        r = params.reasoning
        self.think: ThinkBudget | None = None
        """A think block's budget, where no grammar holds the reply (a grammar holds the budget itself; bad
        words, held as one, do not)."""
        if r is not None and r.budget is not None and (grammar is None or not grammar.holds_think):
            self.think = ThinkBudget(r)
        self.greedy = params.temperature <= 0.0
        self.rng = np.random.default_rng(seed)
        self.drawn = 0
        """Numbers drawn from ``rng`` so far (`uniform`, `draw`)."""
        self.kept = 0
        """Of them, those drawn for the windows that decided the reply's tokens so far (the rest were drawn
        for windows queued ahead; `take_back` undoes them)."""
        banned = np.unique(np.asarray(list(banned), np.int64))
        self.penalised = bool(
            params.presence_penalty
            or params.frequency_penalty
            or params.logit_bias
            or params.repetition_penalty != 1.0
            or (params.allowed_token_ids is not None and not allowed_in_masks)
            or banned.size
        )
        """A logit bias or a penalty is set."""
        self.counts: Counter[int] = Counter()
        """How often each token was generated for this request so far."""
        bias: dict[int, float] = {}
        for token, value in params.logit_bias:  # a token named twice gets both biases
            bias[token] = bias.get(token, 0.0) + value
        self.bias_ids = np.array(list(bias), dtype=np.int64)
        self.bias = np.array(list(bias.values()), dtype=np.float64)
        self.bias_ids, self.bias = banning(self.bias_ids, self.bias, banned)
        if params.allowed_token_ids is not None and not allowed_in_masks:  # every other token banned
            assert vocab > 0, "allowed_token_ids needs the vocabulary's size"
            allowed = np.zeros(vocab, dtype=bool)
            allowed[np.asarray(params.allowed_token_ids, np.int64)] = True
            self.bias_ids, self.bias = banning(self.bias_ids, self.bias, np.flatnonzero(~allowed))
        repeats = params.repetition_penalty != 1.0
        self.seen = np.unique(np.asarray(prompt, np.int64)) if repeats else np.zeros(0, np.int64)
        """The prompt's distinct tokens, which a repetition penalty counts as seen (none without one)."""
        self.stops = np.array(
            sorted(t for t in set(stops) if t >= 0 and (vocab <= 0 or t < vocab)), dtype=np.int64
        )
        if grammar is not None and params.min_tokens > 0 and self.stops.size:
            # Held off by the grammar's masks, which give way where the grammar allows only an end.
            self.grammar = HoldStops(grammar, self.stops, params.min_tokens)
        self.generated = 0
        """Tokens recorded for the reply so far."""
        self.on_device = False
        """Whether the last stage's device holds this request's counts and bias (after its first window
        that adjusts there)."""
        self.uncounted: list[int] = []
        """Tokens the host decided since the device's counts were last brought up to date."""

    @property
    def adjusts(self) -> bool:
        """The logits change before a token is chosen: a bias or a penalty is set (`penalised`), or the
        reply is short of its ``min_tokens`` (`holding_stops`)."""
        return self.penalised or self.holding_stops

    @property
    def inv_temperature(self) -> float:
        """1 / temperature for a draw on the device (at most 1 / `TEMPERATURE_FLOOR`, as the host's rule
        divides); 0 for greedy (the argmax)."""
        return 0.0 if self.greedy else inv_temperature(self.params.temperature)

    @property
    def needs_logits(self) -> bool:
        """Whether choosing on the host needs the logits: sampling, or greedy over adjusted logits (a plain
        greedy choice is the device's argmax), or a grammar."""
        return not self.greedy or self.adjusts or self.host_only

    @property
    def host_only(self) -> bool:
        """The host computes what each row may choose (a grammar's allowed tokens, or bad words', follow from
        the tokens before: it computes each row's mask, which the device applies), so a speculative window
        is decided on the device only where the host masks it there (a greedy request without a bias or
        penalty: `strata_runtime.engine.scheduler.Engine._device_decides`); or the next token is the one a
        spent think budget forces."""
        return self.grammar is not None or (self.think is not None and self.think.forcing)

    @property
    def holding_stops(self) -> bool:
        """The reply is shorter than its ``min_tokens``, has stop tokens to hold off and no grammar (a
        grammar's masks hold them off: `HoldStops`): its rows lose them,
        on the host (`adjusted`) and on the device (`device_bias`), until it is not. No window reaches the
        token where they come back (`hold_at`) before the host has read the ones before it."""
        return self.generated < self.params.min_tokens and self.stops.size > 0 and self.grammar is None

    @property
    def hold_at(self) -> int | None:
        """The index of the first of the reply's tokens that no window may reach before the host has read
        every token before it, or None: where a spent think budget forces the block's close, which the host
        chooses (`ThinkBudget.hold_at`), or, while the stop tokens are held off, ``min_tokens``, where they
        come back and the device's bias for the request changes (`device_bias`)."""
        think = self.think.hold_at if self.think is not None else None
        if not self.holding_stops:
            return think
        return self.params.min_tokens if think is None else min(think, self.params.min_tokens)

    def device_bias(self) -> tuple[np.ndarray, np.ndarray]:
        """The logit bias the device adds to the request's rows, as (token ids, values): the request's own,
        and minus infinity on the stop tokens while they are held off (`holding_stops`). The windows that
        use it never reach the reply's ``min_tokens``-th token (`hold_at`), so every row they adjust is
        short of it, as `adjusted` masks on the host."""
        if not self.holding_stops:
            return self.bias_ids, self.bias
        return banning(self.bias_ids, self.bias, self.stops)

    def record(self, tokens: Iterable[int], counted: bool = False) -> None:
        """Tokens now generated for the request (the penalties count them, the grammar goes on with them);
        ``counted``: the device chose them and has counted them already."""
        tokens = list(tokens)
        held = self.holding_stops
        self.generated += len(tokens)
        if held and not self.holding_stops and self.on_device:
            # The stop tokens come back: the device's bias for the request starts afresh without their ban.
            self.on_device, self.uncounted = False, []
        if self.grammar is not None:
            self.grammar.accept(tokens)
        if self.think is not None:
            self.think.record(tokens)
        if self.adjusts:
            self.counts.update(tokens)
            if self.on_device and not counted:
                self.uncounted += tokens

    def device_update(self) -> tuple[bool, dict[int, int]]:
        """What the device's counts lack before this request's next row adjusts there: (whether they start
        afresh, with the bias, token -> times to add). Called once for each such window, in launch order.
        Counts that start afresh mark the prompt's tokens (`PROMPT_SEEN`) for a repetition penalty."""
        fresh = not self.on_device
        add = dict(self.counts) if fresh else dict(Counter(self.uncounted))
        if fresh:
            for t in self.seen.tolist():
                add[t] = add.get(t, 0) + PROMPT_SEEN
        self.on_device, self.uncounted = True, []
        return fresh, add

    def adjusted(self, logits: np.ndarray, drafted: Sequence[int] = ()) -> np.ndarray:
        """Logits [n, V] after the logit bias and the penalties, as float64 (a copy), float32 values where
        they change (`strata_runtime.models.ops.adjust`).

        ``drafted`` are proposals not generated yet that the rows follow: the last row follows all of them
        and each row before it one fewer (a verified window's row j follows proposals[:j]; a drafter's one
        row follows its whole chain so far). They count as generated for the rows that follow them.
        """
        out = self._biased(logits, drafted)
        if self.holding_stops:  # rows short of min_tokens: no stop token
            if np.may_share_memory(out, logits):
                out = out.copy()
            first_row = out.shape[0] - len(drafted)
            for j in range(out.shape[0]):
                if self.generated + max(0, j - first_row + 1) < self.params.min_tokens:
                    out[j, self.stops[self.stops < out.shape[1]]] = -np.inf
        if self.think is not None and self.think.forcing:  # the budget is spent: the block's close alone
            if np.may_share_memory(out, logits):
                out = out.copy()
            close = self.think.reasoning.close_id
            kept = out[:, close].copy()
            out[:] = -np.inf
            out[:, close] = np.where(np.isneginf(kept), 0.0, kept)  # forced even where a bias bans it
        if self.grammar is not None:  # each row over the tokens its grammar allows after what it follows
            if np.may_share_memory(out, logits):
                out = out.copy()  # the masks are written in place, never into the caller's logits
            bits = self.grammar.bitmasks_after(drafted)
            first_row = out.shape[0] - len(drafted)
            follows = [max(0, j - first_row + 1) for j in range(out.shape[0])]  # row j's proposals
            mask_logits(out, np.arange(out.shape[0]), bits[follows])  # the device's rule, on the host
        return out

    def _biased(self, logits: np.ndarray, drafted: Sequence[int]) -> np.ndarray:
        """`adjusted` without the grammar (unadjusted float64 rows are the caller's own, not a copy)."""
        if not self.adjusts:
            return np.asarray(logits, dtype=np.float64)
        rows = np.asarray(logits)
        p = self.params
        first_row = rows.shape[0] - len(drafted)  # the first row that follows drafted[0]
        out = np.empty(rows.shape, dtype=np.float64)
        for j in range(rows.shape[0]):
            counts = self.counts + Counter(drafted[: max(0, j - first_row + 1)])
            penalties = (p.frequency_penalty, p.presence_penalty, p.repetition_penalty, self.seen)
            out[j] = adjust_row(rows[j], counts, self.bias_ids, self.bias, *penalties)
        return out

    def draw(self, probs: np.ndarray) -> int:
        """One token from a distribution [V]."""
        return int(inverse_cdf(probs, self.uniform()))

    def uniform(self) -> float:
        self.drawn += 1
        return float(self.rng.random())

    def take_back(self) -> None:
        """Put the generator back to where it stood after the numbers that decided the reply's tokens so far
        (``kept``), as if the windows queued after them had never drawn: a reply carried through a failed
        step (`strata_runtime.engine.slot.Slot.restart`) then draws what it would have drawn without the
        failure. PCG64, ``default_rng``'s generator, steps once a number and moves any count of steps,
        back by going round its period of 2**128."""
        extra = self.drawn - self.kept
        if extra:
            assert isinstance(self.rng.bit_generator, np.random.PCG64)
            self.rng.bit_generator.advance(2**128 - extra)
        self.drawn = self.kept
