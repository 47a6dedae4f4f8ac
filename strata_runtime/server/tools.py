"""OpenAI's tool calling on ``/v1/chat/completions``: a request's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` checked, and the grammar that holds a reply to calls where the request requires them.

The tools reach the model through the chat template (`strata_runtime.chat` writes them where the template
does not); the reply's calls are read out of its text (`strata_runtime.chat.split_reply`). With
``tool_choice`` ``"auto"`` the model decides whether to call; ``"required"`` and a named function hold the
reply to one call or more (one, with ``parallel_tool_calls`` false) of the allowed tools, each call's
arguments following that tool's ``parameters`` schema, through the same grammars as structured output;
``allowed_tools`` keeps every tool in the prompt and holds the calls to those it lists. ``"none"`` leaves the
tools out of the prompt.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

from .. import xml_calls
from ..chat import CALL_CLOSE, CALL_OPEN, HERMES, CallFormat
from ..structured import around, lark_grammar
from ..xml_calls import Layout
from .errors import ApiError

MAX_TOOLS = 128
"""OpenAI's limit on a request's tools."""
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CALL_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""A held call's JSON is laid out as the chat templates write calls (Python's ``json.dumps`` defaults), the
text the model was trained on."""

Choice = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True)
class ToolUse:
    """What a chat request asks of tools."""

    tools: tuple[dict[str, Any], ...]
    """The tool definitions as the request gave them (``{"type": "function", "function": {...}}``)."""
    choice: Choice
    function: str | None = None
    """The one tool the reply must call (``choice`` ``"function"``)."""
    parallel: bool = True
    """Whether a reply may make more than one call."""
    call_tokens: tuple[int, int] | None = None
    """The model's ``<tool_call>`` and ``</tool_call>`` tokens where its vocabulary holds each tag as one
    token (`strata_runtime.chat.call_ids`): a held call is written with them, as the model was trained to
    write calls, and only then can ``"auto"`` hold the calls of strict tools (`grammar`)."""
    reply_format: str | None = None
    """The grammar the reply follows where it does not call (``response_format`` or ``structured_outputs``,
    with ``"auto"``): under strict tools the reply is then either that or calls."""
    layout: Layout = "hermes"
    """How the model writes its calls (`strata_runtime.xml_calls.call_layout`): they are read, and held, in
    that layout."""
    allowed: tuple[str, ...] | None = None
    """The only tools the reply may call (``tool_choice`` ``allowed_tools``), all of them still offered in
    the prompt; None: any."""

    @cached_property
    def call_format(self) -> CallFormat:
        """How the model's layout is read (XML values typed by these tools' schemas)."""
        return xml_calls.call_format(self.tools) if self.layout == "xml" else HERMES

    @property
    def offered(self) -> list[dict[str, Any]] | None:
        """The tools the prompt offers (none with ``tool_choice`` ``"none"``), as the request gave them but
        for ``strict``, which tells the server how to hold calls, not the model what a tool does (so a tool
        reads the same to the model on every API)."""
        if self.choice == "none":
            return None
        return [
            {**t, "function": {k: v for k, v in t["function"].items() if k != "strict"}} for t in self.tools
        ]

    @property
    def strict(self) -> bool:
        """Whether some tool asks that its calls' arguments follow its ``parameters`` (``"strict": true``)."""
        return any(t["function"].get("strict") is True for t in self.tools)

    @property
    def holds(self) -> bool:
        """Whether a grammar holds the reply's calls: where it must call (``"required"`` or a named
        function), and with ``"auto"`` where some tool is strict or the calls are limited to some tools
        (`allowed`) and the model writes its calls with tokens of their own (`call_tokens`)."""
        auto = (
            self.choice == "auto"
            and (self.strict or self.allowed is not None)
            and self.call_tokens is not None
        )
        return self.choice in ("required", "function") or auto

    @property
    def held(self) -> list[int]:
        """The tools whose ``parameters`` the grammar holds a call's arguments to (their indices): those the
        reply may call where a call is required, the strict ones of them where ``"auto"`` holds calls, else
        none."""
        if not self.holds:
            return []
        callable_ = [i for i, t in enumerate(self.tools) if self._callable(t["function"]["name"])]
        if self.choice == "auto":
            return [i for i in callable_ if self.tools[i]["function"].get("strict") is True]
        return callable_

    def _callable(self, name: str) -> bool:
        """Whether the reply may call the tool named ``name`` (the named one, or one of the allowed)."""
        return self.function in (None, name) and (self.allowed is None or name in self.allowed)

    @cached_property
    def grammar(self) -> str | None:
        """The grammar a reply follows where its calls are held: calls to the allowed tools, a line apart,
        each with arguments that follow the tool's ``parameters``, where the reply must call (``"required"``
        or a named function); and with ``"auto"`` where some tool is strict and the model writes its calls
        with tokens of their own (`call_tokens`), free text, then calls held so from the model's
        ``<tool_call>`` token on (a strict tool's arguments follow its ``parameters``, another's are any JSON
        object), or with a `reply_format`, either a reply that follows it or calls. None where nothing
        holds the reply (or only the format does: then the format is the reply's grammar)."""
        if not self.holds:
            return None
        functions = [t["function"] for t in self.tools if self._callable(t["function"]["name"])]
        auto = self.choice == "auto"
        if self.layout == "xml":
            rules = [xml_calls.text_rule()]
            for i, f in enumerate(functions):
                rules += xml_calls.function_rule(f"f{i}", f, loose=auto and f.get("strict") is not True)
        else:
            rules = [
                f"f{i}: %json {json.dumps(_call_schema(f, loose=auto and f.get('strict') is not True))}"
                for i, f in enumerate(functions)
            ]
        if self.call_tokens is not None:
            opening, closing = (f"<[{t}]>" for t in self.call_tokens)
        else:
            opening, closing = json.dumps(CALL_OPEN), json.dumps(CALL_CLOSE)
        calls = 'call ("\\n" call)*' if self.parallel else "call"
        held = [
            f'call: {opening} "\\n" body "\\n" {closing}',
            "body: " + " | ".join(f"f{i}" for i in range(len(functions))),
            *rules,
        ]
        if auto and self.reply_format is not None:  # the format's reply, or calls
            return around(
                self.reply_format, "calls", lambda part: "\n".join([f"start: @{part} | {calls}", *held])
            )
        start = f"start: text ({calls})?\ntext: /(?s:.*)/" if auto else f"start: {calls}"
        return lark_grammar("\n".join([start, *held]))


def _call_schema(function: dict[str, Any], loose: bool = False) -> dict[str, Any]:
    """The JSON schema of one call to ``function``: its name, then arguments that follow its ``parameters``
    (an empty object where it has none, as OpenAI reads a function without parameters), or with ``loose``
    any JSON object."""
    params = function.get("parameters")
    if loose:
        params = {"type": "object"}
    elif params is None:
        params = {"type": "object", "properties": {}, "additionalProperties": False}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": CALL_LAYOUT,
    }


def tool_use(
    extra: dict[str, Any],
    grammar: str | None,
    call_tokens: tuple[int, int] | None = None,
    layout: Layout = "hermes",
) -> ToolUse | None:
    """The tools a chat body's extra fields ask for (None: no tools), checked, with 400s naming the field
    at fault. ``grammar``: the body's structured output, which a required call cannot be combined with (with
    ``"auto"`` and strict tools, the reply follows it or calls). ``call_tokens``: the model's call tags as
    tokens of their own (`ToolUse.call_tokens`); ``layout``, how it writes calls (`ToolUse.layout`)."""
    tools, choice, parallel = extra.get("tools"), extra.get("tool_choice"), extra.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "`parallel_tool_calls` must be true or false", "parallel_tool_calls")
    checked = _tools(tools) if tools is not None else ()
    kind, name = _choice(choice, checked)
    if not checked:
        return None
    if kind in ("required", "function") and grammar is not None:
        raise ApiError(
            400,
            "a reply cannot both call a tool (`tool_choice`) and follow `response_format` or "
            "`structured_outputs`; give one of them",
            "tool_choice",
        )
    allowed = _allowed(choice, checked) if kind in ("auto", "required") and isinstance(choice, dict) else None
    use = ToolUse(checked, kind, name, parallel is not False, call_tokens, grammar, layout, allowed)
    if layout == "xml":
        for i in use.held:
            function = checked[i]["function"]
            try:
                xml_calls.function_rule(
                    "f", function, loose=kind == "auto" and function.get("strict") is not True
                )
            except ValueError as exc:
                field = f"tools.{i}.function.parameters"
                raise ApiError(400, f"`{field}` cannot be held: {exc}", field) from None
    return use


def _tools(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list):
        raise ApiError(400, "`tools` must be a list of tools", "tools")
    if len(value) > MAX_TOOLS:
        raise ApiError(400, f"`tools` may hold at most {MAX_TOOLS} tools (got {len(value)})", "tools")
    seen: set[str] = set()
    for i, tool in enumerate(value):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ApiError(400, f'`{where}` must be {{"type": "function", "function": {{...}}}}', where)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ApiError(
                400, f'`{where}.function` must be an object: {{"name": ..., "parameters": {{...}}}}', where
            )
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            field = f"{where}.function.name"
            raise ApiError(400, f"`{field}` must be 1 to 64 letters, digits, underscores or dashes", field)
        if name in seen:
            field = f"{where}.function.name"
            raise ApiError(400, f"`{field}`: two tools are named `{name}`", field)
        seen.add(name)
        for key, kind, words in (
            ("description", str, "a string"),
            ("parameters", dict, "a JSON schema (an object)"),
            ("strict", bool, "true or false"),
        ):
            if function.get(key) is not None and not isinstance(function[key], kind):
                field = f"{where}.function.{key}"
                raise ApiError(400, f"`{field}` must be {words}", field)
    return tuple(value)


def _choice(value: Any, tools: tuple[dict[str, Any], ...]) -> tuple[Choice, str | None]:
    """``tool_choice`` as a kind and, for a named function, its name; the default is ``"auto"`` with tools
    and ``"none"`` without. ``{"type": "allowed_tools", ...}`` is its mode (`_allowed` reads its tools)."""
    if value is None:
        return ("auto" if tools else "none"), None
    if isinstance(value, dict) and value.get("type") == "allowed_tools":
        spec = value.get("allowed_tools")
        mode = spec.get("mode") if isinstance(spec, dict) else None
        if mode not in ("auto", "required"):
            field = "tool_choice.allowed_tools.mode"
            raise ApiError(400, f'`{field}` must be "auto" or "required"', field)
        if not tools:
            raise ApiError(400, "`tool_choice` allowed_tools needs `tools`", "tool_choice")
        kind: Choice = mode
        return kind, None
    if value in ("none", "auto", "required"):
        kind = value
        if kind != "none" and not tools:
            raise ApiError(400, f'`tool_choice` "{kind}" needs `tools`', "tool_choice")
        return kind, None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise ApiError(
            400,
            '`tool_choice` must be "none", "auto", "required" or {"type": "function", "function": '
            '{"name": ...}}',
            "tool_choice",
        )
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        field = "tool_choice.function.name"
        offered = ", ".join(f"`{n}`" for n in names) or "none"
        raise ApiError(400, f"`{field}`: no tool is named `{name}` (the tools: {offered})", field)
    return "function", name


def _allowed(value: dict[str, Any], tools: tuple[dict[str, Any], ...]) -> tuple[str, ...]:
    """The names an ``allowed_tools`` choice lets the reply call (``allowed_tools.tools``: function tools of
    the request's, at least one)."""
    listed = value["allowed_tools"].get("tools")
    field = "tool_choice.allowed_tools.tools"
    if not isinstance(listed, list) or not listed:
        raise ApiError(400, f"`{field}` must be a list of one or more of the request's tools", field)
    names = [t["function"]["name"] for t in tools]
    out: list[str] = []
    for i, tool in enumerate(listed):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or name not in names:
            at = f"{field}.{i}"
            offered = ", ".join(f"`{n}`" for n in names)
            raise ApiError(
                400,
                f'`{at}` must be {{"type": "function", "function": {{"name": ...}}}} naming one of the '
                f"request's tools ({offered})",
                at,
            )
        out.append(str(name))
    return tuple(out)
