"""Tool calls in the layout Qwen models are trained on (the "Hermes" layout): how tools and earlier calls are
written into a chat prompt, and how a reply's calls are read back out of its text.

A prompt offers tools in its system message: a fixed preamble, then each tool's OpenAI definition as a line
of JSON between ``<tools>`` and ``</tools>``. The model calls one by writing ``<tool_call>``, a newline, a
JSON object ``{"name": ..., "arguments": {...}}``, a newline and ``</tool_call>``; several calls follow one
another a line apart. An assistant message that made calls is written back the same way, and the tools'
answers come back as a user message of ``<tool_response>`` blocks, one per answer.

A chat template that knows tools (a checkpoint's own, given ``tools``) renders all of this itself;
`plain_messages` writes it for layouts that only know a role and a text per message (the ChatML fallback,
the byte tokenizer's transcript, a template without tools), so every layout gives the model the same text.
`split_reply` and `CallSplitter` read a reply (whole, or as it streams) into its text and its calls.

Models that reason first (Qwen3) open their reply with a ``<think>`` block; `split_thinking` and
`ThinkSplitter` read it apart from the rest, before the calls are read.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_EPILOGUE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)


class ChatTemplateError(ValueError):
    """A chat the model's template refuses or fails on; the message says why."""


def tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system message's part that offers ``tools`` (OpenAI's tool definitions, each written as one line
    of JSON in the order its keys came)."""
    return TOOLS_PREAMBLE + "".join("\n" + _json(tool) for tool in tools) + TOOLS_EPILOGUE


def call_text(name: str, arguments: str | Mapping[str, Any]) -> str:
    """One call as the model writes it; ``arguments`` as JSON text is written as it came."""
    args = arguments if isinstance(arguments, str) else _json(arguments)
    return f'{CALL_OPEN}\n{{"name": "{name}", "arguments": {args}}}\n{CALL_CLOSE}'


def plain_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> list[dict[str, str]]:
    """``messages`` (OpenAI's: assistant messages may hold ``tool_calls``, ``tool`` messages answer them)
    as role and text only, in the Hermes layout: ``tools`` (if any) in the system message, each call in its
    assistant message's text, and each run of tool answers as one user message."""
    out: list[dict[str, str]] = []
    rest = list(messages)
    if tools:
        system = ""
        if rest and rest[0].get("role") == "system":
            system = _text(rest.pop(0)) + "\n\n"
        out.append({"role": "system", "content": system + tools_text(tools)})
    answers: list[str] = []
    for message in rest:
        role = str(message.get("role"))
        if role == "tool":
            answers.append(f"<tool_response>\n{_text(message)}\n</tool_response>")
            continue
        if answers:
            out.append({"role": "user", "content": "\n".join(answers)})
            answers = []
        text = _text(message)
        calls = [call_text(*_call_parts(c)) for c in message.get("tool_calls") or ()]
        if role == "assistant" and calls:
            text = "\n".join(([text] if text else []) + calls)
        out.append({"role": role, "content": text})
    if answers:
        out.append({"role": "user", "content": "\n".join(answers)})
    return out


def has_tool_parts(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any message is a tool's answer or holds calls (and so needs the Hermes layout or a template
    that knows tools)."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


@dataclass(frozen=True)
class ToolCall:
    """One call a reply made: the tool's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """The call as OpenAI's ``tool_calls`` item (with ``index``, as a streamed delta carries it)."""
        body: dict[str, Any] = {"index": index} if index is not None else {}
        return body | {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def read_call(inner: str) -> ToolCall | None:
    """The call a block's inner text writes (``{"name": ..., "arguments": {...}}``), or None where it is not
    one: not JSON, no name, or arguments that are not an object. Missing arguments are ``{}``."""
    try:
        body = json.loads(inner)
    except json.JSONDecodeError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
        return None
    args = body.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return ToolCall(body["name"], json.dumps(args, ensure_ascii=False))


CallReader = Callable[[str], "ToolCall | None"]
"""What reads a ``<tool_call>`` block's inner text into a call (None where it holds none)."""


def split_reply(text: str, read: CallReader = read_call) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's text outside its calls (None where nothing is left) and its calls, in order, as
    `CallSplitter` reads it."""
    splitter = CallSplitter(read)
    pieces = splitter.feed(text) + splitter.close()
    words = "".join(p for p in pieces if isinstance(p, str))
    return (words or None), [p for p in pieces if isinstance(p, ToolCall)]


class CallSplitter:
    """A streamed reply's text, split as it arrives into text and calls.

    `feed` gives what can be said so far. It holds back a tail that may be the start of ``<tool_call>``, a
    call not yet closed, and blanks that may turn out to stand next to a call: the layout's line breaks
    around calls, and blanks at the reply's start and end, are not text. `close` gives what is left when
    the reply ends: a block that was never closed is text, as written. A block that does not hold a call
    (``read``: `read_call` in the Hermes layout) is text too.
    """

    def __init__(self, read: CallReader = read_call) -> None:
        self._read = read
        self._held = ""
        self._in_call = False
        self._blanks = ""
        """Blanks after the text given so far, said only if more text follows."""
        self._after_call = True
        """The next text's leading blanks are not said (the reply's start, or after a call)."""
        self._before = ""
        """The blanks held before the block being read, said with it if it is not a call."""
        self.calls = 0
        """Calls read so far."""

    def feed(self, text: str) -> list[str | ToolCall]:
        self._held += text
        out: list[str | ToolCall] = []
        while True:
            if self._in_call:
                end = self._held.find(CALL_CLOSE)
                if end < 0:
                    return out
                cut = end + len(CALL_CLOSE)
                block, self._held, self._in_call = self._held[:cut], self._held[cut:], False
                call = self._read(block[len(CALL_OPEN) : end].strip())
                if call is None:
                    self._blanks = self._before
                    self._say(block, out)
                    continue
                self.calls += 1
                self._blanks, self._after_call = "", True
                out.append(call)
                continue
            start = self._held.find(CALL_OPEN)
            if start < 0:
                cut = len(self._held) - _partial_tail(self._held, CALL_OPEN)
                self._say(self._held[:cut], out)
                self._held = self._held[cut:]
                return out
            self._say(self._held[:start], out)
            self._before, self._blanks = self._blanks, ""  # blanks before a call are the layout's
            self._held, self._in_call = self._held[start:], True

    def close(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        if self._in_call:  # a block never closed: text, with the blanks before it
            self._blanks = self._before
        self._say(self._held, out)
        self._held, self._in_call, self._blanks = "", False, ""
        return out

    def _say(self, text: str, out: list[str | ToolCall]) -> None:
        """Add ``text`` (outside calls) to ``out``, with the blanks held before it, holding its own trailing
        blanks."""
        if not text:
            return
        text = self._blanks + text
        if self._after_call:
            text = text.lstrip()
        words = text.rstrip()
        self._blanks = text[len(words) :]
        if words:
            self._after_call = False
            out.append(words)


def _partial_tail(text: str, tag: str) -> int:
    """How many of ``text``'s last characters begin ``tag`` (and so may turn out to be it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _call_parts(call: Mapping[str, Any]) -> tuple[str, str | Mapping[str, Any]]:
    function = call.get("function", call)
    return str(function.get("name", "")), function.get("arguments", "{}")


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _json(value: Any) -> str:
    """JSON as a chat template's ``tojson`` writes it: keys in their order, ``", "`` and ``": "`` between
    items, text as itself rather than ``\\u`` escapes."""
    return json.dumps(value, ensure_ascii=False)


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
                cut = len(self._held) - _partial_tail(self._held, THINK_CLOSE)
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


def _tag_ids(tokenizer: Any, opening: str, closing: str) -> tuple[int, int] | None:
    """The ids of a pair of tags where the tokenizer holds each as one token; None where it spells one."""
    ids = [tokenizer.encode(tag) for tag in (opening, closing)]
    if all(len(one) == 1 for one in ids):
        return ids[0][0], ids[1][0]
    return None


def call_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The ``<tool_call>`` and ``</tool_call>`` tokens of a model whose vocabulary holds each tag as one
    token, as Qwen's does (the model writes its calls with them); None for a model that spells them in
    text."""
    return _tag_ids(tokenizer, CALL_OPEN, CALL_CLOSE)


def think_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The ``<think>`` and ``</think>`` tokens of a model that reasons in think blocks: its vocabulary
    holds each tag as one token, as Qwen3's does. None for a model that does not."""
    return _tag_ids(tokenizer, THINK_OPEN, THINK_CLOSE)


def thinking_at_end(tokenizer: Any, prompt: Sequence[int]) -> str | None:
    """How a chat prompt ends, for a model that reasons: ``"open"`` inside a think block its template
    opened (as the templates of models that always reason do: the reply begins with reasoning),
    ``"closed"`` right after a block its template wrote and closed (Qwen3's with ``enable_thinking:
    false``: the reply does not reason), None otherwise (the reply may open a block)."""
    tail = b"".join(tokenizer.token_bytes(t) for t in prompt[-24:]).decode("utf-8", errors="ignore").rstrip()
    if tail.endswith(THINK_OPEN):
        return "open"
    return "closed" if tail.endswith(THINK_CLOSE) else None
