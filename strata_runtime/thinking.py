"""Think blocks: models that reason first (Qwen3) open their reply with a ``<think>`` block.
`split_thinking` and `ThinkSplitter` read it apart from the rest of a reply (whole, or as it streams),
before its calls are read (`strata_runtime.chat`); `ThinkCount` counts its tokens; `think_ids` and
`thinking_at_end` find a model's think tags and whether a chat prompt opened or closed a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .chat import partial_tail, tag_ids

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class ThinkSplitter:
    """A streamed reply of a model that reasons before it answers (Qwen3's ``<think>`` blocks), split as it
    arrives into its reasoning and the rest.

    The reasoning is the text inside a ``<think>`` block the reply opens with (blanks before the tag
    allowed), or, where the prompt already opened the block (``opened``: a template that ends the prompt
    with ``<think>``), the text before ``</think>``. Everything after the block is the reply's text, without
    the blanks that follow the tag. A reply that does not open a block is all text. `feed` gives
    ``("reasoning", text)`` and ``("content", text)`` pieces, holding back a tail that may be the start of a
    tag and the blanks at the start of either part; `close` gives what is left (a block never closed is
    reasoning).
    """

    def __init__(self, opened: bool = False) -> None:
        self._state = "reasoning" if opened else "start"
        self._held = ""
        self._lead = True
        """The current part's leading blanks are not said yet."""
        self._blanks = ""
        """Blanks after the reasoning said so far, said only if more reasoning follows."""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._held += text
        out: list[tuple[str, str]] = []
        if self._state == "start":
            bare = self._held.lstrip()
            if bare.startswith(THINK_OPEN):
                self._state, self._held = "reasoning", bare[len(THINK_OPEN) :]
            elif THINK_OPEN.startswith(bare):
                return out  # blanks, or the start of the tag: not known yet
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._held.find(THINK_CLOSE)
            if end < 0:
                cut = len(self._held) - partial_tail(self._held, THINK_CLOSE)
                self._say("reasoning", self._held[:cut], out)
                self._held = self._held[cut:]
                return out
            self._say("reasoning", self._held[:end], out)
            self._state, self._held, self._lead = "content", self._held[end + len(THINK_CLOSE) :], True
            self._blanks = ""
        self._say("content", self._held, out)
        self._held = ""
        return out

    def close(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._say("reasoning" if self._state == "reasoning" else "content", self._held, out)
        self._held = ""
        return out

    def _say(self, part: str, text: str, out: list[tuple[str, str]]) -> None:
        """Add ``text`` of ``part`` to ``out``: the reasoning's blanks at either end are not said (those at
        its end are held until more reasoning follows), nor the text's at its start."""
        if part == "reasoning":
            text, self._blanks = self._blanks + text, ""
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        if part == "reasoning":
            words = text.rstrip()
            text, self._blanks = words, text[len(words) :]
        if text:
            out.append((part, text))


class ThinkCount:
    """How many of a reply's tokens its think block took, both tags counted (a usage's
    ``reasoning_tokens``), read from the reply's token ids as they come: the block is the reply's start
    where its first token opens it, or where the prompt opened it (``opened``), up to ``</think>``."""

    def __init__(self, opened: bool, open_id: int, close_id: int) -> None:
        self.open_id, self.close_id = open_id, close_id
        self.state = "in" if opened else "start"
        self.tokens = 0

    def feed(self, ids: Sequence[int]) -> None:
        for t in ids:
            if self.state == "done":
                return
            if self.state == "start" and t != self.open_id:
                self.state = "done"
                return
            self.tokens += 1
            self.state = "done" if t == self.close_id else "in"


def split_thinking(text: str, opened: bool = False) -> tuple[str | None, str]:
    """A whole reply's reasoning (None where it has none) and the rest, as `ThinkSplitter` reads it."""
    splitter = ThinkSplitter(opened)
    pieces = splitter.feed(text) + splitter.close()
    reasoning = "".join(t for part, t in pieces if part == "reasoning")
    return (reasoning if any(part == "reasoning" for part, _ in pieces) else None), "".join(
        t for part, t in pieces if part == "content"
    )


def think_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The ``<think>`` and ``</think>`` tokens of a model that reasons in think blocks: its vocabulary
    holds each tag as one token, as Qwen3's does. None for a model that does not."""
    return tag_ids(tokenizer, THINK_OPEN, THINK_CLOSE)


def thinking_at_end(tokenizer: Any, prompt: Sequence[int]) -> str | None:
    """How a chat prompt ends, for a model that reasons: ``"open"`` inside a think block its template
    opened (as the templates of models that always reason do: the reply begins with reasoning),
    ``"closed"`` right after a block its template wrote and closed (Qwen3's with ``enable_thinking:
    false``: the reply does not reason), None otherwise (the reply may open a block)."""
    tail = b"".join(tokenizer.token_bytes(t) for t in prompt[-24:]).decode("utf-8", errors="ignore").rstrip()
    if tail.endswith(THINK_OPEN):
        return "open"
    return "closed" if tail.endswith(THINK_CLOSE) else None
