"""A generation request's reply as the server reads it, shared by the APIs it answers in (OpenAI's chat and
completions, Anthropic's Messages, OpenAI's Responses): the pieces the engine sends, a whole reply gathered
from them, and a chat reply read, as it streams or whole, into its reasoning, its text and its calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..api import TokenLogprob
from ..chat import CallSplitter, Said, ToolCall, split_reply
from ..thinking import ThinkCount, ThinkSplitter, split_thinking
from . import protocol as p

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""A streamed reply's headers: server-sent events, not cached, not buffered by a proxy in front."""


@dataclass(frozen=True)
class Piece:
    """A stretch of a request's reply: its text, the tokens it took, and how the request ended, if it did."""

    text: str
    finish: str | None
    tokens: int
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    """The tokens' log-probabilities, where the request asked for them."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """The prompt's, in the first piece, where an echoed completion asked for them."""
    stop: str | int | None = None
    """In the last piece: the stop string or token that ended the reply (`api.TokenEvent.stop`)."""
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Whole:
    """A whole reply as `Server.collect` gathers it."""

    text: str
    end: p.OpenAIFinish
    tokens: int
    logprobs: dict[str, Any] | None
    stop: str | int | None
    """The stop string or token that ended it (`api.TokenEvent.stop`)."""
    reasoning_tokens: int | None = None
    """The tokens its think block took (`thinking.ThinkCount`); None where the model does not reason."""


class Choice:
    """One choice of a streamed reply: where its text and log-probabilities stand."""

    def __init__(self, index: int, prepared: p.Prepared, progress: bool = False) -> None:
        """``progress``: a streamed reply, which says each call as it comes (`chat.CallSplitter`)."""
        self.index, self.prepared = index, prepared
        self.echo = prepared.echo
        """The prompt's text, until it is sent (with ``echo``)."""
        self.offset = 0
        """Where the next token's text starts, for a completion's logprobs."""
        self.held: tuple[TokenLogprob, ...] = ()
        """Log-probabilities of tokens whose text is not out yet."""
        self.generated = 0
        self.finished = False
        self.calls_sent = 0
        """Calls said so far in a streamed chat reply (each numbered in order)."""
        self.started: set[str] = set()
        """The ids of calls said as they came."""
        tools = prepared.tools
        self.splitter = CallSplitter(tools.call_format, progress) if tools is not None else None
        """Reads a reply that was offered tools into its text and its calls as it streams."""
        self.thinker = ThinkSplitter(prepared.thinking) if prepared.thinking is not None else None
        """Reads a reply of a model that reasons into its reasoning and the rest as it streams."""
        self.thought = think_count(prepared)
        """Counts the tokens of its think block as they stream (`count`)."""

    def count(self, piece: Piece) -> None:
        """Count a piece's tokens that belong to the reply's think block."""
        if self.thought is not None:
            self.thought.feed(piece.token_ids)

    @property
    def reasoning_tokens(self) -> int | None:
        """The tokens of the reply's think block so far; None where the model does not reason."""
        return None if self.thought is None else self.thought.tokens


def think_count(prepared: p.Prepared) -> ThinkCount | None:
    """A counter of a chat reply's think-block tokens, where the model reasons."""
    if prepared.thinking is None or prepared.think_tags is None:
        return None
    return ThinkCount(prepared.thinking, *prepared.think_tags)


def ended_early(piece: Piece) -> p.ApiError:
    """The error of a request the engine ended early: it failed (500), or the server is stopping (503)."""
    why = piece.error if piece.finish == "error" else "the server is shutting down"
    status = 500 if piece.finish == "error" else 503
    return p.ApiError(status, f"the request ended early: {why}", type_="server_error")


def reply_parts(c: Choice, text: str, done: bool) -> list[tuple[str, Said]]:
    """What a stretch of a streamed reply says, in order: ``("reasoning", text)``, ``("content", text)`` and
    ``("call", ToolCall)``, and for a choice that says calls as they come (``progress``), each call's
    `CallStart` and `CallArguments` before its ``ToolCall``; as choice ``c``'s splitters read it (held
    tails given where ``done``)."""
    thought = [("content", text)] if c.thinker is None else c.thinker.feed(text)
    if done and c.thinker is not None:
        thought += c.thinker.close()
    out: list[tuple[str, Said]] = []
    for kind, words in thought:
        if kind == "reasoning" or c.splitter is None:
            out += [(kind, words)] if words else []
        else:
            out += [("content" if isinstance(x, str) else "call", x) for x in c.splitter.feed(words)]
    if done and c.splitter is not None:
        out += [("content" if isinstance(x, str) else "call", x) for x in c.splitter.close()]
    return out


def whole_parts(prepared: p.Prepared, text: str) -> list[tuple[str, str | ToolCall]]:
    """A whole reply's parts (`reply_parts`): its reasoning, text and calls."""
    return [(k, x) for k, x in reply_parts(Choice(0, prepared), text, True) if isinstance(x, str | ToolCall)]


def read_reply(prepared: p.Prepared, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
    """A whole chat reply's reasoning (where the model reasons), its text and its calls (where it was
    offered tools)."""
    words: str | None = text
    calls: list[ToolCall] = []
    reasoning: str | None = None
    if prepared.thinking is not None:
        reasoning, words = split_thinking(text, prepared.thinking)
    if prepared.tools is not None:
        words, calls = split_reply(words or "", prepared.tools.call_format)
    return reasoning, words, calls
