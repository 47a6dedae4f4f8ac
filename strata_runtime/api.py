"""The engine's request interface: what the HTTP server, the bench harness and `strata generate` use.

One thread owns the devices and calls `EngineCore.step()` in a loop; every other thread talks to the engine
only through `submit` / `cancel` and the `RequestHandle` queue of events. Nothing here imports numpy or cupy.
"""

from __future__ import annotations

import math
import numbers
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from strata_cfg.schema.sampling_options import MAX_TOP_LOGPROBS as MAX_TOP_LOGPROBS
from strata_cfg.schema.sampling_options import REPETITION_BOUNDS as REPETITION_RANGE

FinishReason = Literal["stop", "length", "cancelled", "error"]


class PlanMismatch(RuntimeError):
    """A plan the runtime cannot run as written: it needs something not implemented here, or it does not
    fit the model or the devices it names. Raised when the engine is built, before any request."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k cut."""
    seed: int | None = None
    """Seeds this request's sampler; None draws a fresh seed."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token generated at least once so far (OpenAI's definition)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated so far."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits; OpenAI's ``logit_bias`` map, as pairs so that the
    parameters stay hashable."""
    repetition_penalty: float = 1.0
    """vLLM's and transformers' rule: the logit l of every token in the prompt or generated so far becomes
    l / r where it is above 0, else l * r (after the logit bias, before the presence and frequency
    penalties). 1: none; above 1 discourages repeating, below 1 encourages it."""
    min_p: float = 0.0
    """After temperature: a token whose probability is below ``min_p`` times the most likely token's gets
    nothing (before top-p, which then weighs what stays). 0: no cut."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Only these tokens may be chosen (vLLM's ``allowed_token_ids``): every other one's logit is minus
    infinity, as a logit bias would make it. None: any."""
    bad_words: tuple[str, ...] = ()
    """Words the reply may not generate (vLLM's ``bad_words``): each word's tokens, as the text's start and
    after a space, never come in a row in the reply (`strata_runtime.bad_words`: a word's last token is
    banned where the reply's last tokens are the rest of it). Empty: none."""
    min_tokens: int = 0
    """No stop token (the model's end-of-text ids, ``stop_ids``) is chosen, and no stop string ends the reply,
    before this many tokens are generated. 0: none."""
    logprobs: int | None = None
    """Report each generated token's log-probability and those of this many most likely tokens at its
    position (0 to `MAX_TOP_LOGPROBS`); None reports none. They are the model's own (its raw logits' log
    softmax, before the bias, the penalties, temperature, top-k and top-p), as vLLM reports them."""
    prompt_logprobs: int | None = None
    """Report each prompt token's log-probability after the tokens before it (all but the first) and those
    of this many most likely tokens at its place, as for generated tokens; None reports none."""
    grammar: str | None = None
    """A grammar the reply must follow, in llguidance's format (`strata_runtime.structured.json_grammar`
    writes one for a JSON schema); None: free text. Its tokens are chosen and verified on the host."""
    reasoning: Reasoning | None = None
    """The reply may reason in a think block before what ``grammar`` holds (a model that reasons: Qwen3),
    with a budget of tokens; None: ``grammar`` holds the reply from its first token."""


@dataclass(frozen=True)
class Reasoning:
    """A reply's think block, which comes before what its grammar holds (`SamplingParams.reasoning`): the
    block is free text, then the grammar, where the request has one, holds the rest (blanks after the
    block allowed); with no grammar the rest is free. Its tokens are chosen on the host until the block
    ends (`strata_runtime.structured.reasoning_grammar`)."""

    open_id: int
    """The token that opens a think block (``<think>``)."""
    close_id: int
    """The token that closes it (``</think>``)."""
    opened: bool = False
    """The prompt already opened the block (a template that ends the prompt with ``<think>``): the reply
    starts in it. Otherwise the reply may open one with its first token, or answer at once."""
    budget: int | None = None
    """The most tokens the block may hold, its opening tag not counted; the closing tag is the only choice
    after them. None: no bound but the request's ``max_tokens``."""


@dataclass(frozen=True)
class Request:
    """One generation request, already tokenized."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] = ()
    """Token ids that end generation (the model's EOS ids are added by the engine)."""
    stop_strings: tuple[str, ...] = ()
    """Strings that end generation; the text is cut before them (after them with ``keep_stop``)."""
    keep_stop: bool = False
    """The stop string that ended the reply is the end of its text, not cut off (vLLM's
    ``include_stop_str_in_output``)."""
    request_id: str = ""
    ignore_eos: bool = False
    """Generate past the model's EOS ids (they are emitted as tokens), until ``max_tokens``, a stop id or a
    stop string: a benchmark's fixed-length replies."""
    cache_salt: str = ""
    """Prefix reuse only between requests of the same salt (``memory.prefix_reuse``): a party that sends its
    own salt neither reuses nor reveals another party's prompts."""
    priority: int = 0
    """Lower is sooner: of the requests waiting for a slot, one of the lowest priority is admitted first (in
    order of arrival among equals). A request already in a slot keeps it."""


ADJUST_MOST = 1e30
"""The largest logit bias or penalty, in magnitude, `sampling_problem` lets through: logits are adjusted in
float32 (a penalty once per time its token came, up to a context's length), where a larger one overflows to
infinity and the distribution to NaN. A bias of 1e30 bans or forces a token as surely as OpenAI's 100."""


def _whole(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _finite(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def request_problem(r: Request) -> str | None:
    """What in ``r`` is not of the shape its fields say, naming the field, or what in its sampling no token
    chooser can run (`sampling_problem`); None: nothing. The engine checks its vocabulary and context
    besides."""
    if not r.prompt_ids:
        return "prompt_ids: the prompt is empty"
    if not all(_whole(t) for t in r.prompt_ids):
        return "prompt_ids: a sequence of token ids"
    if not _whole(r.max_tokens) or r.max_tokens < 1:
        return f"max_tokens: a whole number at least 1, not {r.max_tokens!r}"
    if not all(_whole(t) for t in r.stop_ids):
        return f"stop_ids: token ids, not {r.stop_ids!r}"
    if not all(isinstance(t, str) and t for t in r.stop_strings):
        return f"stop_strings: non-empty strings, not {r.stop_strings!r}"
    if _whole(r.max_tokens) and _whole(r.sampling.min_tokens) and r.sampling.min_tokens > r.max_tokens:
        return f"min_tokens: at most max_tokens ({r.max_tokens}), not {r.sampling.min_tokens!r}"
    if not _whole(r.priority):
        return f"priority: a whole number, not {r.priority!r}"
    if not isinstance(r.cache_salt, str):
        return f"cache_salt: a string, not {r.cache_salt!r}"
    return sampling_problem(r.sampling)


def sampling_problem(s: SamplingParams) -> str | None:
    """What in ``s`` no token chooser can run, naming the field (None: nothing). The server's request schema
    refuses all of it before a request is built; `EngineCore.submit` checks it for every other caller, so
    that such a request gets an error event instead of failing the engine's step (a negative seed, top-p 0)
    or choosing nonsense (a temperature or bias that is not a number)."""
    if not _finite(s.temperature) or s.temperature < 0:
        return f"temperature: a finite number at least 0 (0 is greedy), not {s.temperature!r}"
    if not _finite(s.top_p) or not 0 < s.top_p <= 1:
        return f"top_p: a number above 0 and at most 1, not {s.top_p!r}"
    if not _whole(s.top_k) or s.top_k < 0:
        return f"top_k: a whole number at least 0 (0 cuts nothing), not {s.top_k!r}"
    if s.seed is not None and (not _whole(s.seed) or s.seed < 0):
        return f"seed: None or a whole number at least 0, not {s.seed!r}"
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(s, name)
        if not _finite(v) or abs(v) > ADJUST_MOST:
            return f"{name}: a number of magnitude at most {ADJUST_MOST:g} (float32 logits), not {v!r}"
    r = s.repetition_penalty
    if not _finite(r) or not REPETITION_RANGE[0] <= r <= REPETITION_RANGE[1]:
        low, high = REPETITION_RANGE
        return f"repetition_penalty: a number from {low:g} to {high:g} (1 is none), not {r!r}"
    if not _finite(s.min_p) or not 0 <= s.min_p <= 1:
        return f"min_p: a number from 0 to 1 (0 cuts nothing), not {s.min_p!r}"
    if not _whole(s.min_tokens) or s.min_tokens < 0:
        return f"min_tokens: a whole number at least 0, not {s.min_tokens!r}"
    if not all(isinstance(w, str) and w.strip() for w in s.bad_words):
        return f"bad_words: words that are not blank, not {s.bad_words!r}"
    allowed = s.allowed_token_ids
    if allowed is not None and (not allowed or not all(_whole(t) and t >= 0 for t in allowed)):
        return f"allowed_token_ids: None or one or more token ids, not {allowed!r}"
    for pair in s.logit_bias:
        if len(pair) != 2 or not _whole(pair[0]) or not _finite(pair[1]) or abs(pair[1]) > ADJUST_MOST:
            return f"logit_bias: (token id, bias of magnitude at most {ADJUST_MOST:g}) pairs, not {pair!r}"
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(s, name)
        if v is not None and (not _whole(v) or not 0 <= v <= MAX_TOP_LOGPROBS):
            return f"{name}: None or a whole number from 0 to {MAX_TOP_LOGPROBS}, not {v!r}"
    budget = s.reasoning.budget if s.reasoning is not None else None
    if budget is not None and (not _whole(budget) or budget < 1):
        return f"reasoning.budget: None or a whole number at least 1, not {budget!r}"
    return None


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability, and the most likely tokens' at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log-probability) of the most likely tokens, most likely first (ties: the lower id)."""


@dataclass(frozen=True)
class TokenEvent:
    """Tokens accepted for a request in one window, or its end."""

    token_ids: tuple[int, ...]
    text: str
    """Newly decodable text for these tokens (may be empty while a UTF-8 sequence is incomplete)."""
    finished: FinishReason | None = None
    accepted_proposals: int = 0
    """Drafted proposals accepted in this window for this request."""
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token of ``token_ids`` where the request asked (`SamplingParams.logprobs`); else empty."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """Where the request asked (`SamplingParams.prompt_logprobs`), in the request's first event: one per
    prompt token after the first."""
    stop: str | int | None = None
    """In the last event of a reply that ended with ``stop``: the stop string it was cut at, or the token
    that ended it (an end-of-text id or one of the request's stop ids); None where its grammar was
    complete."""


@dataclass
class RequestHandle:
    """The caller's side of a submitted request: a queue of `TokenEvent`s ending in one with ``finished``."""

    request: Request
    events: queue.Queue[TokenEvent] = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    grammar: Any = None
    """The engine's: the reply's place in the request's grammar (`strata_runtime.structured.Matcher`), its
    bad words of several tokens (`strata_runtime.bad_words.BadWords`) or both."""
    banned: tuple[int, ...] = ()
    """The engine's: the tokens of one-token bad words, where the request has no others and no grammar
    (they go into its logit bias)."""
    allowed_in_masks: bool = False
    """The engine's: ``allowed_token_ids`` are held by ``grammar``'s masks (beside a grammar), not the
    logit bias."""
    slot: int | None = None
    """The slot serving it, once admitted."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens whose KV a finished request left in the slot, not read again (prefix reuse)."""
    completion_tokens: int = 0
    accepted_proposals: int = 0
    proposals: int = 0

    def cancel(self) -> None:
        """Ask the engine to stop this request and free its slot at the next window."""
        self.cancelled.set()


class Tokenizer(Protocol):
    """Text to token ids and back: byte-level for synthetic models, ``tokenizer.json`` for checkpoints."""

    eos_ids: tuple[int, ...]
    """Ids that end a generation."""
    special_ids: tuple[int, ...]
    """Ids of special tokens: control tokens that are never part of a text."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (a piece of a UTF-8 character, where a token holds part of one)."""
        ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a chat prompt ending where the assistant's reply begins: OpenAI's messages (an
        assistant's may hold ``tool_calls``; ``tool`` messages answer them), offering ``tools`` (OpenAI's
        tool definitions) where given. ``template_kwargs``: more variables for a chat template that reads
        them (Qwen3's ``enable_thinking``)."""
        ...

    @property
    def chat_template(self) -> str:
        """`apply_chat_template`'s layout as a Jinja template over ``messages`` and
        ``add_generation_prompt``, for clients that render chats themselves (``/tokenizer_info``)."""
        ...


@dataclass(frozen=True)
class Recovery:
    """What `EngineCore.recover` did with the requests a failed step held."""

    resumed: int
    """Carried on: each reads its prompt and the tokens it was sent again and goes on from there, so that
    its caller sees a pause, not an error."""
    ended: int
    """Ended with an error event naming the step's error: a request held when a step failed before too (it
    may be what fails), and one whose tokens decided in the failed step cannot be sent on."""


class EngineCore(Protocol):
    """What a running engine offers its callers."""

    tokenizer: Tokenizer

    def submit(self, request: Request) -> RequestHandle:
        """Queue a request (thread-safe). It is admitted when a slot is free."""
        ...

    def step(self) -> bool:
        """Run one scheduling round on the engine thread. Returns False when there was nothing to do."""
        ...

    def stats(self) -> dict[str, Any]:
        """Live slot, queue and window statistics (JSON-serialisable)."""
        ...

    def recover(self, error: BaseException) -> Recovery:
        """After ``step`` raised ``error``: bring the engine back without loading anything again, carrying
        on the requests it held where it can and ending the others with an error event; the queue is
        served on. Raises where the engine cannot go on (a device that reports an error)."""
        ...

    def self_check(self) -> str | None:
        """Run a fixed request alone: the first call records what the model gives, later ones say where the
        model now departs from that (None: nowhere). Only while no request holds a slot."""
        ...


def token_name(tokenizer: Tokenizer, token: int) -> tuple[str, list[int]]:
    """A token's text and bytes as OpenAI reports them: its UTF-8 text, or where it holds only part of a
    character, ``bytes:`` and its bytes as ``\\xNN`` escapes (the ``bytes`` list is exact either way)."""
    raw = tokenizer.token_bytes(token)
    try:
        return raw.decode("utf-8"), list(raw)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)
