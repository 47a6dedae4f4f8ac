"""Structured output: replies that follow a grammar, such as JSON text that follows a JSON schema (OpenAI's
``response_format``).

A request's grammar (`strata_runtime.api.SamplingParams.grammar`) is held to token by token. Before each of
its tokens is chosen, the grammar says which tokens of the vocabulary may come next (`Matcher.allowed`); the
others' logits become minus infinity, after the request's logit bias and penalties and before temperature,
top-k and top-p, so greedy and sampled choices alike only ever pick a token that keeps the text inside the
grammar. The end-of-text tokens are allowed only where the text is complete, and a reply whose grammar admits
nothing more ends there (`Matcher.finished`) with the reason ``stop``. A reply cut by ``max_tokens`` or a stop
string is a prefix of grammatical text, not grammatical text.

The grammar engine is llguidance: a Rust library, used by llama.cpp and vLLM for the same purpose, that
compiles JSON schemas, regular expressions and Lark grammars into a parser over the model's own tokens and
computes the allowed tokens of a 150,000-token vocabulary in tens of microseconds. It works on token bytes,
so it needs only what every tokenizer here gives: each token's bytes (`Tokenizer.token_bytes`), which ids
are special (never part of the text), and the end-of-text ids.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .api import Reasoning, Tokenizer
from .masks import Place, allows, set_bits
from .thinking import think_ids


class GrammarError(ValueError):
    """A grammar that cannot be compiled, or a token it does not allow; the message says why."""


COMPILED_MOST = 64
"""Grammars a vocabulary's `Grammars` remembers to have compiled (`Grammars.check`): clients send the same
few schemas again and again."""


def json_grammar(schema: Mapping[str, Any] | None = None) -> str:
    """The grammar of JSON text that follows ``schema`` (a JSON schema), or of any JSON object (None), in
    llguidance's grammar format. The text is laid out compactly, with no blanks between JSON's tokens, so
    that a model cannot spend its reply on whitespace, unless the schema sets its own layout (llguidance's
    ``x-guidance`` key)."""
    body: dict[str, Any] = {"type": "object"} if schema is None else dict(schema)
    body.setdefault("x-guidance", {"whitespace_flexible": False})
    return json.dumps({"grammars": [{"json_schema": body}]})


def regex_grammar(pattern: str) -> str:
    """The grammar of text that matches the regular expression ``pattern`` whole (Rust's regex syntax)."""
    return str(_llguidance().LLMatcher.grammar_from_regex(pattern))


def choice_grammar(choices: Sequence[str]) -> str:
    """The grammar of text that is exactly one of ``choices``."""
    return lark_grammar("start: " + " | ".join(json.dumps(c) for c in choices))


def lark_grammar(text: str) -> str:
    """The grammar a Lark grammar ``text`` (with a ``start`` rule) describes, as llguidance reads Lark."""
    return str(_llguidance().LLMatcher.grammar_from_lark(text))


def text_grammar(text: str) -> str:
    """The grammar ``text`` writes in Lark (a ``start`` rule) or in GBNF, the EBNF form llama.cpp and vLLM
    take (``root ::= ...``; converted to Lark by llguidance); `GrammarError` where it is neither."""
    _llguidance()
    import llguidance.gbnf_to_lark as gbnf

    try:
        lark = gbnf.any_to_lark(text)
    except gbnf.GbnfToLarkError as exc:
        raise GrammarError(f"not a Lark grammar (no `start:` rule) nor GBNF: {exc}") from None
    return lark_grammar(lark)


BLANKS = r"/[ \t\r\n]{0,4}/"
"""What may come between a think block and what a grammar holds after it: Qwen3 writes a blank line; a few
blanks at most, so that a model cannot spend its reply on them."""


def reasoning_grammar(reply: str, reasoning: Reasoning) -> str:
    """The grammar of a reply that reasons first (`Reasoning`): a think block of free text, at most
    ``reasoning.budget`` tokens of it, closed by its tag, then what the grammar ``reply`` holds (blanks
    before it allowed). A reply that may open the block holds ``reply`` from its start where it does not.
    (A budget with no grammar is kept by the engine without one: `strata_runtime.engine.sampling`.)"""
    o, c = f"<[{reasoning.open_id}]>", f"<[{reasoning.close_id}]>"
    bound = "" if reasoning.budget is None else f"[max_tokens={reasoning.budget}]"
    block = f"reason {c}" if reasoning.opened else f"{o} reason {c}"

    def lark(name: str) -> str:
        if reasoning.opened:
            start = f"start: {block} {BLANKS} @{name}"
        else:
            start = f"start: think? @{name}\nthink: {block} {BLANKS}"
        return "\n".join([start, f"reason{bound}: /(?s:.*)/"])

    return around(reply, "reasoning", lark)


def around(grammar: str, name: str, lark: Callable[[str], str]) -> str:
    """A grammar named ``name``, of the Lark text ``lark(part)``, that holds ``grammar`` where that text
    names ``@part`` (llguidance's top-level form, ``grammar``'s parts after the new one); `GrammarError`
    where ``grammar`` names a part ``name`` already."""
    grammars = _top_level(grammar)
    part = grammars[0].setdefault("name", "reply")
    if name in {g.get("name") for g in grammars}:
        raise GrammarError(f"a grammar may not name one of its parts `{name}`")
    return json.dumps({"grammars": [{"name": name, "lark_grammar": lark(part)}, *grammars]})


def _top_level(grammar: str) -> list[dict[str, Any]]:
    """The grammars of llguidance's top-level form (``{"grammars": [...]}``), or a Lark text as one."""
    try:
        parsed = json.loads(grammar)
    except ValueError:
        return [{"lark_grammar": grammar}]
    if not isinstance(parsed, dict) or not isinstance(parsed.get("grammars"), list):
        raise GrammarError('a grammar must be Lark text or llguidance\'s {"grammars": [...]} form')
    return [dict(g) for g in parsed["grammars"]]


class Grammars:
    """Grammars over one tokenizer's vocabulary of ``vocab_size`` ids (the model's, which may hold ids the
    tokenizer does not use: those are never allowed). The vocabulary is read into llguidance once, on first
    use (0.83 s for a 151,936-token byte-level vocabulary on a 2-core machine), and shared by every
    grammar."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lock = threading.Lock()
        self._tokens: Any = None
        self._good: OrderedDict[str, None] = OrderedDict()
        self._ends = _Ends(())

    def _vocabulary(self) -> Any:
        with self._lock:
            if self._tokens is None:
                llguidance = _llguidance()
                wrapper = llguidance.TokenizerWrapper(_Vocabulary(self.tokenizer, self.vocab_size))
                eos = list(self.tokenizer.eos_ids)
                try:
                    self._tokens = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=eos)
                except TypeError:  # llguidance before 1.7 (the newest wheel for glibc < 2.31) takes one id
                    first = eos[0] if eos else None
                    self._tokens = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=first)
                    self._ends = _Ends(tuple(eos))
            return self._tokens

    def check(self, grammar: str) -> None:
        """Raise `GrammarError` saying why where ``grammar`` does not compile over this vocabulary. The last
        `COMPILED_MOST` grammars that compiled are remembered, and not checked again (a check costs about
        what building a matcher does: 0.1 to 1 ms over a 512-token vocabulary)."""
        with self._lock:
            if grammar in self._good:
                self._good.move_to_end(grammar)
                return
        why = _llguidance().LLMatcher.validate_grammar(grammar, self._vocabulary())
        if why:
            raise GrammarError(_short(why))
        with self._lock:
            self._good[grammar] = None
            while len(self._good) > COMPILED_MOST:
                self._good.popitem(last=False)

    def matcher(self, grammar: str, reasoning: Reasoning | None = None) -> Matcher:
        """A new reply's state in ``grammar``: nothing generated yet. With ``reasoning`` the reply may
        reason first (`reasoning_grammar`)."""
        if reasoning is not None:
            grammar = reasoning_grammar(grammar, reasoning)
        llguidance = _llguidance()
        ll = llguidance.LLMatcher(self._vocabulary(), grammar)
        if ll.is_error():
            raise GrammarError(_short(ll.get_error()))
        return Matcher(ll, self.vocab_size, ends=self._ends)


class _Ends:
    """A model's end-of-text ids where llguidance knows only the first (releases before 1.7 take one): the
    others are allowed wherever the first is, and read as the first. Empty (nothing to do) where llguidance
    knows them all."""

    def __init__(self, eos: tuple[int, ...]) -> None:
        self.first = eos[0] if eos else -1
        self.others = np.asarray(eos[1:], np.int64)

    def token(self, t: int) -> int:
        """The id llguidance reads for ``t``."""
        return self.first if len(self.others) and t in self.others else t

    def widen(self, packed: np.ndarray) -> np.ndarray:
        """``packed`` (uint32 words, token t at bit t % 32 of word t // 32) with the other end-of-text ids'
        bits set where the first's is."""
        if len(self.others) and allows(packed, self.first):
            set_bits(packed, self.others)
        return packed


_SHARED: OrderedDict[tuple[int, int], Grammars] = OrderedDict()
_SHARED_LOCK = threading.Lock()
SHARED_MOST = 4
"""Tokenizers whose `Grammars` are kept for all who ask (a process serves one model; tests build many)."""


def grammars_for(tokenizer: Tokenizer, vocab_size: int) -> Grammars:
    """The `Grammars` of a tokenizer and vocabulary size, made once for all who ask (the engine, which
    follows grammars, and the server, which checks them before a request reaches the engine); the least
    recently asked are let go beyond `SHARED_MOST`."""
    key = (id(tokenizer), vocab_size)
    with _SHARED_LOCK:
        found = _SHARED.get(key)
        if found is None or found.tokenizer is not tokenizer:  # an id reused after a tokenizer was dropped
            found = _SHARED[key] = Grammars(tokenizer, vocab_size)
        _SHARED.move_to_end(key)
        while len(_SHARED) > SHARED_MOST:
            _SHARED.popitem(last=False)
        return found


class Matcher(Place):
    """One reply's place in its grammar."""

    holds_think = True
    """A think budget, where the request has one, is the grammar's (`reasoning_grammar`), not the
    sampler's."""

    def __init__(self, ll: Any, vocab_size: int, words: int | None = None, ends: _Ends | None = None) -> None:
        self._ll, self.vocab_size = ll, vocab_size
        self._ends = _Ends(()) if ends is None else ends
        self.width = len(ll.compute_bitmask()) // 4 if words is None else words
        """The packed masks' width in 32-bit words, as llguidance lays them out (one more than the
        vocabulary needs where its size is a multiple of 32)."""
        self._lost = False
        """A token moved this copy off the grammar or past its end (`_move`); never a reply's own place."""

    def allowed(self) -> np.ndarray:
        """Which tokens may come next: a bool array [vocab_size]."""
        return _unpacked(self._packed().tobytes(), self.vocab_size)

    def allowed_after(self, drafted: Sequence[int]) -> list[np.ndarray]:
        """`allowed` after each prefix of ``drafted`` (proposals not accepted yet), k = 0 .. len(drafted)
        of them; the place in the grammar does not move. After a proposal the grammar does not allow, every
        token is allowed: the rows that follow it are never used, since that proposal cannot be accepted."""
        return [_unpacked(bits.tobytes(), self.vocab_size) for bits in self.bitmasks_after(drafted)]

    def copy(self) -> Matcher:
        """Another place in the same grammar, where this one stands now, that moves on its own."""
        other = Matcher(self._ll.deep_copy(), self.vocab_size, self.width, self._ends)
        other._lost = self._lost
        return other

    def _move(self, token: int) -> None:
        """Move on by ``token``; off the grammar or past its end the place is lost (`_packed` allows all)."""
        if not self._lost:
            t = self._ends.token(int(token))
            # Checked first: llguidance logs every token its matcher refuses, and a drafter's proposals
            # (which a place ahead follows) are often off the grammar.
            self._lost = (
                self._ll.is_stopped() or not self._ll.validate_tokens([t]) or not self._ll.consume_token(t)
            )

    def _packed(self) -> np.ndarray:
        """The packed mask [W] of what may come next: every token once the place is lost."""
        if self._lost:
            return np.full(self.width, 0xFFFFFFFF, dtype=np.uint32)
        return self._ends.widen(np.frombuffer(self._ll.compute_bitmask(), dtype="<u4").copy())

    def forced(self, most: int) -> list[int]:
        """The tokens the grammar forces next, at most ``most`` (llguidance's fast-forward tokens: the only
        text the grammar allows from here, as the tokenizer spells it); empty where the next token is a
        choice, or the grammar has ended."""
        if most <= 0 or self._ll.is_stopped():
            return []
        return [int(t) for t in self._ll.compute_ff_tokens()[:most]]

    def ends_within(self, tokens: Sequence[int]) -> int | None:
        """How many of ``tokens`` complete the reply, where the grammar allows nothing more after them
        (a window's last tokens past that point are not the reply's: an end-of-text token a request that
        ignores it would keep, say); None where it goes on after all of them. The place does not move."""
        if not tokens:
            return None
        ahead = self._ll.deep_copy()
        for i, t in enumerate(tokens):
            if ahead.is_stopped():
                return i
            if not ahead.consume_token(self._ends.token(int(t))):
                return None  # off the grammar: `accept` says so
        return None

    def accept(self, tokens: Iterable[int]) -> None:
        """The reply goes on with ``tokens``; `GrammarError` where the grammar does not allow one."""
        for t in tokens:
            if not self._ll.consume_token(self._ends.token(int(t))):
                why = _short(self._ll.get_error())
                raise GrammarError(f"token {int(t)} does not follow the grammar: {why}")

    @property
    def finished(self) -> bool:
        """The grammar allows nothing more: the reply is complete."""
        return bool(self._ll.is_stopped())


class _Vocabulary:
    """What llguidance reads of a tokenizer: each id's bytes, the special ids, the end-of-text id, and a way
    to tokenize text (for a grammar's literal strings)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.tokens = [tokenizer.token_bytes(i) for i in range(vocab_size)]
        # A model's think tags are never text for a grammar (one that holds a think block names them).
        special = set(tokenizer.special_ids) | set(tokenizer.eos_ids) | set(think_ids(tokenizer) or ())
        self.special_token_ids = sorted(i for i in special if 0 <= i < vocab_size)
        self.eos_token_id = tokenizer.eos_ids[0] if tokenizer.eos_ids else None
        self.bos_token_id = None

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)


def _unpacked(bitmask: bytes, vocab_size: int) -> np.ndarray:
    """llguidance's bitmask (32-bit little-endian words, token i at bit i) as a bool array [vocab_size]."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


def _short(why: str) -> str:
    """llguidance's message without the grammar it echoes after it."""
    return why.split("\n<state>")[0].split("\n<grammar>")[0].strip()


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a dependency of the package: only a broken install lacks it
        raise GrammarError(
            "structured output needs the `llguidance` package (a dependency of strata-cfg: reinstall it)"
        ) from exc
    return llguidance
