"""A reply's place among what may come next, packed for the device: what a grammar (`strata_runtime.
structured.Matcher`), bad words (`strata_runtime.bad_words.BadWords`) and their layers have in common.

A place moves token by token (`Place._move`) and packs the tokens that may come next (`Place._packed`: uint32
words, token t at bit t % 32 of word t // 32, as llguidance lays them and the device's `mask_logits` reads
them). The masks of a window's rows, each after the proposals before it, follow from a copy that moves on
(`Place.bitmasks_after`), so the reply's own place stays where the host has read it. A `Layered` place lays a
mask of its own over another's and gives way where the two together would leave a row nothing: a grammar's
mask then stands alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np


def mask_width(vocab_size: int) -> int:
    """32-bit words of a packed mask over ``vocab_size`` tokens, laid out as llguidance lays a grammar's (one
    more than the vocabulary needs where its size is a multiple of 32), so both kinds stack in one window."""
    return vocab_size // 32 + 1


def allows(packed: np.ndarray, token: int) -> bool:
    """Whether packed mask [W] allows ``token``."""
    return bool(packed[token // 32] >> np.uint32(token % 32) & np.uint32(1))


def _bits(ids: np.ndarray) -> np.ndarray:
    return np.uint32(1) << (ids % 32).astype(np.uint32)


def set_bits(packed: np.ndarray, ids: Iterable[int] | np.ndarray) -> np.ndarray:
    """``packed`` [W], in place, with tokens ``ids`` allowed (an id may repeat); returns it."""
    ids = np.asarray(ids, np.int64)
    np.bitwise_or.at(packed, ids // 32, _bits(ids))
    return packed


def clear_bits(packed: np.ndarray, ids: Iterable[int] | np.ndarray) -> np.ndarray:
    """``packed`` [W], in place, with tokens ``ids`` not allowed (an id may repeat); returns it."""
    ids = np.asarray(ids, np.int64)
    np.bitwise_and.at(packed, ids // 32, ~_bits(ids))
    return packed


class Place:
    """A reply's place: what the engine asks of a grammar. Subclasses give `copy`, `_move`, `_packed`,
    `accept`, `forced`, `ends_within` and `finished`."""

    holds_think = False
    """Whether a think budget is this place's to keep (a grammar built with one), not the sampler's."""
    width: int
    """The packed masks' width in 32-bit words."""

    def copy(self) -> Any:
        """Another place where this one stands now, that moves on its own."""
        raise NotImplementedError

    def _move(self, token: int) -> None:
        raise NotImplementedError

    def _packed(self) -> np.ndarray:
        """The packed mask [W] of what may come next."""
        raise NotImplementedError

    def accept(self, tokens: Iterable[int]) -> None:
        """The reply goes on with ``tokens``."""
        raise NotImplementedError

    def forced(self, most: int) -> list[int]:
        """The tokens that must come next, at most ``most``."""
        raise NotImplementedError

    def ends_within(self, tokens: Sequence[int]) -> int | None:
        """How many of ``tokens`` complete the reply, where nothing may follow them; None: it goes on."""
        raise NotImplementedError

    @property
    def finished(self) -> bool:
        """Nothing more may come: the reply is complete."""
        raise NotImplementedError

    def bitmask_after(self, token: int) -> np.ndarray:
        """Move on by ``token`` and return the packed mask of what may follow it."""
        self._move(token)
        return self._packed()

    def move(self, tokens: Iterable[int]) -> None:
        """Move on by ``tokens`` (a copy's place ahead of the reply's: tokens chosen under its masks, or past
        where it was lost, never checked as `accept` checks them)."""
        for t in tokens:
            self._move(int(t))

    def bitmasks_after(self, drafted: Sequence[int]) -> np.ndarray:
        """The packed masks [len(drafted) + 1, W] of what may come after each prefix of ``drafted``
        (proposals not accepted yet), for the device (`strata_runtime.reference.kernels.mask_logits`); the
        reply's own place does not move."""
        ahead: Place = self.copy()
        return np.stack([ahead._packed(), *(ahead.bitmask_after(t) for t in drafted)])

    def bitmask_last(self, drafted: Sequence[int]) -> np.ndarray:
        """`bitmasks_after`'s last row alone [1, W]: what may follow all of ``drafted``."""
        ahead: Place = self.copy()
        for t in drafted:
            ahead._move(t)
        return ahead._packed()[None, :]


class Layered(Place):
    """A grammar's place with a mask of its own laid over each of its rows (`_layer`): a token may come where
    both allow it, and where together they would allow nothing, the grammar's mask stands alone (the reply
    must go on in its grammar). Subclasses give `_layer`, `_layer_move` and `copy`."""

    def __init__(self, grammar: Place) -> None:
        self.grammar = grammar
        self.holds_think = grammar.holds_think
        self.width = grammar.width

    def _layer(self) -> np.ndarray | None:
        """The layer's packed mask where the place stands (None: it allows everything)."""
        raise NotImplementedError

    def _layer_move(self, token: int) -> None:
        raise NotImplementedError

    def _packed(self) -> np.ndarray:
        own, layer = self.grammar._packed(), self._layer()
        if layer is None:
            return own
        both = own & layer
        return both if both.any() else own

    def _move(self, token: int) -> None:
        self.grammar._move(token)
        self._layer_move(token)

    def accept(self, tokens: Iterable[int]) -> None:
        tokens = list(tokens)
        self.grammar.accept(tokens)  # (raises where the grammar does not allow one)
        for t in tokens:
            self._layer_move(t)

    def forced(self, most: int) -> list[int]:
        """What the grammar forces, up to the first token the layered mask does not allow there."""
        ahead: Place = self.copy()
        out: list[int] = []
        for t in self.grammar.forced(most):
            if not allows(ahead._packed(), t):
                break
            out.append(t)
            ahead._move(t)
        return out

    def ends_within(self, tokens: Sequence[int]) -> int | None:
        return self.grammar.ends_within(tokens)

    @property
    def finished(self) -> bool:
        return self.grammar.finished
