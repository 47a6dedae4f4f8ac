"""A window to run: which slots' rows it carries, at which positions, and which of them decide a token.

A `Job` is one window: a prefill chunk of one slot, or the decode rows (token plus proposals) of one or more
slots, each slot's rows an `Entry`. The scheduler builds jobs; the executor runs them as flights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ..layout import Layout
from .slot import Slot
from .speculative import Proposals


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

    def __post_init__(self) -> None:
        if self.pos < 0:
            self.pos = self.slot.length


@dataclass
class Job:
    """One window."""

    kind: str
    """``prefill``, ``solo``, ``serial``, ``batch-mtp``, ``pipelined`` or ``pipelined-mtp``."""
    entries: list[Entry]

    def layout(self) -> Layout:
        return Layout.of([(e.slot.id, len(e.tokens), e.pos) for e in self.entries])

    def token_array(self) -> np.ndarray:
        return np.array([t for e in self.entries for t in e.tokens], dtype=np.int64)

    @property
    def rows(self) -> int:
        return sum(len(e.tokens) for e in self.entries)

    @property
    def proposals(self) -> int:
        return sum(len(e.proposals.tokens) for e in self.entries)

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
