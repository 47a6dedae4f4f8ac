"""OpenAI's Responses API (``POST /v1/responses``) over the chat path: a body read into the chat body the
server already serves, so clients built on that API (agents, coding tools) can use the engine. The reply is
written back by `responses_reply`, and kept by `responses_store`.

What maps to what: ``instructions`` becomes the system message; ``input`` (a string, or a list of items)
the messages: a message item's text parts (``input_text``, ``output_text``) its text, ``function_call``
items an assistant's ``tool_calls``, ``function_call_output`` items ``tool`` messages, and a ``reasoning``
item the next assistant message's ``reasoning_content``. ``tools`` (``function`` tools: ``name``,
``description``, ``parameters``, ``strict``, true unless given, as the Responses API has it) become
functions; ``tool_choice`` and ``parallel_tool_calls`` carry over;
``text.format`` (``json_schema``, ``json_object``) becomes ``response_format``; ``reasoning.effort``
becomes ``reasoning_effort`` (``none`` or ``minimal`` turn Qwen3's thinking off); ``max_output_tokens``
becomes ``max_tokens``; ``include: ["message.output_text.logprobs"]`` and ``top_logprobs`` become
``logprobs`` and ``top_logprobs``. ``previous_response_id`` goes on from a kept reply's conversation, and
``conversation`` from a conversation the server keeps (`conversations`), whose items come first;
``truncation: "auto"`` lets a conversation too long for the context lose its oldest steps (`truncated`).
Images, files and built-in tools are refused by name.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, get_args

from . import protocol as p
from .errors import ApiError
from .responses_reply import new_id
from .responses_store import Store

if TYPE_CHECKING:
    from .conversations import Conversation, Conversations

PASSED = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "bad_words",
    "stream",
    "thinking_token_budget",
    "ignore_eos",
    "priority",
)
"""Fields a Responses body gives the chat path as they are (``top_k``, ``seed``, the repetition penalty,
``min_p``, ``min_tokens``, ``bad_words``, ``thinking_token_budget``, ``ignore_eos`` and ``priority`` as
extensions, as the chat path takes them)."""
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
"""A message item's parts that are text (a refusal's text is in its ``refusal``)."""


@dataclass(frozen=True)
class Asked:
    """A Responses body read for the chat path: the chat body, the conversation before the reply (without
    ``instructions``), and the request's fields the response object repeats."""

    chat: dict[str, Any]
    history: list[dict[str, Any]]
    echo: dict[str, Any]
    store: bool
    background: bool = False
    conversation: str | None = None
    """The conversation the reply goes on (``conversation``): its input and output items are added to it
    when the reply ends well."""
    items: list[dict[str, Any]] = field(default_factory=list)
    """The request's input as items (`stored_items`): kept with the reply, and added to its conversation."""
    truncate: bool = False
    """``truncation: "auto"``: a conversation longer than the context loses its oldest steps (`truncated`)."""


def to_chat(raw: Any, store: Store, conversations: Conversations | None = None) -> Asked:
    """A Responses body as the chat body it asks for, checked, with 400s naming the Responses field at
    fault; ``previous_response_id`` is looked up in ``store``, ``conversation`` in ``conversations``."""
    if not isinstance(raw, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "`model` is required: the served model's name", "model")
    history = _previous(raw.get("previous_response_id"), store)
    fresh = read_input(raw.get("input"))
    conversation, items = _conversation(raw, conversations), stored_items(raw["input"], "input")
    if conversation is not None:
        history += read_input(copy.deepcopy(conversation.items)) if conversation.items else []
        conversation.room(len(items) + 1, "conversation")  # its input, and at least one item of output
    history += fresh
    instructions = raw.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "`instructions` must be a string: the system message", "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    body: dict[str, Any] = {"model": model, "messages": system + history}
    limit = raw.get("max_output_tokens")
    if limit is not None:
        if type(limit) is not int or limit < 1:
            raise ApiError(
                400, "`max_output_tokens` must be a whole number of tokens, 1 or more", "max_output_tokens"
            )
        body["max_tokens"] = limit
    for key in PASSED:
        if raw.get(key) is not None:
            body[key] = raw[key]
    if raw.get("tools") is not None:
        body["tools"] = _tools(raw["tools"])
    if raw.get("tool_choice") is not None:
        body["tool_choice"] = _tool_choice(raw["tool_choice"])
    if raw.get("parallel_tool_calls") is not None:
        body["parallel_tool_calls"] = raw["parallel_tool_calls"]
    if raw.get("text") is not None:
        body.update(_text(raw["text"]))
    if raw.get("reasoning") is not None:
        body.update(_reasoning(raw["reasoning"]))
    body.update(_logprobs(raw.get("include"), raw.get("top_logprobs")))
    keep, background = raw.get("store", True), raw.get("background", False)
    if not isinstance(keep, bool):
        raise ApiError(400, "`store` must be true or false", "store")
    if not isinstance(background, bool):
        raise ApiError(400, "`background` must be true or false", "background")
    if background and not keep:
        raise ApiError(
            400,
            "`background`: a background reply is kept to be followed, so `store` cannot be false",
            "store",
        )
    truncation = raw.get("truncation")
    if truncation not in (None, "disabled", "auto"):
        raise ApiError(400, '`truncation` must be "auto" or "disabled"', "truncation")
    conversation_id = conversation.id if conversation is not None else None
    return Asked(body, history, _echo(raw), keep, background, conversation_id, items, truncation == "auto")


def truncated(messages: list[dict[str, Any]], dropped: int) -> list[dict[str, Any]] | None:
    """``messages`` without their ``dropped`` oldest steps (``truncation: "auto"``), or None where they have
    fewer to drop. A step is a user or assistant message with the tool answers after it; what is kept is the
    system messages, the first user message (an agent's task) and the latest steps, the last of which holds
    the request's input."""
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    if head < len(messages) and messages[head]["role"] == "user":
        head += 1
    steps = [i for i in range(head, len(messages)) if messages[i]["role"] in ("user", "assistant")]
    if dropped >= len(steps):  # the last step is the input: never dropped
        return None
    return messages[:head] + messages[steps[dropped] :]


def _conversation(raw: dict[str, Any], conversations: Conversations | None) -> Conversation | None:
    """The conversation ``conversation`` names (its id, or ``{"id": ...}``): a 404 naming it where the
    server keeps none such, a 400 beside ``previous_response_id`` (one way to carry a conversation on)."""
    value = raw.get("conversation")
    if value is None:
        return None
    conversation_id = value.get("id") if isinstance(value, dict) else value
    if not isinstance(conversation_id, str):
        raise ApiError(400, '`conversation` must be a conversation\'s id, or {"id": ...}', "conversation")
    if raw.get("previous_response_id") is not None:
        raise ApiError(
            400,
            "`conversation` cannot be given with `previous_response_id`: each carries a conversation on",
            "conversation",
        )
    if conversations is None:
        raise ApiError(400, "`conversation`: this server keeps no conversations", "conversation")
    return conversations.get(conversation_id, "conversation")


def _previous(value: Any, store: Store) -> list[dict[str, Any]]:
    if value is None:
        return []
    found = store.get(value) if isinstance(value, str) else None
    if found is None:
        raise ApiError(
            404,
            f"`previous_response_id`: no stored response {json.dumps(value)} (this server keeps the last "
            f"{store.most} replies made with `store`, in memory, until it restarts)",
            "previous_response_id",
            code="response_not_found",
        )
    if found.messages is None:
        status = found.now()["status"]
        raise ApiError(
            400,
            f"`previous_response_id`: response {json.dumps(value)} is {status.replace('_', ' ')}; a "
            "conversation goes on only from a reply that ended completed or incomplete",
            "previous_response_id",
        )
    return copy.deepcopy(found.messages)


def read_input(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "`input` is required: a string, or a list of one or more items", "input")
    out: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(value):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise ApiError(400, f"`{where}` must be an item (an object)", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(
                    400,
                    f'`{where}.role` must be "user", "system", "developer" or "assistant"',
                    f"{where}.role",
                )
            message: dict[str, Any] = {"role": role, "content": _text_of(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            out.append(message)
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise ApiError(
                    400,
                    f"`{where}` must give the call's `call_id`, `name` and `arguments` (JSON text)",
                    where,
                )
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            if reasoning is not None:
                out[-1]["reasoning_content"], reasoning = reasoning, None
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise ApiError(
                    400, f"`{where}.call_id` must be the id of the call it answers", f"{where}.call_id"
                )
            if not isinstance(output, str):
                output = _text_of(output, f"{where}.output", field="output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(
                isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
            ):
                raise ApiError(
                    400, f"`{where}.content` must be a list of reasoning text parts", f"{where}.content"
                )
            reasoning = (reasoning or "") + "".join(p["text"] for p in parts)
        else:
            raise ApiError(
                400,
                f"`{where}.type`: {kind} items are not supported by this server (messages, function calls, "
                "their outputs and reasoning only)",
                f"{where}.type",
            )
    return out


def stored_items(value: Any, where: str) -> list[dict[str, Any]]:
    """Input items (as the Responses API's ``input`` takes them; a string is a user message) checked, with
    400s naming ``where`` and the item at fault, and written as a conversation keeps them: each with an
    ``id`` (its own where it has one) and a message's text as parts."""
    items = [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value
    try:
        read_input(items)
    except ApiError as exc:
        param = exc.param or "input"
        named = where + param[len("input") :]
        raise ApiError(exc.status, exc.message.replace(f"`{param}`", f"`{named}`"), named) from None
    return [_stored(item) for item in items]


def _stored(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role, content = item["role"], item.get("content")
        if isinstance(content, str):
            part = "output_text" if role == "assistant" else "input_text"
            content = [
                {"type": part, "text": content, **({"annotations": []} if role == "assistant" else {})}
            ]
        return {
            "type": "message",
            "id": item.get("id") or new_id("msg"),
            "status": "completed",
            "role": role,
            "content": copy.deepcopy(content),
        }
    prefix = {"function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[str(kind)]
    stored = copy.deepcopy(item)
    stored["type"] = kind
    stored["id"] = item.get("id") or new_id(prefix)
    if kind != "reasoning":
        stored.setdefault("status", "completed")
    return stored


def _text_of(content: Any, where: str, field: str = "content") -> str:
    """A message's text: a string, or its text parts joined."""
    at = where if field == "output" else f"{where}.content"
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"`{at}` must be a string or a list of parts", at)
    text = ""
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise ApiError(
                400,
                f"`{at}.{j}.type`: {kind} parts are not supported by this server (text only)",
                f"{at}.{j}.type",
            )
        words = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(words, str):
            raise ApiError(400, f"`{at}.{j}` must hold its text", f"{at}.{j}")
        text += words
    return text


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise ApiError(400, "`tools` must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ApiError(
                400,
                f"`tools.{i}.type`: {kind} tools are not supported by this server (function tools only)",
                f"tools.{i}.type",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        function["strict"] = tool.get("strict", True)  # the Responses API holds calls by default
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any) -> Any:
    """``tool_choice`` in chat's shape: a function named, or ``allowed_tools`` (``mode`` and ``tools``, each
    ``{"type": "function", "name": ...}``) as chat's ``{"type": "allowed_tools", "allowed_tools": ...}``."""
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    if isinstance(value, dict) and value.get("type") == "allowed_tools":
        tools = value.get("tools")
        listed = [
            {"type": "function", "function": {"name": t.get("name")}} if isinstance(t, dict) else t
            for t in (tools if isinstance(tools, list) else [])
        ]
        return {
            "type": "allowed_tools",
            "allowed_tools": {"mode": value.get("mode"), "tools": listed or tools},
        }
    raise ApiError(
        400,
        '`tool_choice` must be "auto", "none", "required", {"type": "function", "name": ...} or '
        '{"type": "allowed_tools", "mode": ..., "tools": [...]}',
        "tool_choice",
    )


def _text(value: Any) -> dict[str, Any]:
    fmt = value.get("format") if isinstance(value, dict) else None
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        schema = {"name": fmt.get("name") or "reply", "schema": fmt.get("schema")}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise ApiError(
        400, '`text.format.type` must be "text", "json_schema" or "json_object"', "text.format.type"
    )


def _reasoning(value: Any) -> dict[str, Any]:
    """``reasoning.effort``, as chat's ``reasoning_effort`` (`protocol.ChatBody.reasoning_effort`)."""
    effort = value.get("effort") if isinstance(value, dict) else "?"
    if effort is not None and effort not in get_args(p.ReasoningEffort):
        efforts = ", ".join(get_args(p.ReasoningEffort))
        raise ApiError(400, f"`reasoning.effort` must be one of {efforts}", "reasoning.effort")
    return {} if effort is None else {"reasoning_effort": effort}


LOGPROBS = "message.output_text.logprobs"
"""The ``include`` entry that asks for the output text's log-probabilities."""


def _logprobs(include: Any, top: Any) -> dict[str, Any]:
    """``include`` (``message.output_text.logprobs``) and ``top_logprobs``, as chat's ``logprobs`` and
    ``top_logprobs``. Other entries of ``include`` ask for what this server does not keep (encrypted
    reasoning, tools' results): they add nothing, as such items are never in its replies."""
    listed = isinstance(include, list) and all(isinstance(x, str) for x in include)
    if include is not None and not listed:
        raise ApiError(400, "`include` must be a list of strings", "include")
    if LOGPROBS not in (include or []) and top is None:
        return {}
    return {"logprobs": True, "top_logprobs": 0 if top is None else top}


def _echo(raw: dict[str, Any]) -> dict[str, Any]:
    """The request's fields a response object repeats."""
    fmt: dict[str, Any] = raw["text"] if isinstance(raw.get("text"), dict) else {}
    effort: dict[str, Any] = raw["reasoning"] if isinstance(raw.get("reasoning"), dict) else {}
    return {
        "instructions": raw.get("instructions"),
        "max_output_tokens": raw.get("max_output_tokens"),
        "metadata": raw.get("metadata") or {},
        "parallel_tool_calls": raw.get("parallel_tool_calls", True),
        "background": raw.get("background", False),
        "conversation": _conversation_echo(raw.get("conversation")),
        "previous_response_id": raw.get("previous_response_id"),
        "reasoning": {"effort": effort.get("effort"), "summary": None},
        "store": raw.get("store", True),
        "temperature": raw.get("temperature", 1.0),
        "text": {"format": fmt.get("format") or {"type": "text"}},
        "tool_choice": raw.get("tool_choice", "auto"),
        "tools": raw.get("tools") or [],
        "top_p": raw.get("top_p", 1.0),
        "truncation": raw.get("truncation") or "disabled",
    }


def _conversation_echo(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    return {"id": value.get("id") if isinstance(value, dict) else value}


def field_of(param: str | None) -> str | None:
    """The Responses field an error of the chat path names."""
    if param is None:
        return None
    if param == "max_tokens":
        return "max_output_tokens"
    if param.startswith(("response_format", "structured_outputs")):
        return "text.format"
    if param.startswith("tools.") and ".function." in param:
        i, rest = param[len("tools.") :].split(".function.", 1)
        return f"tools.{i}.{rest}"
    if param.startswith("tool_choice.allowed_tools."):  # chat's allowed_tools, as the Responses API has it
        rest = param[len("tool_choice.allowed_tools.") :]
        return "tool_choice." + rest.removesuffix(".function.name")
    if param.startswith("tool_choice"):
        return "tool_choice.name" if param.endswith(".name") else "tool_choice"
    if param.startswith("messages"):
        return "input"
    return param
