"""Tool calls in the XML layout Qwen3-Coder models are trained on, beside the Hermes layout of `chat`.

A call is a ``<tool_call>`` block, as in the Hermes layout, but what it holds is not JSON: the function's
name in a ``<function=NAME>`` tag, then each argument in a ``<parameter=KEY>`` tag of its own, its value
written on the lines between as raw text (a string as itself, a number or a boolean as its JSON, an object
or a list as JSON), and ``</function>``::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Bath
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A checkpoint whose chat template writes calls this way (`layout_of`) is read and held in it: `call_format`
reads a reply's calls, each from its ``<function=NAME>`` tag on, its parameters written as the JSON
arguments OpenAI's API carries as they come (`Arguments`), each value typed by the tool's ``parameters``
schema; `read_call` reads a whole block's text the same way; `for_template`
gives the template the calls of earlier turns with their arguments as mappings, as it writes them one by
one; `function_rule` is the grammar of one call's body, for calls the server holds to their schemas.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from .chat import CallFormat, ToolCall, partial_tail

Layout = Literal["hermes", "xml"]
"""How a model writes its tool calls: JSON in ``<tool_call>`` blocks (Qwen3's "Hermes" layout), or XML tags
(Qwen3-Coder's)."""

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
PARAMETER_CLOSE = "</parameter>"
STRING_KEYS = ("pattern", "format", "minLength", "maxLength")
"""What a string parameter's schema may say that a held call cannot hold in this layout (the value is raw
text, not JSON: only its ``enum`` or ``const`` is held)."""


def layout_of(template: str | None) -> Layout:
    """The layout a chat template writes calls in: XML where it writes ``<function=`` and ``<parameter=``
    tags, else Hermes (which the server writes itself for a template that knows no tools)."""
    if template is not None and "<function=" in template and "<parameter=" in template:
        return "xml"
    return "hermes"


def call_layout(tokenizer: Any) -> Layout:
    """The layout a model's tokenizer has its calls written in: its chat template's where the template
    writes tools itself, else Hermes (the server writes them for it)."""
    if not getattr(tokenizer, "template_knows_tools", False):
        return "hermes"
    return layout_of(getattr(tokenizer, "template", None))


def call_format(tools: Sequence[Mapping[str, Any]]) -> CallFormat:
    """This layout as `chat.CallSplitter` reads it: a block is a call from its ``<function=NAME>`` tag on,
    its arguments written as JSON as its parameters come (`Arguments`), typed by ``tools``' schemas."""
    return CallFormat(
        lambda inner: read_call(inner, tools),
        _head,
        lambda name: Arguments(_properties(name, tools)),
    )


_HEAD = re.compile(r"\s*<function=([^>\n]+)>")


def _head(text: str) -> tuple[str, int] | None:
    found = _HEAD.match(text)
    if found is None or not found.group(1).strip():
        return None
    return found.group(1).strip(), found.end()


class Arguments:
    """A call's parameters, as they come, written as its arguments' JSON object (``{"KEY": VALUE, ...}``,
    laid out as ``json.dumps`` lays it out): a string value's text as it comes (but for a line break and a
    tail that may begin ``</parameter>``, held until known), any other value once its tag closes, typed
    by its schema (`_value`). Text outside the tags is not the call's; ``</function>`` ends it."""

    def __init__(self, properties: Mapping[str, Any]) -> None:
        self._properties = properties
        self._held = ""
        self._count = 0
        self._key: str | None = None
        """The open parameter's name."""
        self._string = False
        """Whether its value is written as it comes (a string)."""
        self._started = False
        """Whether its value's first character has come (a line break there is the layout's)."""
        self._ended = False

    def feed(self, text: str) -> str:
        self._held += text
        out: list[str] = []
        while not self._ended:
            if self._key is not None:
                if not self._value(out):
                    break
                continue
            self._held = self._held.lstrip()
            if self._held.startswith(FUNCTION_CLOSE):
                self._ended = True
                break
            if not self._held.startswith(PARAMETER_OPEN):
                cut = min(_next_tag(self._held), len(self._held))
                if cut == len(self._held) and _could_begin(self._held):
                    break
                self._held = self._held[max(cut, 1) :] if self._held else ""
                if not self._held:
                    break
                continue
            close = self._held.find(">")
            if close < 0:
                break
            self._key = self._held[len(PARAMETER_OPEN) : close].strip()
            self._held, self._started = self._held[close + 1 :], False
            self._string = _types(self._properties.get(self._key)) in (set(), {"string"})
            out.append(("{" if self._count == 0 else ", ") + json.dumps(self._key, ensure_ascii=False) + ": ")
            out.append('"' if self._string else "")
            self._count += 1
        return "".join(out)

    def _value(self, out: list[str]) -> bool:
        """Write what can be of the open parameter's value; whether it closed."""
        if not self._started:
            if not self._held:
                return False
            self._started = True
            if self._held.startswith("\n"):
                self._held = self._held[1:]
        end = self._held.find(PARAMETER_CLOSE)
        if end < 0:
            if self._string:
                tails = (
                    partial_tail(self._held, "\n" + PARAMETER_CLOSE),
                    partial_tail(self._held, PARAMETER_CLOSE),
                )
                keep = max(*tails, 1 if self._held.endswith("\n") else 0)
                said, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
                out.append(_escaped(said))
            return False
        raw, self._held = self._held[:end], self._held[end + len(PARAMETER_CLOSE) :]
        raw = raw[:-1] if raw.endswith("\n") else raw
        self._close_value(raw, out)
        return True

    def _close_value(self, raw: str, out: list[str]) -> None:
        if self._string:
            out.append(_escaped(raw) + '"')
        else:
            out.append(json.dumps(_value(raw, self._properties.get(self._key or "")), ensure_ascii=False))
        self._key = None

    def close(self) -> str:
        out: list[str] = []
        if self._key is not None:  # a parameter never closed: its value as far as it came
            raw = self._held[1:] if not self._started and self._held.startswith("\n") else self._held
            self._close_value(raw, out)
        self._held, self._ended = "", True
        return "".join(out) + ("}" if self._count else "{}")


PARAMETER_OPEN = "<parameter="
FUNCTION_CLOSE = "</function>"


def _escaped(text: str) -> str:
    """A stretch of a JSON string's text, escaped as ``json.dumps`` escapes it."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _next_tag(text: str) -> int:
    """Where the next ``<`` after the first character is (the length of ``text`` where none is)."""
    at = text.find("<", 1)
    return at if at >= 0 else len(text)


def _could_begin(text: str) -> bool:
    """Whether ``text`` may yet turn out to begin a parameter's tag or ``</function>``."""
    return PARAMETER_OPEN.startswith(text) or FUNCTION_CLOSE.startswith(text)


def read_call(inner: str, tools: Sequence[Mapping[str, Any]] = ()) -> ToolCall | None:
    """The call a ``<tool_call>`` block's text writes, its arguments typed by the named tool's
    ``parameters`` (`_value`), or None where the text is not one call."""
    found = _FUNCTION.fullmatch(inner.strip())
    if found is None:
        return None
    name, body = found.group(1).strip(), found.group(2)
    if not name:
        return None
    properties = _properties(name, tools)
    args: dict[str, Any] = {}
    end = 0
    for param in _PARAMETER.finditer(body):
        if body[end : param.start()].strip():
            return None  # text between the tags: not this layout
        key, raw = param.group(1).strip(), param.group(2)
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        args[key] = _value(raw, properties.get(key))
        end = param.end()
    if body[end:].strip():
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _properties(name: str, tools: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    for tool in tools:
        function = tool.get("function", tool)
        if function.get("name") == name:
            params = function.get("parameters")
            props = params.get("properties") if isinstance(params, Mapping) else None
            return props if isinstance(props, Mapping) else {}
    return {}


def _value(raw: str, schema: Any) -> Any:
    """A parameter's raw text as the value its schema says it is: a string as itself; a number, a boolean,
    null, an object or a list as the JSON it is written in (an object or a list also as the Python literal
    a template's ``string`` filter writes), where it parses as one of the schema's types; else, and without
    a schema, the text."""
    types = _types(schema)
    if not types or types == {"string"}:
        return raw
    if "boolean" in types and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
        if types & {"object", "array"}:
            try:
                value = ast.literal_eval(raw.strip())
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return raw
    return value if _is(value, types) else raw


ALIASES = {"int": "integer", "float": "number", "bool": "boolean", "str": "string", "text": "string"}
ALIASES |= {"dict": "object", "list": "array"}
"""Type names some tool definitions use in place of JSON schema's."""


def _types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows (``any`` where it says none it can be read from)."""
    if not isinstance(schema, Mapping):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {ALIASES.get(kind, kind)}
    if isinstance(kind, list):
        return {ALIASES.get(k, k) for k in kind if isinstance(k, str)}
    if "enum" in schema or "const" in schema:
        values = schema.get("enum") or [schema.get("const")]
        return {_type_name(v) for v in values}
    found: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for part in schema.get(key) or ():
            found |= _types(part)
    return found or {"any"}


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if value is None:
        return "null"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else "any"


def _is(value: Any, types: set[str]) -> bool:
    if "any" in types:
        return True
    kind = _type_name(value)
    return kind in types or (kind == "integer" and "number" in types)


def for_template(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as an XML-layout template reads them: each earlier call's arguments as a mapping (the
    template writes them a parameter at a time), where they came as JSON text."""
    out: list[dict[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            out.append(dict(message))
            continue
        written = []
        for call in calls:
            function = dict(call.get("function", call))
            args = function.get("arguments")
            if isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except json.JSONDecodeError:
                    parsed = None
                function["arguments"] = parsed if isinstance(parsed, dict) else {}
            written.append({**call, "function": function} if "function" in call else function)
        out.append({**message, "tool_calls": written})
    return out


# ---- held calls -------------------------------------------------------------------------------------------


def function_rule(rule: str, function: Mapping[str, Any], loose: bool) -> list[str]:
    """The grammar (llguidance's Lark) of a call's body to ``function`` in this layout, as rule ``rule``
    and the rules it uses: its name's tag, then each of its ``parameters``' properties in their order
    (those it does not require may be left out), then ``</function>``; with ``loose``, or where the schema
    lists no properties, any parameters. A string value is any text without ``</parameter>`` (or one of
    its ``enum``); every other value is JSON that follows its schema. `ValueError` names a string property
    whose schema says more than this layout can hold (`STRING_KEYS`). The rules use ``TEXT`` (`text_rule`)."""
    name = function["name"]
    params = function.get("parameters")
    properties = params.get("properties") if isinstance(params, Mapping) and not loose else None
    head = json.dumps(f"<function={name}>\n")
    if not properties:
        key = f"{rule}_any"
        return [f'{rule}: {head} {key}* "</function>"', f'{key}: "<parameter=" /[^>\\n]+/ ">\\n" TEXT']
    required = set(params.get("required") or ()) if isinstance(params, Mapping) else set()
    rules, parts = [], []
    for i, (key, schema) in enumerate(properties.items()):
        part = f"{rule}_{i}"
        opening = json.dumps(f"<parameter={key}>\n")
        rules.append(f"{part}: {opening} {_value_rule(key, schema)}")
        parts.append(part if key in required else f"{part}?")
    return [f'{rule}: {head} {" ".join(parts)} "</function>"', *rules]


def _value_rule(key: str, schema: Any) -> str:
    close = json.dumps(f"\n{PARAMETER_CLOSE}\n")
    types = _types(schema)
    if not types or ("string" in types and types <= {"string", "null"}):  # raw text ("null": None)
        if isinstance(schema, Mapping):
            choices = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
            if choices:
                return "(" + " | ".join(json.dumps(str(c)) for c in choices) + f") {close}"
            said = [k for k in STRING_KEYS if k in schema]
            if said:
                raise ValueError(
                    f"`{key}`: a string's `{said[0]}` cannot be held in this model's call layout (its value "
                    "is raw text); only its `enum` or `const` can"
                )
        return "TEXT"
    body = dict(schema) if isinstance(schema, Mapping) else {}
    body["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return f"%json {json.dumps(body)} {close}"


def text_rule() -> str:
    """The rule ``TEXT`` that `function_rule`'s rules use (once in a grammar)."""
    return f"TEXT: /{_text_then_close()}/"


def _text_then_close() -> str:
    """A regular expression of a string value and the line that closes it: any text in which
    ``</parameter>`` does not occur, then ``\\n</parameter>\\n``. Split at each ``<``, the text is what comes
    before the first ``<`` and then pieces, each a ``<`` and text without one that does not start with
    ``/parameter>``."""
    tail = PARAMETER_CLOSE[1:]  # "/parameter>"

    def not_starting(word: str) -> str:
        first = re.escape(word[0])
        rest = f"|{first}{not_starting(word[1:])}" if len(word) > 1 else ""
        return f"(?:[^<{first}][^<]*{rest})?"

    piece = f"<{not_starting(tail)}"
    return f"[^<]*(?:{piece})*\\n</parameter>\\n".replace("/", "\\/")
