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

import numpy as np

from .api import Tokenizer
from .masks import Layered, Place, clear_bits, mask_width, set_bits


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


class BadWords(Place):
    """One reply's place among its bad words of several tokens (and its one-token ones, which every row's
    mask clears), held as a grammar's place is (`strata_runtime.masks.Place`)."""

    def __init__(
        self,
        sequences: Sequence[Sequence[int]],
        vocab_size: int,
        width: int | None = None,
        allowed: Sequence[int] | None = None,
    ) -> None:
        """``allowed``: the only tokens that may come at all (``allowed_token_ids``, held here beside a
        grammar rather than in the logit bias); None: any."""
        self.width = mask_width(vocab_size) if width is None else width
        if allowed is None:
            self.base = np.full(self.width, 0xFFFFFFFF, dtype=np.uint32)
        else:
            self.base = set_bits(np.zeros(self.width, dtype=np.uint32), allowed)
        clear_bits(self.base, [s[0] for s in sequences if len(s) == 1])
        """The mask before the reply's last tokens are read: every token (of ``allowed``, where given) but
        the one-token words'."""
        self.by_end: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        """Each word of several tokens as (its tokens but the last, the last), under its second-to-last."""
        for s in {tuple(s) for s in sequences if len(s) > 1}:
            self.by_end.setdefault(s[-2], []).append((s[:-1], s[-1]))
        self.longest = max((len(p) for words in self.by_end.values() for p, _ in words), default=0)
        self.recent: tuple[int, ...] = ()
        """The reply's last tokens, as many as the longest word's beginning."""

    def _packed(self) -> np.ndarray:
        out = self.base.copy()
        if self.recent:
            for prefix, last in self.by_end.get(self.recent[-1], ()):
                if self.recent[-len(prefix) :] == prefix:  # (a shorter reply's tail is no match)
                    clear_bits(out, [last])
        return out

    def _move(self, token: int) -> None:
        if self.longest:
            self.recent = (*self.recent, int(token))[-self.longest :]

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


class WithGrammar(Layered):
    """A reply held to a grammar and kept off bad words (or held to ``allowed_token_ids`` beside a grammar):
    a token may come where both allow it; where the words would leave the grammar nothing, the grammar's
    mask stands alone."""

    def __init__(self, grammar: Place, words: BadWords) -> None:
        super().__init__(grammar)
        self.words = words

    def _layer(self) -> np.ndarray:
        return self.words._packed()

    def _layer_move(self, token: int) -> None:
        self.words._move(token)

    def copy(self) -> WithGrammar:
        return WithGrammar(self.grammar.copy(), self.words.copy())
