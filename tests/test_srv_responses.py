"""OpenAI's Responses API (``/v1/responses``): a body read as the chat it asks for, without a server; the
events of a streamed reply; and the openai SDK's ``responses`` against the demo engine started by `strata
launch` (CPU), whole and streamed, with a conversation carried on by ``previous_response_id``, tools and
the errors, each reply checked against what the chat endpoint gives the same chat."""

from __future__ import annotations

import json
import secrets

import pytest
from srv_helpers import Launched, http

from strata_runtime.chat import ToolCall
from strata_runtime.server import protocol as p
from strata_runtime.server import responses as r
from strata_runtime.server import responses_reply as reply
from strata_runtime.server import responses_store as rs
from strata_runtime.server.errors import ApiError

openai = pytest.importorskip("openai")

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_a_responses_body_reads_as_the_chat_it_asks_for():
    """``instructions``, message items of each role with text parts, a reasoning item, a call and its
    output, tools and their choice, the text format, the reasoning effort and the output limit map onto
    the chat body the server serves; the conversation before the reply leaves the instructions out."""
    asked = r.to_chat(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "Weather in Bath?"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "look"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Checking."}],
                },
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city": "Bath"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
                {
                    "role": "developer",
                    "content": [
                        {"type": "input_text", "text": "Then "},
                        {"type": "input_text", "text": "answer."},
                    ],
                },
            ],
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
            "text": {
                "format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}
            },
            "reasoning": {"effort": "minimal"},
            "max_output_tokens": 9,
            "temperature": 0.5,
            "metadata": {"user": "u"},
        },
        rs.Store(),
    )
    chat = asked.chat
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert asked.history == chat["messages"][1:]
    assert asked.history == [
        {"role": "user", "content": "Weather in Bath?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "look",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Bath"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "developer", "content": "Then answer."},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": WEATHER["description"],
                "parameters": WEATHER["parameters"],
                "strict": True,  # the Responses API's default
            },
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True},
    }
    assert chat["reasoning_effort"] == "minimal"
    assert p.template_kwargs(p.parse_chat(chat)) == {"reasoning_effort": "minimal", "enable_thinking": False}
    assert chat["max_tokens"] == 9 and chat["temperature"] == 0.5 and chat["parallel_tool_calls"] is False
    assert (
        asked.store and asked.echo["instructions"] == "Be brief." and asked.echo["metadata"] == {"user": "u"}
    )
    budgeted = r.to_chat({"model": "m", "input": "hi", "thinking_token_budget": 64}, rs.Store())
    assert p.parse_chat(budgeted.chat).thinking_token_budget == 64
    plain = r.to_chat({"model": "m", "input": "hi", "store": False}, rs.Store())
    assert plain.chat["messages"] == [{"role": "user", "content": "hi"}] and not plain.store


def test_a_previous_response_goes_on_from_its_conversation_without_its_instructions():
    store = rs.Store(most=2)
    store.put(
        "resp_a", rs.Kept([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}], {})
    )
    asked = r.to_chat(
        {"model": "m", "instructions": "Now in French.", "previous_response_id": "resp_a", "input": "more"},
        store,
    )
    assert [m["content"] for m in asked.chat["messages"]] == ["Now in French.", "hi", "Hello", "more"]
    store.put("resp_b", rs.Kept([], {}))
    store.get("resp_a")  # used: kept over resp_b
    store.put("resp_c", rs.Kept([], {}))
    assert store.get("resp_b") is None and store.get("resp_a") is not None
    with pytest.raises(ApiError) as info:
        r.to_chat({"model": "m", "previous_response_id": "resp_b", "input": "x"}, store)
    assert (info.value.status, info.value.param) == (404, "previous_response_id")


BAD = [
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    (
        {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input.0.content.0.type",
    ),
    ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"model": "m", "input": [{"type": "function_call", "name": "f"}]}, "input.0"),
    ({"model": "m", "input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"model": "m", "input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"model": "m", "input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "x", "instructions": 3}, "instructions"),
    ({"model": "m", "input": "x", "background": 1}, "background"),
    ({"model": "m", "input": "x", "background": True, "store": False}, "store"),
    ({"model": "m", "input": "x", "conversation": "conv_1"}, "conversation"),
    ({"model": "m", "input": "x", "store": "yes"}, "store"),
    ({"model": "m", "input": "x", "include": "message.output_text.logprobs"}, "include"),
]


@pytest.mark.parametrize(("raw", "param"), BAD)
def test_a_bad_responses_body_names_the_field(raw, param):
    with pytest.raises(ApiError) as info:
        r.to_chat(raw, rs.Store())
    assert (info.value.status, info.value.param) == (400, param)
    assert f"`{param}`" in info.value.message  # the message names the field too


def test_the_chat_paths_fields_are_named_as_the_responses_api_names_them():
    assert r.field_of("max_tokens") == "max_output_tokens" and r.field_of("response_format") == "text.format"
    assert r.field_of("tools.2.function.parameters") == "tools.2.parameters"
    assert r.field_of("tool_choice.function.name") == "tool_choice.name"
    assert r.field_of("messages.3.tool_calls.0.function.arguments") == "input"
    exc = ApiError(400, "`max_tokens` is 9, too many", "max_tokens").renamed(r.field_of)
    assert exc.param == "max_output_tokens" and exc.message.startswith("`max_output_tokens` is 9")


def _events(chunks: list[bytes]) -> list[dict]:
    out = []
    for chunk in chunks:
        kind, data = chunk.decode().strip().split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {body['type']}"
        out.append(body)
    return out


def test_a_streams_items_open_and_close_as_the_kind_of_text_changes():
    """Reasoning, then text in two deltas, then a call: three items, each opened, filled and closed, the
    events numbered from 0; the items closed are the whole reply's output items."""
    s = reply.EventStream()
    call = ToolCall("now", "{}")
    chunks = (
        s.text("reasoning", "hm") + s.text("content", "It is ") + s.text("content", "late.") + s.call(call)
    )
    events = _events(chunks + s.close())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert events[10]["text"] == "It is late."
    whole = reply.output_items(
        [("reasoning", "hm"), ("content", "It is "), ("content", "late."), ("call", call)]
    )
    assert [(i["type"], i.get("content"), i.get("arguments")) for i in whole] == [
        (i["type"], i.get("content"), i.get("arguments")) for i in s.items
    ]
    assert whole[2]["call_id"] == call.id and whole[1]["content"][0]["text"] == "It is late."


# ---- the SDK against the demo engine ---------------------------------------------------------------------


def _prompt() -> str:
    return f"Tell me about Emma {secrets.token_hex(3)}."


def test_a_reply_whole_and_streamed_is_the_chat_endpoints_reply(client):
    """Greedy: the reply's text is what ``/v1/chat/completions`` gives the same instructions and question;
    streamed through the SDK, its events numbered in order, the same text and the same final response; a
    reply cut by ``max_output_tokens`` is ``incomplete`` and says why."""
    question = _prompt()
    ask = dict(model="demo", max_output_tokens=24, temperature=0, instructions="Be brief.", input=question)
    whole = client.responses.create(**ask)
    chat = client.chat.completions.create(
        model="demo",
        max_tokens=24,
        temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}],
    )
    assert whole.output_text == chat.choices[0].message.content
    assert [item.type for item in whole.output] == ["message"] and whole.id.startswith("resp_")
    assert whole.usage.input_tokens == chat.usage.prompt_tokens and whole.usage.output_tokens <= 24
    if chat.choices[0].finish_reason == "length":
        assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    else:
        assert whole.status == "completed"
    numbers, deltas, final = [], [], None
    with client.responses.stream(**ask) as stream:
        for event in stream:
            numbers.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):  # the last event, either way
                final = event.response
    assert final is not None
    assert numbers == list(range(len(numbers))) and "".join(deltas) == whole.output_text
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt, read before


def test_the_output_texts_log_probabilities_are_the_chat_endpoints_whole_and_streamed(client):
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: the message's text carries its
    tokens' log-probabilities, as ``/v1/chat/completions`` gives them for the same greedy reply; streamed,
    each text delta carries those of its tokens, and together they are the whole reply's. Without
    ``include`` the text carries none."""
    question = _prompt()
    ask = dict(model="demo", max_output_tokens=16, temperature=0, input=question)
    wanted = dict(include=["message.output_text.logprobs"], top_logprobs=2)
    whole = client.responses.create(**ask, **wanted)
    chat = client.chat.completions.create(
        model="demo",
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        messages=[{"role": "user", "content": question}],
    )
    (item,) = whole.output
    (text,) = item.content
    got = [lp.model_dump() for lp in text.logprobs]
    want = [lp.model_dump() for lp in chat.choices[0].logprobs.content]
    assert got and [g["token"] for g in got] == [w["token"] for w in want]
    for g, w in zip(got, want, strict=True):
        assert g["logprob"] == pytest.approx(w["logprob"]) and len(g["top_logprobs"]) == 2
    assert bytes(b for g in got for b in g["bytes"]).decode().strip() == text.text.strip()
    streamed, done = [], None
    with client.responses.stream(**ask, **wanted) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                streamed += [lp.model_dump() for lp in event.logprobs]
            if event.type == "response.output_text.done":
                done = [lp.model_dump() for lp in event.logprobs]
    assert [g["token"] for g in streamed] == [g["token"] for g in got] and done == streamed
    plain = client.responses.create(**ask)
    assert plain.output[0].content[0].logprobs == []
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**ask, include="message.output_text.logprobs")
    assert info.value.body["param"] == "include"
    assert "`include` must be a list of strings" in info.value.body["message"]


def test_a_conversation_goes_on_from_a_stored_reply(engine: Launched, client):
    """``previous_response_id``: the second turn is the chat endpoint's reply to the whole conversation, and
    reuses the first turn's kept tokens; a stored reply is given back by ``GET`` until a ``DELETE`` lets
    it go, one made with ``store: false`` is not, and an unknown one is a 404 naming the field."""
    question = _prompt()
    first = client.responses.create(model="demo", max_output_tokens=12, temperature=0, input=question)
    second = client.responses.create(
        model="demo", max_output_tokens=12, temperature=0, input="And then?", previous_response_id=first.id
    )
    chat = client.chat.completions.create(
        model="demo",
        max_tokens=12,
        temperature=0,
        messages=[
            {"role": "user", "content": question},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
    )
    assert second.output_text == chat.choices[0].message.content and second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens  # the same conversation, token for token
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)  # let go: neither given back nor continued from
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    unkept = client.responses.create(model="demo", max_output_tokens=4, input=question, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="demo", input="x", previous_response_id=unkept.id)
    assert info.value.body["param"] == "previous_response_id"


def test_a_required_call_comes_back_as_a_function_call_item_whole_and_streamed(engine: Launched, client):
    """A named function without parallel calls: one ``function_call`` item whose arguments follow the
    schema, whole and streamed alike; the call and its output then go back as items, read as the chat
    endpoint reads the same conversation."""
    question = "Weather? " + _prompt()
    ask = dict(
        model="demo",
        max_output_tokens=120,
        temperature=0,
        input=question,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
    )
    whole = client.responses.create(**ask)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    args = json.loads(call.arguments)
    assert set(args) == {"city"} and len(args["city"]) <= 8 and call.call_id.startswith("call_")
    with client.responses.stream(**ask) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    assert [(i.name, i.arguments) for i in final.output] == [(call.name, call.arguments)]
    assert len(deltas) > 1 and "".join(deltas) == call.arguments  # the arguments as they came
    follow = dict(model="demo", max_output_tokens=8, temperature=0, tools=[WEATHER])
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}
    made = {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}
    after = client.responses.create(**follow, input=[{"role": "user", "content": question}, made, answer])
    # An agent's loop sends the reply's own output items back, with the call's output after them.
    own = [item.model_dump(exclude_none=True) for item in whole.output]
    again = client.responses.create(**follow, input=[{"role": "user", "content": question}, *own, answer])
    assert again.usage.input_tokens == after.usage.input_tokens and again.output_text == after.output_text
    tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    history = [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "rain"},
    ]
    status, body = http(
        "POST",
        f"{engine.url}/tokenize",
        json.dumps({"model": "demo", "messages": history, "tools": tools}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {engine.key}"},
    )
    assert status == 200 and after.usage.input_tokens == json.loads(body)["count"]


def test_errors_name_the_responses_api_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(
            model="demo", input="x", tools=[WEATHER], tool_choice={"type": "function", "name": "later"}
        )
    assert info.value.body["param"] == "tool_choice.name"
    assert info.value.body["message"].startswith("`tool_choice.name`"), info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="demo", input="x", max_output_tokens=10**9)
    assert info.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(
            model="demo", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
        )
    assert info.value.body["param"] == "input.0.content.0.type"


def test_the_priority_extension_reaches_the_chat_body_from_the_responses_and_messages_apis():
    from strata_runtime.server import anthropic

    asked = r.to_chat({"model": "m", "input": "hi", "priority": -2}, rs.Store())
    assert asked.chat["priority"] == -2
    raw = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "priority": 5}
    assert anthropic.to_chat(raw)["priority"] == 5
