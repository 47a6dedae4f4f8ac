"""A slot: one request's decode state, and how its new tokens become `TokenEvent`s.

A slot reads its prompt in prefill chunks, then decodes. Its KV length on every stage (and in its drafter)
is ``length``; ``token`` is the next input, at position ``length``, not yet read by the model. Tokens are
emitted through `Slot.emit`, which applies stop tokens, stop strings (`strata_runtime.engine.stops`) and max
tokens, and sends only text that decodes completely.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from typing import Any

from ..api import FinishReason, RequestHandle, TokenEvent, Tokenizer, TokenLogprob
from ..masks import Place
from ..structured import GrammarError
from .lookup import TextLookup
from .sampling import Sampler
from .speculative import DraftGauge
from .stops import StopText


@dataclass
class Slot:
    id: int
    handle: RequestHandle
    sampler: Sampler
    stop_ids: frozenset[int]
    tokenizer: Tokenizer
    admitted_at: int
    """The engine's admission counter when this request got the slot (oldest prefill goes first)."""
    prefilled: int = 0
    length: int = 0
    token: int | None = None
    generated: list[int] = field(default_factory=list)
    sent_text: str = ""
    """The text sent so far: always a prefix of the final reply."""
    finished: FinishReason | None = None
    told: bool = False
    """The request's last event (the one with ``finished``) has been put in its queue (`tell`): ``finished``
    alone is set a little before, where a window's events are decided, and they are put once delivered."""
    gauge: DraftGauge = field(default_factory=DraftGauge)
    """Whether drafting pays for this request: how often its windows' first proposal held."""
    ahead: Place | None = None
    """Under a grammar, with windows running ahead of the host: the reply's place in its grammar after the
    tokens the windows in flight chose, moved on as each next window's masks are computed
    (`strata_runtime.engine.executor.Executor._chained_masks`); the host's own place (the sampler's) moves
    only as windows are finished."""
    shadow: Any = None
    """A silent probe's proposal for the request's next token, on the device, until a window gives that
    token (`strata_runtime.engine.scheduler.Engine._silent_probes`)."""
    _text: str = ""
    """The text of ``generated[:_read]``, decoded incrementally (complete characters only)."""
    _prefix: int = 0
    """Where the next decode starts: tokens before ``_read`` kept as context for the tokenizer."""
    _read: int = 0
    _fed: str = ""
    """The decoded text handed to ``_stops`` so far (complete characters only)."""
    _stops: StopText = field(init=False)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    """The prompt's log-probabilities read so far (where the request asks), sent with its first token."""
    lookup: TextLookup | None = None
    """The request's tokens, looked up for proposals where the plan drafts by n-gram lookup."""
    prefix_key: Hashable = None
    """What another request must share to reuse this one's KV (`strata_runtime.engine.prefix.Kept.key`):
    the routing key its prompt chose and its cache salt, set at admission."""
    resume: tuple[int, ...] = ()
    """After a recovery (`restart`), until the KV holds them again: the generated tokens read after the
    prompt, all but the last (``resume_token``), which becomes the next input once they are read."""
    resume_token: int | None = None
    restarts: int = 0
    """Recoveries this request was carried through."""
    restarts_close: int = 0
    """Of them, those in a row without `RESTART_FORGOTTEN` tokens decoded between (`Engine.recover`)."""
    restarted_at: int = 0
    """Tokens the request had generated when it was last carried on (`restart`)."""
    told_tokens: int = 0
    """Generated tokens in the events put so far (`tell`)."""
    told_chars: int = 0
    """Characters of ``sent_text`` in the events put so far."""

    def __post_init__(self) -> None:
        request = self.handle.request
        held = request.sampling.min_tokens > len(self.generated)
        self._stops = StopText(request.stop_strings, held=held, keep=request.keep_stop)

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.handle.request.prompt_ids

    @property
    def reading(self) -> tuple[int, ...]:
        """What the KV holds once the prompt is read: the prompt, and after a recovery the generated tokens
        read again (``resume``)."""
        return self.prompt + self.resume if self.resume else self.prompt

    @property
    def decoding(self) -> bool:
        return self.token is not None and self.finished is None

    @property
    def prefilling(self) -> bool:
        return self.token is None and self.finished is None

    def prefilled_chunk(
        self, n: int, first: int | None, logprobs: tuple[TokenLogprob, ...] = (), counted: bool = False
    ) -> TokenEvent | None:
        """A prompt chunk of ``n`` tokens is now in the KV. ``first`` is the first generated token when the
        chunk was the prompt's last (it becomes the next input); ``counted``: the device chose it and counted
        it for the penalties. Returns the event to send, if any."""
        self.length += n
        self.prefilled += n
        if first is None:
            return None
        if self.resume_token is not None:  # read again after a recovery: the token was sent before
            assert first == self.resume_token
            self.token, self.resume, self.resume_token = first, (), None
            return None
        self.token = first
        event = self.emit([first], 0, counted, logprobs)
        if self.prompt_logprobs:
            event = replace(event, prompt_logprobs=tuple(self.prompt_logprobs))
            self.prompt_logprobs = []
        return event

    def advance(
        self,
        rows: int,
        tokens: list[int],
        proposed: int,
        accepted: int,
        counted: bool = False,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> TokenEvent:
        """A decode window kept ``rows`` of this slot's rows (its KV moved on by that many) and decided
        ``tokens``, the last of which is the next input; ``proposed`` drafts were verified and ``accepted``
        of them held; ``counted``: the device chose them and counted them for the penalties; ``logprobs``: one
        per token, where the request asks. Returns the event to send."""
        self.length += rows
        self.token = tokens[-1]
        self.handle.proposals += proposed
        self.gauge.record(proposed, accepted)
        return self.emit(tokens, accepted, counted, logprobs)

    def emit(
        self, tokens: list[int], accepted: int, counted: bool = False, logprobs: tuple[TokenLogprob, ...] = ()
    ) -> TokenEvent:
        """Record a window's new tokens for this request and return the event to send.

        Tokens after a stop token or past max tokens are dropped; the stop token itself is not emitted (nor
        its log-probability).
        """
        req = self.handle.request
        kept: list[int] = []
        stop: str | int | None = None
        grammar = self.sampler.grammar
        ends = None if grammar is None else grammar.ends_within(tokens)
        if ends is not None:  # the reply is complete before the window's last tokens
            tokens = tokens[:ends]
        for t in tokens:
            if t in self.stop_ids:
                self.finished, stop = "stop", t
                break
            kept.append(t)
            if len(self.generated) + len(kept) >= req.max_tokens:
                self.finished = "length"
                break
        self.generated.extend(kept)
        least = req.sampling.min_tokens
        if self._stops.after is None and len(self.generated) >= least:  # stop strings count from here
            self._stops.arm(len(self.tokenizer.decode(self.generated[:least]).rstrip("\ufffd")))
        error = None
        try:
            self.sampler.record(kept, counted)  # the penalties of the next window count these
        except GrammarError as exc:  # a token outside the grammar: only a grammar with no way on gives one
            self.finished, error = "error", f"the reply left its grammar: {exc}"
        if self.finished is None and grammar is not None and grammar.finished:
            self.finished = "stop"  # the grammar allows nothing more: the reply is complete
        self.handle.completion_tokens = len(self.generated)
        self.handle.accepted_proposals += accepted
        text = self._decoded()
        if self.finished is None and text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for its next bytes
        fresh = text[len(self._fed) :] if text.startswith(self._fed) else ""
        self._fed += fresh
        # The stop-string cutter holds back a tail that may begin a stop string arriving over several windows.
        new = self._stops.feed(fresh)
        if self._stops.stopped:
            self.finished, stop = "stop", self._stops.hit
            kept = self._through_stop(kept)
        elif self.finished is not None:
            new += self._stops.flush()
        self.sent_text += new
        logprobs = logprobs[: len(kept)]
        return TokenEvent(tuple(kept), new, self.finished, accepted, error, logprobs=logprobs, stop=stop)

    def _through_stop(self, kept: list[int]) -> list[int]:
        """A window's new tokens up to the one whose text completed the stop string: the later ones, which
        a window of several rows chose as well, are not the reply's (one token a window, generation would
        have stopped there), so neither its tokens nor its usage count them."""
        base = len(self.generated) - len(kept)
        for k in range(1, len(kept)):
            text = self.tokenizer.decode(self.generated[: base + k])
            if len(text.rstrip("\ufffd")) >= self._stops.end:
                del self.generated[base + k :]
                self.handle.completion_tokens = len(self.generated)
                return kept[:k]
        return kept

    def _decoded(self) -> str:
        """The text of every generated token, as a whole decode would give it, without decoding them all.

        Each call decodes only the tokens from ``_prefix``: those since the last complete text plus the
        stretch before them as context (a tokenizer may render a piece differently at the start of a list,
        e.g. a leading space), and keeps the difference. So a window costs the same at the 4,000th token as at
        the 10th, where decoding the whole generation each window would grow with its length. An incomplete
        UTF-8 sequence at the end (at most 3 tokens) is shown but not kept: it is decoded again with the next
        tokens.
        """
        ids, dec = self.generated, self.tokenizer.decode
        before, after = dec(ids[self._prefix : self._read]), dec(ids[self._prefix :])
        if not after.startswith(before):  # the tokenizer rendered the context differently: decode it all
            return dec(ids)
        visible = self._text + after[len(before) :]
        done, end = after, len(ids)
        if after.endswith("\ufffd"):  # keep only what precedes the incomplete character's tokens
            done = before
            for k in range(1, min(3, end - self._read) + 1):
                part = dec(ids[self._prefix : end - k])
                if not part.endswith("\ufffd") and after.startswith(part):
                    done, end = part, end - k
                    break
        if len(done) > len(before):
            self._text += done[len(before) :]
            self._prefix, self._read = self._read, end
        return visible

    def tell(self, event: TokenEvent) -> None:
        """Put ``event`` in the request's queue, noting whether it was the last."""
        self.handle.events.put(event)
        self.told = self.told or event.finished is not None
        self.told_tokens += len(event.token_ids)
        self.told_chars += len(event.text)

    def untold(self) -> tuple[list[int], str]:
        """The generated tokens and text that windows decided but no event put yet (a step that failed
        between deciding a window and delivering its events)."""
        return self.generated[self.told_tokens :], self.sent_text[self.told_chars :]

    def restart(self) -> None:
        """After a recovery, with the KV forgotten: read the prompt again, and then, where the request was
        decoding, the tokens it was given, all but the last, which is the next input again. What the
        reply's text, stop strings, grammar and penalties know stays: they followed those same tokens. The
        device's counts for the penalties start afresh from the host's, and the generator goes back to where
        the tokens left it (`Sampler.take_back`), so a seeded reply draws on as it would have."""
        assert self.finished is None and self.untold() == ([], "")
        if self.token is not None:  # decoding: its tokens are read again after the prompt
            assert self.generated and self.token == self.generated[-1]
            self.resume, self.resume_token = tuple(self.generated[:-1]), self.generated[-1]
        elif self.resume_token is None:  # reading its prompt: from the start, its log-probabilities again
            self.prompt_logprobs = []
        # (else it was reading its tokens again: from the start once more, as they were)
        self.length = self.prefilled = 0
        self.token = None
        self.ahead = self.shadow = None
        self.sampler.on_device, self.sampler.uncounted = False, []
        self.sampler.take_back()
        self.restarts += 1
        self.restarts_close += 1
        self.restarted_at = len(self.generated)

    def forget_restarts(self, forgotten: int) -> None:
        """Where the request has decoded ``forgotten`` tokens since it was last carried on, the recoveries
        before count no more: `restarts_close` goes back to 0."""
        if len(self.generated) - self.restarted_at >= forgotten:
            self.restarts_close = 0

    def finish(self, reason: FinishReason, error: str | None = None) -> TokenEvent:
        self.finished = reason
        return TokenEvent((), "", reason, 0, error)
