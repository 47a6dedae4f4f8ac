"""Anthropic's Messages API (``POST /v1/messages``) over the chat path: a body read into the OpenAI chat body
the server already serves, and the reply written back in Anthropic's shapes, whole or as its stream of
events, so clients built on Anthropic's SDK (agents, coding tools) can use the engine.

What maps to what: ``system`` becomes the system message; a message's ``text`` blocks its text,
``tool_use`` blocks an assistant's ``tool_calls``, ``tool_result`` blocks ``tool`` messages; ``thinking``
blocks sent back become the assistant's ``reasoning_content`` (the chat template decides whether the prompt
shows them; ``redacted_thinking`` blocks are dropped). ``tools`` (``name``, ``description``,
``input_schema``, ``strict``) become functions; ``tool_choice`` ``auto``, ``any``, ``tool`` and ``none``
become ``"auto"``, ``"required"``, a named function and ``"none"``, and ``disable_parallel_tool_use``
``parallel_tool_calls: false``; ``thinking`` ``enabled`` (or ``adaptive``) / ``disabled`` becomes the
template's ``enable_thinking``, and ``budget_tokens`` the reasoning's budget (``thinking_token_budget``);
``stop_sequences`` become ``stop``; a last message of the assistant's is the start of
the reply, which goes on from it (``continue_final_message``). Images and documents are refused by name.
"""

from __future__ import annotations

import json
from typing import Any

from ..chat import CallStart, ToolCall
from . import protocol as p
from .errors import ApiError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
"""Anthropic's error type for each status (any other: ``api_error``)."""
MAX_STOP_SEQUENCES = 4
"""The stop sequences a request may give (the engine's limit on stop strings)."""


def error_body(exc: ApiError) -> dict[str, Any]:
    """An `ApiError` in Anthropic's error shape; the message names the field, as every error here does."""
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message},
    }


def to_chat(raw: Any, *, counting: bool = False) -> dict[str, Any]:
    """An Anthropic Messages body as the OpenAI chat body it asks for, checked, with 400s naming the
    Anthropic field at fault. ``counting``: a ``count_tokens`` body, which has no ``max_tokens``."""
    if not isinstance(raw, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "`model` is required: the served model's name", "model")
    body: dict[str, Any] = {
        "model": model,
        "messages": _system(raw.get("system")) + _messages(raw.get("messages")),
    }
    last = body["messages"][-1]
    if last["role"] == "assistant" and not last.get("tool_calls"):
        body["continue_final_message"] = True  # a prefill: the reply goes on from the assistant's text
    if not counting:
        max_tokens = raw.get("max_tokens")
        if type(max_tokens) is not int or max_tokens < 1:
            raise ApiError(
                400, "`max_tokens` is required: the most tokens the reply may have (1 or more)", "max_tokens"
            )
        body["max_tokens"] = max_tokens
    for key in ("temperature", "top_p", "top_k", "stream", "priority"):
        if raw.get(key) is not None:
            body[key] = raw[key]
    stops = raw.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ApiError(400, "`stop_sequences` must be a list of non-empty strings", "stop_sequences")
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ApiError(
                400, f"`stop_sequences` may hold at most {MAX_STOP_SEQUENCES} strings here", "stop_sequences"
            )
        body["stop"] = stops
    if raw.get("tools") is not None:
        body["tools"] = _tools(raw["tools"])
    if raw.get("tool_choice") is not None:
        body.update(_tool_choice(raw["tool_choice"]))
    if raw.get("thinking") is not None:
        body.update(_thinking(raw["thinking"], body.get("max_tokens")))
    return body


def _thinking(value: Any, max_tokens: int | None) -> dict[str, Any]:
    """``thinking``: whether the model reasons first (the template's ``enable_thinking``), and for how many
    tokens at most (``budget_tokens``, less than ``max_tokens`` as Anthropic requires; no lower bound
    here)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise ApiError(400, '`thinking.type` must be "enabled", "adaptive" or "disabled"', "thinking.type")
    out: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": kind != "disabled"}}
    budget = value.get("budget_tokens")
    if kind == "enabled" and budget is not None:
        if type(budget) is not int or budget < 1 or (max_tokens is not None and budget >= max_tokens):
            below = f", less than `max_tokens` ({max_tokens})" if max_tokens is not None else ""
            raise ApiError(
                400,
                f"`thinking.budget_tokens` must be a whole number of tokens, 1 or more{below}",
                "thinking.budget_tokens",
            )
        out["thinking_token_budget"] = budget
    return out


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "system", "content": value}] if value else []
    if isinstance(value, list):
        return [
            {"role": "system", "content": "".join(_text_of(b, f"system.{i}") for i, b in enumerate(value))}
        ]
    raise ApiError(400, "`system` must be a string or a list of text blocks", "system")


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "`messages` must be a list of one or more messages", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        where = f"messages.{i}"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise ApiError(400, f'`{where}.role` must be "user" or "assistant"', f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"`{where}.content` must be a string or a list of blocks", f"{where}.content")
        out += _assistant(content, where) if role == "assistant" else _user(content, where)
    return out


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user message's blocks: each ``tool_result`` a ``tool`` message, then its text as a user message."""
    out: list[dict[str, Any]] = []
    text = ""
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = _kind(block, at)
        if kind == "text":
            text += _text_of(block, at)
        elif kind == "tool_result":
            call = block.get("tool_use_id")
            if not isinstance(call, str):
                raise ApiError(
                    400, f"`{at}.tool_use_id` must be the id of the call it answers", f"{at}.tool_use_id"
                )
            answer = block.get("content", "")
            if isinstance(answer, list):
                answer = "".join(_text_of(b, f"{at}.content.{k}") for k, b in enumerate(answer))
            elif not isinstance(answer, str):
                raise ApiError(
                    400, f"`{at}.content` must be a string or a list of text blocks", f"{at}.content"
                )
            if block.get("is_error") is True:
                answer = f"Error: {answer}"
            out.append({"role": "tool", "tool_call_id": call, "content": answer})
        else:
            raise _unsupported(kind, at)
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def _assistant(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """An assistant message's blocks: its text, its ``thinking`` as its reasoning, and each ``tool_use`` one
    of its ``tool_calls``."""
    text, reasoning, calls = "", None, []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = _kind(block, at)
        if kind == "text":
            text += _text_of(block, at)
        elif kind == "tool_use":
            name, args = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not name or not isinstance(args, dict):
                raise ApiError(
                    400, f"`{at}` must name the tool (`name`) and give its `input` as an object", at
                )
            call_id = block.get("id") if isinstance(block.get("id"), str) else f"toolu_{j}"
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            )
        elif kind == "thinking":
            thought = block.get("thinking")
            if not isinstance(thought, str):
                raise ApiError(400, f"`{at}.thinking` must be the reasoning's text", f"{at}.thinking")
            reasoning = (reasoning or "") + thought
        elif kind != "redacted_thinking":
            raise _unsupported(kind, at)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return [message]


def _kind(block: Any, at: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise ApiError(400, f"`{at}.type` is required: the kind of block", f"{at}.type")
    return kind


def _text_of(block: Any, at: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise ApiError(400, f'`{at}` must be a text block: {{"type": "text", "text": ...}}', at)
    return str(block["text"])


def _unsupported(kind: str, at: str) -> ApiError:
    return ApiError(
        400,
        f"`{at}.type`: {kind} blocks are not supported by this server (text and tools only)",
        f"{at}.type",
    )


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise ApiError(400, "`tools` must be a list of tools", "tools")
    out = []
    for i, tool in enumerate(value):
        at = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(
                400, f"`{at}`: only client tools (name, input_schema) are supported, not {kind}", at
            )
        if not isinstance(tool.get("input_schema"), dict):
            raise ApiError(
                400, f"`{at}.input_schema` must be a JSON schema (an object)", f"{at}.input_schema"
            )
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("strict") is not None:  # its calls held to the schema, as the chat path holds them
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any) -> dict[str, Any]:
    kind = value.get("type") if isinstance(value, dict) else None
    choice: Any = (
        {"auto": "auto", "any": "required", "none": "none"}.get(kind) if isinstance(kind, str) else None
    )
    if kind == "tool":
        if not isinstance(value.get("name"), str):
            raise ApiError(400, '`tool_choice.name` is required with `"type": "tool"`', "tool_choice.name")
        choice = {"type": "function", "function": {"name": value["name"]}}
    if choice is None:
        raise ApiError(400, '`tool_choice.type` must be "auto", "any", "tool" or "none"', "tool_choice.type")
    out: dict[str, Any] = {"tool_choice": choice}
    if value.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


def field_of(param: str | None) -> str | None:
    """The Anthropic field an error of the chat path names (``stop`` is ``stop_sequences``; a chat
    message's index is not a Messages one, so ``messages.N...`` becomes ``messages``)."""
    if param is None:
        return None
    if param == "stop":
        return "stop_sequences"
    if param == "thinking_token_budget":
        return "thinking.budget_tokens"
    if param.startswith("tools.") and ".function." in param:
        i, rest = param[len("tools.") :].split(".function.", 1)
        return f"tools.{i}." + {"parameters": "input_schema"}.get(rest, rest)
    if param.startswith("tool_choice"):
        return "tool_choice.name" if param.endswith(".name") else "tool_choice"
    if param.startswith("messages."):
        return "messages"
    return param


def new_message_id() -> str:
    return p.new_id("msg", "_")


def stop_reason(finish: str, calls: bool, stop: str | int | None) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for how a reply ended."""
    if finish == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Anthropic's usage: the prompt tokens read (those a slot kept count as read from the cache)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def content_blocks(parts: list[tuple[str, str | ToolCall]]) -> list[dict[str, Any]]:
    """A whole reply's content as Anthropic's blocks, in the order it was written: its parts (reasoning,
    text, calls, as a stream reads them) with neighbouring text of one kind in one block."""
    blocks: list[dict[str, Any]] = []
    for kind, part in parts:
        if isinstance(part, ToolCall):
            blocks.append(tool_use(part))
            continue
        key = "thinking" if kind == "reasoning" else "text"
        if blocks and blocks[-1]["type"] == key:
            blocks[-1][key] += part
        else:
            blocks.append({"type": key, key: part} | ({"signature": ""} if key == "thinking" else {}))
    return blocks


def tool_use(call: ToolCall | CallStart) -> dict[str, Any]:
    """A call as a ``tool_use`` block: its input the call's arguments (empty where the call has only begun,
    and where its arguments are not a JSON object: a call cut short by the token limit)."""
    try:
        given = json.loads(call.arguments) if isinstance(call, ToolCall) else {}
    except json.JSONDecodeError:
        given = {}
    return {
        "type": "tool_use",
        "id": call.id.replace("call_", "toolu_", 1),
        "name": call.name,
        "input": given if isinstance(given, dict) else {},
    }


def message(
    message_id: str,
    model: str,
    blocks: list[dict[str, Any]],
    stop: tuple[str | None, str | None],
    use: dict[str, int],
) -> dict[str, Any]:
    """A whole reply (``stop``: its ``stop_reason`` and ``stop_sequence``; both None in a stream's first
    event)."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": use,
    }


def event(kind: str, **fields: Any) -> bytes:
    """One server-sent event of a Messages stream."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, separators=(',', ':'))}\n\n".encode()


class BlockStream:
    """A streamed reply's content blocks as Anthropic's events: a block opens when its kind of text first
    comes (thinking or text), takes deltas, and closes when another kind comes; a call is a block of its
    own, opened as the call begins (`call_start`), its input in ``input_json_delta``s as it comes, closed
    when the call ends (a call read only when it ended comes whole, its input in one delta)."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self._started: set[str] = set()
        """The calls said as they came."""

    def call_start(self, start: CallStart) -> list[bytes]:
        self._started.add(start.id)
        return self._start("tool_use", tool_use(start))

    def call_arguments(self, text: str) -> list[bytes]:
        delta = {"type": "input_json_delta", "partial_json": text}
        return [event("content_block_delta", index=self.index, delta=delta)]

    def text(self, kind: str, text: str) -> list[bytes]:
        """``kind``: ``thinking`` or ``text``."""
        out = [] if self.open == kind else self._start(kind, {"type": kind, kind: ""})
        delta = (
            {"type": "thinking_delta", "thinking": text}
            if kind == "thinking"
            else {"type": "text_delta", "text": text}
        )
        return out + [event("content_block_delta", index=self.index, delta=delta)]

    def call(self, call: ToolCall) -> list[bytes]:
        if call.id in self._started:  # said as it came: only its block's end is left
            return self.close()
        block = tool_use(call)
        out = self._start("tool_use", {**block, "input": {}})
        out.append(
            event(
                "content_block_delta",
                index=self.index,
                delta={"type": "input_json_delta", "partial_json": call.arguments},
            )
        )
        return out + self.close()

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", index=self.index)]

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [event("content_block_start", index=self.index, content_block=block)]
