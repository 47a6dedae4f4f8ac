"""Anthropic's Messages API (``/v1/messages``): a body read as the chat it asks for, without a server, and
Anthropic's own SDK against the demo engine started by `strata launch` (CPU), whole and streamed, with tools,
stop sequences and the errors, each reply checked against what the OpenAI chat endpoint gives the same chat.
"""

from __future__ import annotations

import json
import secrets

import pytest
from srv_helpers import Launched, http

from strata_runtime.chat import ToolCall
from strata_runtime.server import anthropic as a
from strata_runtime.server.errors import ApiError

anthropic_sdk = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_a_messages_body_reads_as_the_chat_it_asks_for():
    """``system``, text blocks, a call and its result, a thinking block sent back, tools and their choice,
    stop sequences and thinking map onto the chat body the server serves."""
    body = a.to_chat(
        {
            "model": "m",
            "max_tokens": 9,
            "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "messages": [
                {"role": "user", "content": "Weather in Bath?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "look it up", "signature": "x"},
                        {"type": "text", "text": "Checking."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Bath"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "rain"}],
                        },
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "content": "boom",
                            "is_error": True,
                        },
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
            "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            "stop_sequences": ["\n\n"],
            "thinking": {"type": "disabled"},
            "temperature": 0.5,
            "metadata": {"user_id": "u"},
        }
    )
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Bath?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "look it up",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Bath"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": WEATHER["description"],
            },
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    held = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    (tool,) = a.to_chat({**held, "tools": [{**WEATHER, "strict": True}]})["tools"]
    assert tool["function"]["strict"] is True  # its calls held to the schema under "auto" too
    assert body["parallel_tool_calls"] is False and body["stop"] == ["\n\n"] and body["max_tokens"] == 9
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["temperature"] == 0.5
    assert a.to_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}, counting=True)[
        "messages"
    ]
    ask = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}
    budgeted = a.to_chat({**ask, "thinking": {"type": "enabled", "budget_tokens": 8}})
    assert budgeted["thinking_token_budget"] == 8
    assert budgeted["chat_template_kwargs"] == {"enable_thinking": True}
    adaptive = a.to_chat({**ask, "thinking": {"type": "adaptive"}})
    assert (
        adaptive["chat_template_kwargs"] == {"enable_thinking": True}
        and "thinking_token_budget" not in adaptive
    )


BAD = [
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}, "model"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 4, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    (
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        },
        "messages.0.content.0.type",
    ),
    (
        {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
        "messages.0.content.0.tool_use_id",
    ),
    (
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "f"}],
        },
        "tools.0.input_schema",
    ),
    (
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
        },
        "tools.0",
    ),
    (
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}],
            "tool_choice": {"type": "all"},
        },
        "tool_choice.type",
    ),
    (
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}],
            "stop_sequences": ["a"] * 5,
        },
        "stop_sequences",
    ),
    (
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}],
            "thinking": {"type": "on"},
        },
        "thinking.type",
    ),
    (
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}],
            "thinking": {"type": "enabled", "budget_tokens": 4},
        },
        "thinking.budget_tokens",
    ),
    (
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}],
            "thinking": {"type": "enabled", "budget_tokens": "2"},
        },
        "thinking.budget_tokens",
    ),
    (
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": 3}]}],
        },
        "messages.0.content.0.thinking",
    ),
]


@pytest.mark.parametrize(("raw", "param"), BAD)
def test_a_bad_messages_body_names_the_field(raw, param):
    with pytest.raises(ApiError) as info:
        a.to_chat(raw)
    assert (info.value.status, info.value.param) == (400, param)
    assert f"`{param}`" in info.value.message  # the message names the field too
    assert a.error_body(info.value)["error"]["type"] == "invalid_request_error"


def test_the_chat_paths_fields_are_named_as_the_messages_api_names_them():
    assert (
        a.field_of("stop") == "stop_sequences"
        and a.field_of("tools.2.function.parameters") == "tools.2.input_schema"
    )
    assert (
        a.field_of("tool_choice.function.name") == "tool_choice.name"
        and a.field_of("messages.3.content") == "messages"
    )
    assert a.field_of("temperature") == "temperature" and a.field_of(None) is None


def test_a_streams_blocks_open_and_close_as_the_kind_of_text_changes():
    blocks = a.BlockStream()
    events = blocks.text("thinking", "hm") + blocks.text("thinking", "m") + blocks.text("text", "Hi")
    events += blocks.call(ToolCall("now", "{}")) + blocks.text("text", "ok") + blocks.close() + blocks.close()
    kinds = [json.loads(e.decode().split("data: ", 1)[1])["type"] for e in events]
    assert kinds == [
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
    ]
    assert a.content_blocks(
        [("reasoning", "a"), ("reasoning", "b"), ("content", "c"), ("call", ToolCall("now", "{}"))]
    )[:2] == [
        {"type": "thinking", "thinking": "ab", "signature": ""},
        {"type": "text", "text": "c"},
    ]
    assert a.stop_reason("length", True, None) == ("max_tokens", None)
    assert a.stop_reason("stop", True, None) == ("tool_use", None)
    assert a.stop_reason("stop", False, "\n\n") == ("stop_sequence", "\n\n")
    assert a.stop_reason("stop", False, 258) == ("end_turn", None)


@pytest.fixture(scope="module")
def client(engine: Launched):
    return anthropic_sdk.Anthropic(base_url=engine.url, api_key=engine.key, max_retries=0, timeout=60)


def _prompt() -> str:
    return f"Tell me about Emma {secrets.token_hex(3)}."


def test_a_reply_whole_and_streamed_is_the_chat_endpoints_reply(engine: Launched, client):
    """Greedy: the Messages reply's text is what ``/v1/chat/completions`` gives the same system message and
    question; streamed through the SDK's helper, the same text and the same final message; the usage
    counts what was read and generated."""
    question = _prompt()
    ask = dict(
        model="demo", max_tokens=24, system="Be brief.", messages=[{"role": "user", "content": question}]
    )
    whole = client.messages.create(**ask, extra_body={"temperature": 0})
    assert whole.type == "message" and whole.role == "assistant" and whole.content[0].type == "text"
    assert whole.stop_reason in ("max_tokens", "end_turn") and whole.usage.output_tokens <= 24
    chat = openai.OpenAI(
        base_url=f"{engine.url}/v1", api_key=engine.key, max_retries=0
    ).chat.completions.create(
        model="demo",
        max_tokens=24,
        temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}],
    )
    assert whole.content[0].text == chat.choices[0].message.content
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    with client.messages.stream(**ask, extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The same prompt was read before: most of it comes from a slot's kept tokens, and is counted as such.
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_a_last_assistant_message_is_the_start_of_the_reply(engine: Launched, client):
    """A prefill: the reply goes on from the assistant's text, as the chat endpoint's
    ``continue_final_message`` does, and holds only what follows it."""
    messages = [{"role": "user", "content": _prompt()}, {"role": "assistant", "content": "Her name was"}]
    reply = client.messages.create(
        model="demo", max_tokens=16, messages=messages, extra_body={"temperature": 0}
    )
    chat = openai.OpenAI(
        base_url=f"{engine.url}/v1", api_key=engine.key, max_retries=0
    ).chat.completions.create(
        model="demo",
        max_tokens=16,
        temperature=0,
        messages=messages,
        extra_body={"continue_final_message": True},
    )
    assert reply.content[0].text == chat.choices[0].message.content
    counted = client.messages.count_tokens(model="demo", messages=messages)  # the prefill counted as read
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def test_a_stop_sequence_ends_the_reply_and_is_named(client):
    ask = dict(
        model="demo",
        max_tokens=40,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": _prompt()}],
    )
    free = client.messages.create(**ask).content[0].text
    stop = free[5:7]
    cut = client.messages.create(**ask, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == free[: free.index(stop)]


def test_a_required_tool_call_comes_back_as_a_tool_use_block_whole_and_streamed(engine: Launched, client):
    """``tool_choice`` a named tool without parallel calls: one ``tool_use`` block whose input follows the
    schema, ``stop_reason`` ``tool_use``; the SDK's stream gathers the same call. The call and its result
    then go back as blocks, and the prompt counted is the chat endpoint's for the same conversation."""
    question = "Weather? " + _prompt()
    ask = dict(
        model="demo",
        max_tokens=120,
        messages=[{"role": "user", "content": question}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    )
    for temperature in (0.0, 1.0):  # the SDK sends it through extra_body (newer SDKs do not take it)
        whole = client.messages.create(**ask, extra_body={"temperature": temperature})
        assert whole.stop_reason == "tool_use" and [b.type for b in whole.content] == ["tool_use"]
        (call,) = whole.content
        assert call.name == "get_weather" and set(call.input) == {"city"} and len(call.input["city"]) <= 8
        assert call.id.startswith("toolu_")
    with client.messages.stream(**ask, extra_body={"temperature": 0}) as stream:
        partial = [e.partial_json for e in stream if e.type == "input_json"]
        final = stream.get_final_message()
    greedy = client.messages.create(**ask, extra_body={"temperature": 0})
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in greedy.content]
    assert len(partial) > 1 and json.loads("".join(partial)) == greedy.content[0].input  # as it came
    assert final.stop_reason == "tool_use"
    history = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": [b.model_dump() for b in greedy.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": greedy.content[0].id, "content": "rain"}],
        },
    ]
    counted = client.messages.count_tokens(model="demo", messages=history, tools=[WEATHER])
    openai_history = [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": greedy.content[0].id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(greedy.content[0].input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": greedy.content[0].id, "content": "rain"},
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": WEATHER["name"],
                "description": WEATHER["description"],
                "parameters": WEATHER["input_schema"],
            },
        }
    ]
    status, body = http(
        "POST",
        f"{engine.url}/tokenize",
        json.dumps({"model": "demo", "messages": openai_history, "tools": tools}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {engine.key}"},
    )
    assert status == 200 and counted.input_tokens == json.loads(body)["count"]
    after = client.messages.create(
        model="demo", max_tokens=8, extra_body={"temperature": 0}, messages=history, tools=[WEATHER]
    )
    assert after.content and after.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_errors_come_in_anthropics_shape_naming_the_field(engine: Launched, client):
    with pytest.raises(anthropic_sdk.BadRequestError) as info:
        client.messages.create(
            model="demo",
            max_tokens=8,
            messages=[{"role": "user", "content": "x"}],
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "later"},
        )
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    message = info.value.body["error"]["message"]
    assert message.startswith("`tool_choice.name`: no tool is named `later`"), message
    with pytest.raises(anthropic_sdk.BadRequestError) as info:  # counting names the same fields
        client.messages.count_tokens(
            model="demo",
            messages=[{"role": "user", "content": "x"}],
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "later"},
        )
    assert info.value.body["error"]["message"].startswith("`tool_choice.name`: no tool is named `later`")
    with pytest.raises(anthropic_sdk.NotFoundError):
        client.messages.create(model="other", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic_sdk.AuthenticationError):
        anthropic_sdk.Anthropic(base_url=engine.url, api_key="wrong", max_retries=0).messages.create(
            model="demo", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    status, body = http(
        "POST",
        f"{engine.url}/v1/messages",
        json.dumps({"model": "demo", "messages": [{"role": "user", "content": "x"}]}).encode(),
        {"Content-Type": "application/json", "x-api-key": engine.key},
    )
    assert status == 400 and json.loads(body)["error"]["message"].startswith("`max_tokens` is required")
