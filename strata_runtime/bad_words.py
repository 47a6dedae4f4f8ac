"""Words a reply may not generate (vLLM's ``bad_words``), as token sequences.

Each word is tokenized as it would begin the text and, where that differs, as it would follow a space
(`word_ids`, vLLM's rule). A one-token word's token is never chosen: its logit is minus infinity in the
request's bias, so such a request runs as any biased request does, on the device and running ahead. For a
word of several tokens, only its last token is banned, and only where the reply's last tokens are the rest
of the word: the ban follows the reply, so it is a mask over the vocabulary computed on the host from where
the reply stands, as a grammar's is (`BadWords`, which the engine holds in a grammar's stead, or beside one:
`WithGrammar`). Only generated tokens count, not the prompt's, as in vLLM.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from .api import Tokenizer


def word_ids(words: Iterable[str], tokenizer: Tokenizer) -> list[tuple[int, ...]]:
    """The token sequences ``words`` ban: each word with its leading blanks removed, as the text's start,
    and after a space where that gives another first token and as many tokens (how vLLM tokenizes
    ``bad_words``)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip()))
        spaced = tuple(tokenizer.encode(" " + word.lstrip()))
        if bare:
            out.append(bare)
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
    return out


def mask_width(vocab_size: int) -> int:
    """32-bit words of a packed mask over ``vocab_size`` tokens, laid out as llguidance lays a grammar's (one
    more than the vocabulary needs where its size is a multiple of 32), so both kinds stack in one window."""
    return vocab_size // 32 + 1


class BadWords:
    """One reply's place among its bad words of several tokens (and its one-token ones, which every row's
    mask clears): the grammar-like interface the engine asks of `strata_runtime.structured.Matcher`."""

    def __init__(
        self,
        sequences: Sequence[Sequence[int]],
        vocab_size: int,
        width: int | None = None,
        allowed: Sequence[int] | None = None,
    ) -> None:
        """``allowed``: the only tokens that may come at all (``allowed_token_ids``, held here beside a
        grammar rather than in the logit bias); None: any."""
        self.vocab_size = vocab_size
        self.width = mask_width(vocab_size) if width is None else width
        singles = sorted({s[0] for s in sequences if len(s) == 1})
        self.base = np.full(self.width, 0xFFFFFFFF, dtype=np.uint32)
        """The mask before the reply's last tokens are read: every token but the one-token words' (of
        ``allowed``, where given)."""
        if allowed is not None:
            self.base[:] = 0
            ids = np.unique(np.asarray(allowed, np.int64))
            np.bitwise_or.at(self.base, ids // 32, np.uint32(1) << (ids % 32).astype(np.uint32))
        for t in singles:
            self.base[t // 32] &= ~np.uint32(1 << (t % 32))
        self.by_end: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        """Each word of several tokens as (its tokens but the last, the last), under its second-to-last."""
        for s in {tuple(s) for s in sequences if len(s) > 1}:
            self.by_end.setdefault(s[-2], []).append((s[:-1], s[-1]))
        self.longest = max((len(p) for words in self.by_end.values() for p, _ in words), default=0)
        self.recent: tuple[int, ...] = ()
        """The reply's last tokens, as many as the longest word's beginning."""

    holds_think = False
    """A think budget is the sampler's to keep (a grammar built with one holds it itself)."""

    def _packed(self) -> np.ndarray:
        out = self.base.copy()
        if self.recent:
            for prefix, last in self.by_end.get(self.recent[-1], ()):
                if self.recent[-len(prefix) :] == prefix and len(self.recent) >= len(prefix):
                    out[last // 32] &= ~np.uint32(1 << (last % 32))
        return out

    def _move(self, token: int) -> None:
        if self.longest:
            self.recent = (*self.recent, int(token))[-self.longest :]

    def allowed(self) -> np.ndarray:
        """Which tokens may come next: a bool array [vocab_size]."""
        bits = np.unpackbits(self._packed().view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].astype(bool)

    def bitmasks_after(self, drafted: Sequence[int]) -> np.ndarray:
        """The packed masks [len(drafted) + 1, W] of what may come after each prefix of ``drafted``
        (proposals not accepted yet); the reply's own place does not move."""
        ahead = self.copy()
        return np.stack([ahead._packed(), *(ahead.bitmask_after(t) for t in drafted)])

    def bitmask_last(self, drafted: Sequence[int]) -> np.ndarray:
        """`bitmasks_after`'s last row alone [1, W]."""
        ahead = self.copy()
        for t in drafted:
            ahead._move(t)
        return ahead._packed()[None, :]

    def bitmask_after(self, token: int) -> np.ndarray:
        """Move on by ``token`` and return the packed mask of what may follow it."""
        self._move(token)
        return self._packed()

    def copy(self) -> BadWords:
        """Another place among the same words, where this one stands now, that moves on its own."""
        return copy.copy(self)  # the words are shared; `recent` is a tuple, replaced on a move

    def forced(self, most: int) -> list[int]:
        """Bad words force nothing."""
        return []

    def ends_within(self, tokens: Sequence[int]) -> int | None:
        """Bad words never end a reply."""
        return None

    def accept(self, tokens: Iterable[int]) -> None:
        """The reply goes on with ``tokens``."""
        for t in tokens:
            self._move(t)

    @property
    def finished(self) -> bool:
        return False


class Grammar(Protocol):
    """What the engine asks of a reply's place in its grammar (`strata_runtime.structured.Matcher`)."""

    holds_think: bool

    def bitmasks_after(self, drafted: Sequence[int]) -> np.ndarray: ...

    def bitmask_last(self, drafted: Sequence[int]) -> np.ndarray: ...

    def bitmask_after(self, token: int) -> np.ndarray: ...

    def copy(self) -> Any: ...

    def forced(self, most: int) -> list[int]: ...

    def ends_within(self, tokens: Sequence[int]) -> int | None: ...

    def accept(self, tokens: Iterable[int]) -> None: ...

    @property
    def finished(self) -> bool: ...


class WithGrammar:
    """A reply held to a grammar and kept off bad words: a token may come next where both allow it. Where
    the bad words would leave nothing the grammar allows, the grammar's mask stands alone (the reply must
    go on in its grammar)."""

    def __init__(self, grammar: Grammar, words: BadWords) -> None:
        self.grammar, self.words = grammar, words
        self.holds_think = grammar.holds_think

    @staticmethod
    def _both(grammar: np.ndarray, words: np.ndarray) -> np.ndarray:
        both = grammar & words
        empty = ~both.any(axis=-1)
        return np.where(empty[..., None], grammar, both) if both.ndim > 1 else (grammar if empty else both)

    def bitmasks_after(self, drafted: Sequence[int]) -> np.ndarray:
        return self._both(self.grammar.bitmasks_after(drafted), self.words.bitmasks_after(drafted))

    def bitmask_last(self, drafted: Sequence[int]) -> np.ndarray:
        return self._both(self.grammar.bitmask_last(drafted), self.words.bitmask_last(drafted))

    def bitmask_after(self, token: int) -> np.ndarray:
        return self._both(self.grammar.bitmask_after(token), self.words.bitmask_after(token))

    def copy(self) -> WithGrammar:
        return WithGrammar(self.grammar.copy(), self.words.copy())

    def forced(self, most: int) -> list[int]:
        """What the grammar forces, up to the first token a bad word bans there."""
        ahead = self.words.copy()
        out: list[int] = []
        for t in self.grammar.forced(most):
            packed = ahead._packed()
            if not packed[t // 32] >> np.uint32(t % 32) & np.uint32(1):
                break
            out.append(t)
            ahead._move(t)
        return out

    def ends_within(self, tokens: Sequence[int]) -> int | None:
        return self.grammar.ends_within(tokens)

    def accept(self, tokens: Iterable[int]) -> None:
        tokens = list(tokens)
        self.grammar.accept(tokens)
        self.words.accept(tokens)

    @property
    def finished(self) -> bool:
        return self.grammar.finished
