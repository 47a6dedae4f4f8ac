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
`call_ids` finds the call tags where the vocabulary holds each as one token. A reasoning model's think block
is read apart first (`strata_runtime.thinking`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One call a reply made: the tool's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: new_call_id())

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


class ArgumentStream(Protocol):
    """A call's arguments as JSON text, written as the call's text arrives: `feed` gives what each stretch
    adds, `close` what is left when the call ends (the arguments are what the two gave, joined)."""

    def feed(self, text: str) -> str: ...

    def close(self) -> str: ...


@dataclass(frozen=True)
class CallFormat:
    """How a model writes its calls: ``read``, a whole block's text read into a call; ``head``, where a
    block's text so far shows that it is a call (the function's name, and how much of the text names it),
    None where it does not (yet); ``arguments``, the stream of a call's arguments after its head, given
    the function's name."""

    read: CallReader
    head: Callable[[str], tuple[str, int] | None]
    arguments: Callable[[str], ArgumentStream]


_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


def _hermes_head(text: str) -> tuple[str, int] | None:
    """A Hermes call's head: ``{"name": "NAME", "arguments": `` with its object's first brace come."""
    found = _HERMES_HEAD.match(text)
    if found is None:
        return None
    try:
        name = json.loads(f'"{found.group(1)}"')
    except json.JSONDecodeError:
        return None
    return (name, found.end()) if name else None


class JsonValue:
    """A JSON value's text as it arrives, up to the end of the value (what follows it, such as the call
    object's closing brace, is not the value's): strings, escapes and nesting followed, nothing parsed."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._done = False

    def feed(self, text: str) -> str:
        if self._done:
            return ""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self._done = True
                    return text[: i + 1]
        return text

    def close(self) -> str:
        return ""


HERMES = CallFormat(read_call, _hermes_head, lambda name: JsonValue())
"""Qwen's Hermes layout: a call is JSON, ``{"name": ..., "arguments": {...}}``."""


@dataclass(frozen=True)
class CallStart:
    """A call whose head has been read (`CallFormat.head`), before its arguments: a streamed reply says it
    as it comes (`CallSplitter`'s ``progress``); the call's `ToolCall` has the same ``id``."""

    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """The next stretch of the open call's arguments (JSON text)."""

    text: str


Said = str | ToolCall | CallStart | CallArguments
"""What a `CallSplitter` gives: text outside calls, a call's start and its arguments as they come (with
``progress``), and each call whole when it ends."""


def split_reply(text: str, form: CallFormat = HERMES) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's text outside its calls (None where nothing is left) and its calls, in order, as
    `CallSplitter` reads it."""
    splitter = CallSplitter(form)
    pieces = splitter.feed(text) + splitter.close()
    words = "".join(p for p in pieces if isinstance(p, str))
    return (words or None), [p for p in pieces if isinstance(p, ToolCall)]


class CallSplitter:
    """A streamed reply's text, split as it arrives into text and calls.

    `feed` gives what can be said so far. It holds back a tail that may be the start of ``<tool_call>``, a
    call not yet closed, and blanks that may turn out to stand next to a call: the layout's line breaks
    around calls, and blanks at the reply's start and end, are not text. A block whose text begins as a
    call does (``form``'s ``head``: Hermes' ``{"name": "NAME", "arguments": {``) is a call from there on:
    its arguments are what the model writes (`CallFormat.arguments`), and with ``progress`` the splitter
    gives its `CallStart` at once and its arguments as they come (`CallArguments`), then the `ToolCall`
    when it ends, even where the reply ends first (cut by its token limit). Another block is read whole
    when it closes (``form``'s ``read``): it is text where it holds no call, as is a block that was never
    closed.
    """

    def __init__(self, form: CallFormat = HERMES, progress: bool = False) -> None:
        self._form = form
        self._progress = progress
        self._held = ""
        self._in_call = False
        self._call: tuple[str, str, ArgumentStream, list[str]] | None = None
        """The call being read since its head: its id, its name, its arguments' stream and what it gave."""
        self._blanks = ""
        """Blanks after the text given so far, said only if more text follows."""
        self._after_call = True
        """The next text's leading blanks are not said (the reply's start, or after a call)."""
        self._before = ""
        """The blanks held before the block being read, said with it if it is not a call."""
        self.calls = 0
        """Calls read so far."""

    def feed(self, text: str) -> list[Said]:
        self._held += text
        out: list[Said] = []
        while True:
            if not self._in_call:
                words, found = self._upto(CALL_OPEN)
                self._say(words, out)
                if not found:
                    return out
                self._before, self._blanks = self._blanks, ""  # blanks before a call are the layout's
                self._held, self._in_call = CALL_OPEN + self._held, True
            elif self._call is None and not self._begin(out):
                end = self._held.find(CALL_CLOSE)
                if end < 0:
                    return out
                self._read_block(end, out)
            else:
                arguments, found = self._upto(CALL_CLOSE)
                self._arguments(arguments, out)
                if not found:
                    return out
                self._in_call = False
                self._finish(out)

    def _upto(self, tag: str) -> tuple[str, bool]:
        """The held text before ``tag``, taken off with the tag, and whether the tag came; where it has not,
        the text that cannot be the start of it (the rest stays held)."""
        at = self._held.find(tag)
        if at >= 0:
            text, self._held = self._held[:at], self._held[at + len(tag) :]
            return text, True
        cut = len(self._held) - partial_tail(self._held, tag)
        text, self._held = self._held[:cut], self._held[cut:]
        return text, False

    def _read_block(self, end: int, out: list[Said]) -> None:
        """Read the block that closes at ``end`` whole: a call, or text as written."""
        cut = end + len(CALL_CLOSE)
        block, self._held, self._in_call = self._held[:cut], self._held[cut:], False
        call = self._form.read(block[len(CALL_OPEN) : end].strip())
        if call is None:
            self._blanks = self._before
            self._say(block, out)
        else:
            self._end(call, out)

    def close(self) -> list[Said]:
        out: list[Said] = []
        if self._call is not None:  # a call cut short: a call, its arguments as far as they came
            self._arguments(self._held, out)
            self._held, self._in_call = "", False
            self._finish(out)
        if self._in_call:  # a block never closed: text, with the blanks before it
            self._blanks = self._before
        self._say(self._held, out)
        self._held, self._in_call, self._blanks = "", False, ""
        return out

    def _begin(self, out: list[Said]) -> bool:
        """Whether the open block's text so far (up to its close, where it has come) begins as a call;
        if so the call is open, its head taken off the held text."""
        end = self._held.find(CALL_CLOSE)
        inner = self._held[len(CALL_OPEN) : end if end >= 0 else len(self._held)]
        head = self._form.head(inner)
        if head is None:
            return False
        name, used = head
        call_id = new_call_id()
        self._call = (call_id, name, self._form.arguments(name), [])
        self._held = self._held[len(CALL_OPEN) + used :]
        if self._progress:
            out.append(CallStart(call_id, name))
        return True

    def _arguments(self, text: str, out: list[Said], last: bool = False) -> None:
        assert self._call is not None
        stream, said = self._call[2], self._call[3]
        more = stream.feed(text) + (stream.close() if last else "")
        if more:
            said.append(more)
            if self._progress:
                out.append(CallArguments(more))

    def _finish(self, out: list[Said]) -> None:
        assert self._call is not None
        self._arguments("", out, last=True)
        call_id, name, _, said = self._call
        self._call = None
        self._end(ToolCall(name, "".join(said), call_id), out)

    def _end(self, call: ToolCall, out: list[Said]) -> None:
        self.calls += 1
        self._blanks, self._after_call = "", True
        out.append(call)

    def _say(self, text: str, out: list[Said]) -> None:
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


def partial_tail(text: str, tag: str) -> int:
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


def tag_ids(tokenizer: Any, opening: str, closing: str) -> tuple[int, int] | None:
    """The ids of a pair of tags where the tokenizer holds each as one token; None where it spells one."""
    ids = [tokenizer.encode(tag) for tag in (opening, closing)]
    if all(len(one) == 1 for one in ids):
        return ids[0][0], ids[1][0]
    return None


def call_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The ``<tool_call>`` and ``</tool_call>`` tokens of a model whose vocabulary holds each tag as one
    token, as Qwen's does (the model writes its calls with them); None for a model that spells them in
    text."""
    return tag_ids(tokenizer, CALL_OPEN, CALL_CLOSE)
