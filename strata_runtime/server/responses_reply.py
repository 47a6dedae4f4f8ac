"""A Responses API reply written back: its output items in the order written (reasoning, the message, calls),
the message text's log-probabilities (`TokenSpans`), the response object, and the API's numbered events as
a reply streams (`EventStream`)."""

from __future__ import annotations

import json
from typing import Any

from ..chat import CallStart, ToolCall
from . import protocol as p


def new_id(prefix: str) -> str:
    """A fresh id of the Responses API (``resp_...``, ``msg_...``)."""
    return p.new_id(prefix, "_")


def output_items(
    parts: list[tuple[str, str | ToolCall]], spans: TokenSpans | None = None
) -> list[dict[str, Any]]:
    """A whole reply's output items in the order written: its parts (reasoning, text, calls, as a stream
    reads them), neighbouring text of one kind in one item; with ``spans``, each message's text carries the
    log-probabilities of the tokens it came from."""
    items: list[dict[str, Any]] = []
    for kind, part in parts:
        if isinstance(part, ToolCall):
            items.append(_call_item(part, new_id("fc"), "completed"))
            continue
        if items and items[-1]["type"] == _ITEM[kind] and items[-1]["status"] == "completed":
            items[-1]["content"][0]["text"] += part
        else:
            items.append(_text_item(kind, new_id(_PREFIX[kind]), part, "completed"))
        if spans is not None and kind == "content":
            items[-1]["content"][0]["logprobs"] += spans.take(part)
    return items


class TokenSpans:
    """A reply's generated tokens as log-probability entries (chat's shape: ``token``, ``logprob``,
    ``bytes``, ``top_logprobs``) and where each token's bytes fall in the reply's text, so that a stretch of
    its message text gets the entries of the tokens it came from (`take`): in order, each entry once, those
    of text that is not the message's (reasoning, a call, blanks next to them) left out."""

    def __init__(self) -> None:
        self._entries: list[dict[str, Any]] = []
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._data = bytearray()
        self._cursor = 0
        self._given = 0

    def add(self, entries: list[dict[str, Any]]) -> None:
        """The next tokens' entries, in the order generated."""
        for entry in entries:
            self._starts.append(len(self._data))
            self._data += bytes(entry["bytes"])
            self._ends.append(len(self._data))
            self._entries.append(entry)

    def take(self, text: str) -> list[dict[str, Any]]:
        """The entries of the tokens that ``text``, the next stretch of message text, came from; none where
        it is not found past the stretches taken before."""
        raw = text.encode("utf-8")
        at = self._data.find(raw, self._cursor)
        if at < 0 or not raw:
            return []
        end, out = at + len(raw), []
        while self._given < len(self._entries) and self._ends[self._given] <= at:
            self._given += 1  # tokens of text between the stretches, not the message's
        while self._given < len(self._entries) and self._starts[self._given] < end:
            out.append(self._entries[self._given])
            self._given += 1
        self._cursor = end
        return out


_ITEM = {"reasoning": "reasoning", "content": "message"}
_PREFIX = {"reasoning": "rs", "content": "msg"}


def _text_item(kind: str, item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A reasoning or message item; ``text`` None: as it opens, before its content."""
    if kind == "reasoning":
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}
    content = [] if text is None else [_output_text(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: ToolCall, item_id: str, status: str, arguments: str | None = None) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if arguments is None else arguments,
        "status": status,
    }


def reply_message(parts: list[tuple[str, str | ToolCall]]) -> dict[str, Any]:
    """A reply as the assistant message a later request's conversation holds (``previous_response_id``)."""
    text = "".join(p for kind, p in parts if kind == "content" and isinstance(p, str))
    message: dict[str, Any] = {"role": "assistant", "content": text}
    thought = [p for kind, p in parts if kind == "reasoning" and isinstance(p, str)]
    if thought:
        message["reasoning_content"] = "".join(thought)
    calls = [p.openai() for _, p in parts if isinstance(p, ToolCall)]
    if calls:
        message["tool_calls"] = calls
    return message


def usage(
    prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int
) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def response(
    response_id: str,
    created: int,
    model: str,
    echo: dict[str, Any],
    status: str,
    output: list[dict[str, Any]],
    use: dict[str, Any] | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A response object; ``status`` ``incomplete`` says the reply was cut by ``max_output_tokens``."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output,
        "usage": use,
        **echo,
    }


class EventStream:
    """A streamed reply as the Responses API's events, each numbered: an item opens when its kind of text
    first comes (reasoning or the message), takes deltas and closes when another kind comes; a call is an
    item of its own, its arguments in one delta. `items` are the items closed so far, as a whole reply has
    them."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self._open: tuple[str, str, list[str]] | None = None
        """The open text item: its kind, its id and its text so far."""
        self._logprobs: list[dict[str, Any]] = []
        """The open message's log-probabilities so far, where the request asked."""
        self._call: tuple[str, str] | None = None
        """The call said as it comes: its call id and its item's id."""

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    def text(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[bytes]:
        """``kind``: ``reasoning`` or ``content``; ``logprobs``: a message text's tokens' (`TokenSpans`)."""
        out: list[bytes] = []
        if self._open is None or self._open[0] != kind:
            out += self.close()
            item_id = new_id(_PREFIX[kind])
            self._open = (kind, item_id, [])
            at = len(self.items)
            item = _text_item(kind, item_id, None, "in_progress")
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _output_text("")
            out += [
                self.event("response.output_item.added", output_index=at, item=item),
                self.event(
                    "response.content_part.added",
                    item_id=item_id,
                    output_index=at,
                    content_index=0,
                    part=part,
                ),
            ]
        _, item_id, said = self._open
        said.append(text)
        where = {"item_id": item_id, "output_index": len(self.items), "content_index": 0}
        if kind == "reasoning":
            return out + [self.event("response.reasoning_text.delta", **where, delta=text)]
        self._logprobs += logprobs or []
        return out + [self.event("response.output_text.delta", **where, delta=text, logprobs=logprobs or [])]

    def call_start(self, start: CallStart) -> list[bytes]:
        """A call's item opened as the call begins; its arguments follow as they come (`call_arguments`)."""
        out = self.close()
        item_id, at = new_id("fc"), len(self.items)
        self._call = (start.id, item_id)
        opened = _call_item(ToolCall(start.name, "", start.id), item_id, "in_progress")
        return out + [self.event("response.output_item.added", output_index=at, item=opened)]

    def call_arguments(self, text: str) -> list[bytes]:
        assert self._call is not None
        where = {"item_id": self._call[1], "output_index": len(self.items)}
        return [self.event("response.function_call_arguments.delta", **where, delta=text)]

    def call(self, call: ToolCall) -> list[bytes]:
        """A call ended: its item closed (opened now, its arguments in one delta, where it was read only
        when it ended)."""
        if self._call is not None and self._call[0] == call.id:
            item_id, at = self._call[1], len(self.items)
            self._call = None
            where = {"item_id": item_id, "output_index": at}
            done = _call_item(call, item_id, "completed")
            self.items.append(done)
            return [
                self.event(
                    "response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments
                ),
                self.event("response.output_item.done", output_index=at, item=done),
            ]
        out = self.close()
        item_id, at = new_id("fc"), len(self.items)
        where = {"item_id": item_id, "output_index": at}
        done = _call_item(call, item_id, "completed")
        out += [
            self.event(
                "response.output_item.added",
                output_index=at,
                item=_call_item(call, item_id, "in_progress", ""),
            ),
            self.event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self.event(
                "response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments
            ),
            self.event("response.output_item.done", output_index=at, item=done),
        ]
        self.items.append(done)
        return out

    def close(self) -> list[bytes]:
        """Close the open text item, if one is."""
        if self._open is None:
            return []
        kind, item_id, said = self._open
        self._open = None
        text, at = "".join(said), len(self.items)
        where = {"item_id": item_id, "output_index": at, "content_index": 0}
        item = _text_item(kind, item_id, text, "completed")
        part = item["content"][0]
        if kind == "reasoning":
            out = [self.event("response.reasoning_text.done", **where, text=text)]
        else:
            part["logprobs"], self._logprobs = self._logprobs, []
            out = [self.event("response.output_text.done", **where, text=text, logprobs=part["logprobs"])]
        out += [
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=at, item=item),
        ]
        self.items.append(item)
        return out
