"""Tool calls in the XML layout of Qwen3-Coder's checkpoints (strata_runtime/xml_calls.py): a call block read
into a call with its values typed by the tool's schema; a reply read whole and as it streams in arbitrary
pieces; earlier calls given to the checkpoint's own template (its published one, in tests/templates) so it
writes them as the model writes them; calls held to their schemas by a grammar; and the demo served in
process with such a tokenizer, its required call in this layout read back as OpenAI's ``tool_calls``."""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from srv_helpers import serve_demo, streamed_reply
from test_rt_tool_calls import _TextTokenizer
from test_srv_strict_tools import ARGS, NOW, WEATHER, CallingBytes, _follows

from strata_runtime.chat import (
    CALL_CLOSE,
    CALL_OPEN,
    HERMES,
    CallArguments,
    CallSplitter,
    CallStart,
    ToolCall,
    split_reply,
)
from strata_runtime.server.errors import ApiError
from strata_runtime.server.tools import tool_use
from strata_runtime.xml_calls import call_format, call_layout, layout_of, read_call

CODER_TEMPLATE = (Path(__file__).parent / "templates" / "qwen3_coder.jinja").read_text()
"""The chat template published with Qwen3-Coder's checkpoints."""
QWEN3_TEMPLATE = (Path(__file__).parent / "templates" / "qwen3.jinja").read_text()

SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer"},
                "score": {"type": "number"},
                "exact": {"type": "boolean"},
                "filters": {"type": "object"},
                "tags": {"type": "array"},
                "after": {"type": ["string", "null"]},
                "mode": {"enum": [1, 2]},
                "code": {"type": "str"},
            },
        },
    },
}


def _block(name: str, params: list[tuple[str, str]]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"{CALL_OPEN}\n<function={name}>\n{body}</function>\n{CALL_CLOSE}"


def _inner(block: str) -> str:
    return block[len(CALL_OPEN) : -len(CALL_CLOSE)]


def test_a_call_blocks_values_are_typed_by_the_tools_schema():
    """Each value as the schema's type says (an object also as the Python literal Qwen3-Coder's template
    writes for one); a value that does not parse as its type, an unknown parameter and a string stay text;
    a block of another layout, or with text between the tags, is not a call."""
    params = [
        ("query", "  a <b>bold</b> query\nover two lines "),
        ("limit", "5"),
        ("score", "0.5"),
        ("exact", "True"),
        ("filters", "{'lang': 'en', 'n': [1, 2]}"),
        ("tags", '["a", "b"]'),
        ("after", "null"),
        ("mode", "2"),
        ("code", "007"),
        ("extra", "12"),
    ]
    call = read_call(_inner(_block("search", params)), [SEARCH])
    assert call is not None and call.name == "search"
    assert json.loads(call.arguments) == {
        "query": "  a <b>bold</b> query\nover two lines ",
        "limit": 5,
        "score": 0.5,
        "exact": True,
        "filters": {"lang": "en", "n": [1, 2]},
        "tags": ["a", "b"],
        "after": None,
        "mode": 2,
        "code": "007",
        "extra": "12",
    }
    odd = read_call(_inner(_block("search", [("limit", "five"), ("exact", "maybe")])), [SEARCH])
    assert odd is not None and json.loads(odd.arguments) == {"limit": "five", "exact": "maybe"}
    assert read_call('{"name": "search", "arguments": {}}', [SEARCH]) is None
    assert read_call("<function=search>\nhi\n<parameter=a>\nb\n</parameter>\n</function>", [SEARCH]) is None
    empty = read_call("<function=now>\n</function>")
    assert empty is not None and (empty.name, empty.arguments) == ("now", "{}")


def test_a_reply_in_this_layout_splits_the_same_whole_and_in_any_pieces():
    """Text, then calls: the splitter reading this layout finds the same calls and text whether the reply
    comes whole or in seeded random pieces; in pieces, with ``progress``, each call is said as it begins
    and its arguments as they come, and they join into the call's arguments (a string's text, line breaks
    and a tail that looks like the closing tag included); Hermes' splitter finds no calls in it."""
    g = np.random.default_rng(7)
    form = call_format([SEARCH, WEATHER])
    for _ in range(20):
        query = f'q{int(g.integers(0, 99))} </para\n<b>x</b> \\ "quoted"\n'
        calls = [
            ("search", [("query", query), ("limit", str(int(g.integers(1, 9)))), ("exact", "false")]),
            ("get_weather", [("city", "Bath"), ("days", "3")]),
        ][: int(g.integers(1, 3))]
        text = "Let me look.\n" + "\n".join(_block(n, p) for n, p in calls) + "\n"
        words, whole = split_reply(text, form)
        assert words == "Let me look." and [c.name for c in whole] == [n for n, _ in calls]
        assert json.loads(whole[0].arguments)["query"] == query  # its closing line break is the layout's
        splitter, fed, at = CallSplitter(form, progress=True), [], 0
        while at < len(text):
            n = int(g.integers(1, 9))
            fed += splitter.feed(text[at : at + n])
            at += n
        fed += splitter.close()
        got = [(c.name, c.arguments) for c in fed if isinstance(c, ToolCall)]
        assert got == [(c.name, c.arguments) for c in whole]
        assert "".join(c for c in fed if isinstance(c, str)) == words
        said, starts = [], [c for c in fed if isinstance(c, CallStart)]
        for part in fed:
            if isinstance(part, CallStart):
                said.append("")
            elif isinstance(part, CallArguments):
                said[-1] += part.text
        assert said == [c.arguments for c in whole] and [s.name for s in starts] == [c.name for c in whole]
        assert [s.id for s in starts] == [c.id for c in fed if isinstance(c, ToolCall)]
        assert sum(isinstance(c, CallArguments) for c in fed) > len(whole)  # more than one stretch each
        assert split_reply(text)[1] == []


def test_the_checkpoints_template_writes_earlier_calls_as_the_model_writes_them():
    """Qwen3-Coder's published template is read as this layout, Qwen3's as Hermes; a conversation whose
    assistant called a tool (arguments as JSON text, as OpenAI sends them) renders through the checkpoint's
    own template, and the call it writes reads back as the same call."""
    coder, qwen3 = _TextTokenizer(CODER_TEMPLATE), _TextTokenizer(QWEN3_TEMPLATE)
    assert layout_of(CODER_TEMPLATE) == call_layout(coder) == "xml"
    assert layout_of(QWEN3_TEMPLATE) == call_layout(qwen3) == "hermes" == call_layout(CallingBytes(512))
    arguments = {"query": "two\nlines", "limit": 5, "exact": False}
    conversation = [
        {"role": "user", "content": "Find it."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "search", "arguments": json.dumps(arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "found"},
    ]
    text = bytes(coder.apply_chat_template(conversation, [SEARCH])).decode()
    start = text.index(CALL_OPEN, text.index("<|im_start|>assistant"))
    block = text[start : text.index(CALL_CLOSE, start) + len(CALL_CLOSE)]
    assert "<parameter=limit>\n5\n</parameter>" in block
    call = read_call(_inner(block), [SEARCH])
    assert call is not None and json.loads(call.arguments) == arguments
    assert text.endswith("<tool_response>\nfound\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n")


def _xml_use(tools: list[dict], choice: object = "required"):
    return tool_use({"tools": tools, "tool_choice": choice}, None, (261, 262), "xml")


def test_held_calls_follow_each_tools_schema_in_this_layout():
    """A required call: the tool's properties in their order, those it requires present, an ``enum``'s
    strings and JSON values that follow their schemas, any text without ``</parameter>`` for a string;
    under ``"auto"``, free text before the calls and a tool that is not strict taking any parameters."""
    note = {
        "type": "function",
        "function": {
            "name": "note",
            "parameters": {
                "type": "object",
                "properties": {
                    "text": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["text"],
            },
        },
    }
    grammar = _xml_use([WEATHER, NOW, note]).grammar
    assert grammar is not None

    block = _block
    good = [
        block("get_weather", [("city", "Bath"), ("days", "3")]),
        block("now", []),
        block("note", [("text", "a <b>tag</b>, </para and </parameter \nsecond line")]),
        block("note", [("text", "hi"), ("tags", '["a", "b"]')]),
        block("now", []) + "\n" + block("get_weather", [("city", "York"), ("days", "7")]),
    ]
    bad = [
        block("get_weather", [("city", "Leeds"), ("days", "3")]),
        block("get_weather", [("city", "Bath"), ("days", "9")]),
        block("get_weather", [("days", "3"), ("city", "Bath")]),
        block("note", [("text", "hi </parameter> there")]),
        block("note", []),
        block("note", [("text", "hi"), ("tags", "a, b")]),
        "Sure. " + block("now", []),
    ]
    for text in good:
        assert _follows(grammar, text), text
    for text in bad:
        assert not _follows(grammar, text), text
    strict = {**note, "function": {**note["function"], "strict": True}}
    auto = _xml_use([WEATHER, strict, {**NOW, "function": {**NOW["function"], "parameters": ARGS}}], "auto")
    assert auto.grammar is not None
    assert _follows(auto.grammar, "Let me see. " + block("now", [("anything", "goes")]))
    assert not _follows(auto.grammar, "Let me see. " + block("note", [("tags", "[]")]))
    maybe = {"type": "object", "properties": {"after": {"type": ["string", "null"]}}, "required": ["after"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": maybe}}
    held = _xml_use([tool]).grammar
    assert held is not None
    for raw, value in (("Bath", "Bath"), ("null", None)):  # raw text, as a string is written
        text = block("f", [("after", raw)])
        assert _follows(held, text) and json.loads(
            split_reply(text, call_format([tool]))[1][0].arguments
        ) == {"after": value}


def test_a_strings_constraint_this_layout_cannot_hold_is_a_400_naming_the_tool():
    pattern = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]+$"}}},
        },
    }
    with pytest.raises(ApiError) as info:
        _xml_use([NOW, pattern])
    assert info.value.param == "tools.1.function.parameters" and "`pattern`" in info.value.message
    assert _xml_use([NOW, pattern], "auto").grammar is None  # not strict, not held: nothing to refuse
    assert tool_use({"tools": [NOW, pattern], "tool_choice": "required"}, None, (261, 262)) is not None


class CoderBytes(CallingBytes):
    """`CallingBytes` whose template (as a checkpoint's would be read) writes calls in the XML layout."""

    SPECIALS = MappingProxyType(dict(CallingBytes.SPECIALS))
    template = CODER_TEMPLATE
    template_knows_tools = True


def test_the_served_demo_with_this_layout_makes_a_required_call_read_back_as_tool_calls():
    """The demo engine served with a tokenizer whose template writes XML calls: a call required of the
    weather tool (one call at most) comes back, whole and streamed, as one OpenAI ``tool_calls`` entry whose
    JSON arguments follow the schema (the integer typed as one), and the reply ends with it."""
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Weather?"}],
        "max_tokens": 200,
        "temperature": 0,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    ((whole, chunks),) = serve_demo(CoderBytes, [body])
    choice = whole["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and args["city"] in ("Bath", "York")
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 7
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    _, content, calls, finish = streamed_reply(chunks)
    assert content == "" and finish == "tool_calls" and [c["function"] for c in calls] == [call["function"]]
    said = [
        c for chunk in chunks for choice in chunk["choices"] for c in choice["delta"].get("tool_calls") or []
    ]
    assert len(said) > 2 and said[0]["function"]["name"] == "get_weather"  # begun, then as it came


PIECES = [
    CALL_OPEN,
    CALL_CLOSE,
    "<function=search>",
    "<function=get_weather>",
    "</function>",
    "<parameter=query>",
    "<parameter=limit>",
    "<parameter=city>",
    "</parameter>",
    "<parameter=",
    "</para",
    '{"name": "now", "arguments": {',
    '"x": [1, "}"]',
    "\n",
    " ",
    "a",
    "<",
    "/",
    ">",
    "5",
    "{",
    "}",
    '"',
    "\\",
    "true",
    "null",
    "中",
]
"""Stretches of text a reply is made of in `test_any_reply_in_any_pieces_splits_as_it_does_whole`: calls
of both layouts, their tags cut short, and the characters their readers must follow."""


VALUES = st.text(alphabet='ab <>/\n"\\{}5中', max_size=10)
"""A parameter's or an argument's value, with the characters the readers must follow."""
XML_CALLS = st.builds(
    lambda name, params: (
        f"{CALL_OPEN}\n<function={name}>\n"
        + "".join(f"<parameter={k}>{a}{v}{b}</parameter>\n" for k, v, a, b in params)
        + f"</function>\n{CALL_CLOSE}"
    ),
    st.sampled_from(["search", "get_weather"]),
    st.lists(
        st.tuples(
            st.sampled_from(["query", "limit", "city", "days"]),
            VALUES,
            st.sampled_from(["\n", ""]),
            st.sampled_from(["\n", ""]),
        ),
        max_size=3,
    ),
)
HERMES_CALLS = st.builds(
    lambda name, value: (
        f'{CALL_OPEN}\n{{"name": "{name}", "arguments": {{"x": {json.dumps(value)}}}}}\n{CALL_CLOSE}'
    ),
    st.sampled_from(["now", "get_weather"]),
    VALUES,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.one_of(st.sampled_from(PIECES), XML_CALLS, HERMES_CALLS), max_size=12),
    st.integers(0, 2**32 - 1),
    st.sampled_from(["hermes", "xml"]),
)
def test_any_reply_in_any_pieces_splits_as_it_does_whole(pieces, seed, layout):
    """Whatever the reply and however it arrives, the splitter says the text and the calls that the whole
    reply holds; each call begun as it came has, as its arguments, what its stretches joined; and in the XML
    layout every call's arguments are a JSON object, however the model broke its tags."""
    text = "".join(pieces)
    form = call_format([SEARCH, WEATHER]) if layout == "xml" else HERMES
    splitter, fed, at, g = CallSplitter(form, progress=True), [], 0, np.random.default_rng(seed)
    while at < len(text):  # in pieces of 1 to 6 characters
        n = int(g.integers(1, 7))
        fed += splitter.feed(text[at : at + n])
        at += n
    fed += splitter.close()
    words, calls = split_reply(text, form)
    assert ("".join(x for x in fed if isinstance(x, str)) or None) == words
    got = [x for x in fed if isinstance(x, ToolCall)]
    assert [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in calls]
    said: dict[str, str] = {}
    for part in fed:
        if isinstance(part, CallStart):
            said[part.id] = ""
            last = part.id
        elif isinstance(part, CallArguments):
            said[last] += part.text
    assert all(said[c.id] == c.arguments for c in got if c.id in said)
    if layout == "xml":
        assert all(isinstance(json.loads(c.arguments), dict) for c in got if c.id in said)
