"""Strict tools under ``tool_choice: "auto"``: the model decides whether to call, and once it opens a call
with its ``<tool_call>`` token the call is held to the tools' schemas (`strata_runtime.server.tools`).

The demo model's byte tokenizer spells the call tags in text, so these tests give the demo engine a byte
tokenizer that holds both tags as tokens of their own, as Qwen's vocabulary does; a logit bias makes the
demo open a call, which it would not do by itself.
"""

from __future__ import annotations

import json
from types import MappingProxyType

import pytest
from srv_helpers import serve_demo, streamed_reply

from strata_runtime.api import Reasoning
from strata_runtime.chat import CALL_CLOSE, CALL_OPEN, call_ids, call_text
from strata_runtime.server.errors import ApiError
from strata_runtime.server.tools import ToolUse, tool_use
from strata_runtime.structured import GrammarError, grammars_for, json_grammar, reasoning_grammar
from strata_runtime.weights.tokenizer import ByteTokenizer


class CallingBytes(ByteTokenizer):
    """The byte tokenizer with Qwen's call tags as tokens of their own."""

    SPECIALS = MappingProxyType({**ByteTokenizer.SPECIALS, CALL_OPEN: 261, CALL_CLOSE: 262})


class UnmarkedCallingBytes(CallingBytes):
    """`CallingBytes` that does not count the call tags among its special tokens, as Qwen's tokenizer does
    not (they are added tokens there, not special ones)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.special_ids = tuple(t for t in self.special_ids if t not in (261, 262))


class ThinkingCallingBytes(CallingBytes):
    """`CallingBytes` with Qwen3's think tags as tokens too."""

    SPECIALS = MappingProxyType({**CallingBytes.SPECIALS, "<think>": 259, "</think>": 260})


OPEN = CallingBytes.SPECIALS[CALL_OPEN]
ARGS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Bath", "York"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": ARGS, "strict": True}}
NOW = {"type": "function", "function": {"name": "now"}}


def _follows(grammar: str, text: str, tokenizer: type[CallingBytes] = CallingBytes) -> bool:
    """Whether ``text`` and then the end of the reply follow ``grammar`` over ``tokenizer``'s vocabulary."""
    tok = tokenizer(512)
    matcher = grammars_for(tok, 512).matcher(grammar)
    try:
        matcher.accept([*tok.encode(text), tok.eos_ids[1]])
    except GrammarError:
        return False
    return matcher.finished


def test_auto_holds_a_strict_tools_calls_from_the_models_call_token_on():
    """With a strict tool and a vocabulary that holds the call tags, ``"auto"`` allows any text, then calls:
    a strict tool's arguments must follow its schema, another tool's may be any object; nothing but calls
    follows the first call, and one call at most without ``parallel_tool_calls``. The tags are the model's
    tokens, never text: a reply that spells them in text stays text. Without a strict tool, or without
    the tags as tokens, ``"auto"`` holds nothing."""
    ids = call_ids(CallingBytes(512))
    assert ids == (261, 262) and call_ids(ByteTokenizer(512)) is None
    use = ToolUse((WEATHER, NOW), "auto", call_tokens=ids)
    assert use.held == [0] and use.grammar is not None
    good = call_text("get_weather", {"city": "Bath", "days": 2})
    assert _follows(use.grammar, "Let me check.")
    assert _follows(use.grammar, "Let me check.\n\n" + good)
    assert _follows(use.grammar, good + "\n" + call_text("now", {"any": [1, "x"]}))
    for tokenizer in (CallingBytes, UnmarkedCallingBytes):  # the tags are never text, marked or not
        assert not _follows(use.grammar, call_text("get_weather", {"city": "Rome", "days": 2}), tokenizer)
    assert not _follows(use.grammar, call_text("get_weather", {"city": "Bath", "days": 9}))
    assert not _follows(use.grammar, call_text("get_weather", {"city": "Bath"}))
    assert not _follows(use.grammar, good + "\nand then some text")
    one = ToolUse((WEATHER, NOW), "auto", parallel=False, call_tokens=ids)
    assert one.grammar is not None and not _follows(one.grammar, good + "\n" + good)
    assert ToolUse((NOW,), "auto", call_tokens=ids).grammar is None
    assert ToolUse((WEATHER,), "auto").grammar is None
    # A required call is written with the model's tokens too; without them, in text.
    required = ToolUse((WEATHER,), "required", call_tokens=ids)
    assert required.grammar is not None and f"<[{OPEN}]>" in json.dumps(required.grammar)
    assert f"<[{OPEN}]>" not in json.dumps(ToolUse((WEATHER,), "required").grammar)
    # `strict` tells the server how to hold calls: the model is not shown it.
    assert use.offered == [
        {"type": "function", "function": {"name": "get_weather", "parameters": ARGS}},
        NOW,
    ]
    # A model that reasons first: the think block, then the same reply.
    thinking = reasoning_grammar(use.grammar, Reasoning(259, 260, opened=False))
    for reply, follows in ((good, True), ("It is sunny.", True), (call_text("now", {}), True)):
        assert _follows(thinking, "<think>\nhm\n</think>\n\n" + reply, ThinkingCallingBytes) is follows
    bad = call_text("get_weather", {"city": "Rome", "days": 2})
    assert not _follows(thinking, "<think>\nhm\n</think>\n\n" + bad, ThinkingCallingBytes)
    # Beside a response format, the reply follows the format or is calls; without a strict tool, the
    # format alone holds it (the tools hold nothing).
    beside = tool_use({"tools": [WEATHER]}, json_grammar(ANSWER), ids)
    assert beside is not None and beside.grammar is not None and beside.held == [0]
    assert _follows(beside.grammar, '{"answer":"rain"}')
    assert _follows(beside.grammar, good)
    assert not _follows(beside.grammar, "It is sunny.")
    assert not _follows(beside.grammar, '{"answer":"rain"}' + good)
    assert not _follows(beside.grammar, call_text("get_weather", {"city": "Rome", "days": 2}))
    loose = tool_use({"tools": [NOW]}, json_grammar(ANSWER), ids)
    assert loose is not None and loose.grammar is None


def test_a_strict_tool_called_by_choice_gets_arguments_that_follow_its_schema():
    """The demo, biased to open a call with its ``<tool_call>`` token and with ``tool_choice`` left to
    ``"auto"``: with the tool strict the reply is one call whose arguments follow the schema, whole and
    streamed alike. Without ``strict`` nothing holds the call's text, and the demo (never trained on calls)
    writes another reply."""
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "The weather in Bath?"}],
        "max_tokens": 120,
        "temperature": 0,
        "parallel_tool_calls": False,
        "logit_bias": {str(OPEN): 100},
    }
    loose = {**WEATHER, "function": {**WEATHER["function"], "strict": False}}
    held, free = serve_demo(CallingBytes, [{**body, "tools": [WEATHER]}, {**body, "tools": [loose]}])
    whole, chunks = held
    choice = whole["choices"][0]
    _, content, calls, finish = streamed_reply(chunks)
    assert content == "" and finish == choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and args["city"] in ("Bath", "York")
    assert set(args) == {"city", "days"} and 1 <= args["days"] <= 7
    assert [c["function"] for c in calls] == [call["function"]]
    said = [
        c for chunk in chunks for choice in chunk["choices"] for c in choice["delta"].get("tool_calls") or []
    ]
    assert (
        len(said) > 2 and said[0]["id"] == calls[0]["id"]
    )  # the call begun, then its arguments as they came
    other = free[0]["choices"][0]["message"]
    assert (other["content"], other.get("tool_calls")) != (None, choice["message"]["tool_calls"])


def test_a_strict_tools_schema_or_a_format_beside_it_that_cannot_be_followed_is_a_400_naming_it():
    bad = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "nonsense"}}}
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": [NOW, bad]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    beside = {**body, "tools": [WEATHER], "response_format": fmt}
    (tool, form) = serve_demo(CallingBytes, [body, beside], status=400)
    assert tool[0]["error"]["param"] == "tools.1.function.parameters", tool
    assert "`tools.1.function.parameters` cannot be followed" in tool[0]["error"]["message"]
    assert form[0]["error"]["param"] == "response_format.json_schema.schema", form
    assert "`response_format.json_schema.schema` cannot be followed" in form[0]["error"]["message"]


def _allowed(mode: str, *names: str) -> dict:
    tools = [{"type": "function", "function": {"name": n}} for n in names]
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}


def test_allowed_tools_hold_the_reply_to_calls_of_the_tools_it_lists():
    """``tool_choice`` ``allowed_tools``: every tool stays in the prompt, and the reply may call only the
    listed ones: ``required``, one call or more of them; ``auto``, text, or calls of them from the call
    token on (a tool that is not strict taking any arguments)."""
    tools = {"tools": [WEATHER, NOW]}
    required = tool_use({**tools, "tool_choice": _allowed("required", "now")}, None, (261, 262))
    assert required is not None and required.grammar is not None and required.allowed == ("now",)
    assert [t["function"]["name"] for t in required.offered or []] == ["get_weather", "now"]
    assert _follows(required.grammar, call_text("now", {}))
    assert not _follows(required.grammar, call_text("get_weather", {"city": "Bath", "days": 2}))
    assert not _follows(required.grammar, "Hello.")
    auto = tool_use({**tools, "tool_choice": _allowed("auto", "get_weather")}, None, (261, 262))
    assert auto is not None and auto.grammar is not None and auto.held == [0]  # strict: held to its schema
    assert _follows(auto.grammar, "Hello.")
    assert _follows(auto.grammar, "Let me look. " + call_text("get_weather", {"city": "York", "days": 1}))
    assert not _follows(
        auto.grammar, "Let me look. " + call_text("get_weather", {"city": "Leeds", "days": 1})
    )
    assert not _follows(auto.grammar, "Let me look. " + call_text("now", {}))
    loose = tool_use({**tools, "tool_choice": _allowed("auto", "now")}, None, (261, 262))
    assert loose is not None and loose.grammar is not None and loose.held == []
    assert _follows(loose.grammar, call_text("now", {"any": ["thing"]}))
    assert tool_use({**tools, "tool_choice": _allowed("auto", "now")}, None).grammar is None  # no tokens


def test_allowed_tools_that_name_no_tool_or_no_mode_are_a_400_naming_the_part():
    tools = {"tools": [WEATHER, NOW]}
    bad = [
        (_allowed("auto", "later"), "tool_choice.allowed_tools.tools.0", "`now`"),
        (_allowed("sometimes", "now"), "tool_choice.allowed_tools.mode", '"required"'),
        (
            {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
            "tool_choice.allowed_tools.tools",
            "one or more",
        ),
    ]
    for choice, param, words in bad:
        with pytest.raises(ApiError) as info:
            tool_use({**tools, "tool_choice": choice}, None, (261, 262))
        assert info.value.param == param and words in info.value.message, choice


def test_the_served_demo_calls_only_an_allowed_tool_on_chat_and_on_the_responses_api():
    """Required of one allowed tool of two: the demo's reply calls it, on chat and on the Responses API
    (whose ``allowed_tools`` names tools as its own function tools do)."""
    chat = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Weather?"}],
        "max_tokens": 60,
        "temperature": 0,
        "tools": [WEATHER, NOW],
        "tool_choice": _allowed("required", "now"),
        "parallel_tool_calls": False,
    }
    ((whole, _),) = serve_demo(CallingBytes, [chat])
    (call,) = whole["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "now"
    responses = {
        "model": "demo",
        "input": "Weather?",
        "max_output_tokens": 60,
        "temperature": 0,
        "tools": [{"type": "function", **WEATHER["function"]}, {"type": "function", **NOW["function"]}],
        "tool_choice": {
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "function", "name": "now"}],
        },
        "parallel_tool_calls": False,
    }
    ((reply, _),) = serve_demo(CallingBytes, [responses], path="/v1/responses", streamed={"stream": False})
    assert [(i["type"], i.get("name")) for i in reply["output"]] == [("function_call", "now")]
