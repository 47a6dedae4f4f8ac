"""The real `openai` client against the demo engine started by `strata launch profiles/demo.toml` (CPU).

One engine serves the whole module (with an API key, so every test also proves the key works); the last two
tests kill its engine process (the launcher must restart it) and then stop the launcher (everything must
exit cleanly). Tests run in file order.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import threading
import time
from typing import Any

import openai
import pytest
from srv_helpers import Launched, alive, get_json, http, strata, wait_for


def _prompt() -> str:
    return f"Once upon a time {secrets.token_hex(4)}"


def _full_length_prompt(client: openai.OpenAI, max_tokens: int) -> tuple[str, str]:
    """A fresh prompt whose greedy reply runs all ``max_tokens`` (a reply may end early at the demo model's
    end-of-text token, which it learned to write after a novel's last line), and that reply."""
    for _ in range(50):
        prompt = _prompt()
        r = client.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens, temperature=0)
        if r.choices[0].finish_reason == "length":
            assert r.usage.completion_tokens == max_tokens
            return prompt, r.choices[0].text
    raise AssertionError("no prompt ran to max_tokens in 50 tries")


def _served(r: openai.types.Completion, max_tokens: int) -> None:
    """A whole reply: it ended at max_tokens, or earlier at the model's end-of-text token."""
    finish = r.choices[0].finish_reason
    assert finish in ("length", "stop")
    assert (r.usage.completion_tokens == max_tokens) == (finish == "length")
    assert r.usage.completion_tokens <= max_tokens


def _metrics(engine: Launched) -> dict[str, float]:
    status, body = http("GET", f"{engine.url}/metrics", headers={"Authorization": f"Bearer {engine.key}"})
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _busy_slots(engine: Launched) -> int:
    slots = get_json(f"{engine.url}/v1/status", engine.key)["engine"]["slots"]
    return sum(1 for s in slots if s["state"] != "free")


def test_completion_chat_and_streaming(client: openai.OpenAI):
    prompt, text = _full_length_prompt(client, 24)
    whole = client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0)
    assert whole.choices[0].text == text  # greedy is deterministic
    assert whole.usage.prompt_tokens == len(prompt.encode())  # the demo model's tokenizer is byte-level

    chunks = list(
        client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == text  # greedy: streaming changes nothing
    assert chunks[-1].choices[0].finish_reason == "length"

    # A stop string taken from the greedy text ends the reply just before it.
    cut = len(text) // 2
    stop = text[cut : cut + 2]
    stopped = client.completions.create(
        model="demo", prompt=prompt, max_tokens=24, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    messages = [{"role": "user", "content": _prompt()}]
    chat = client.chat.completions.create(model="demo", messages=messages, max_tokens=16, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage.prompt_tokens > 0 and chat.usage.completion_tokens <= 16
    stream = client.chat.completions.create(
        model="demo",
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = list(stream)
    assert (
        "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        == chat.choices[0].message.content
    )
    use = parts[-1].usage
    assert (use.prompt_tokens, use.completion_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    # The same prompt again: the slot kept it (memory.prefix_reuse), so only its last token was read.
    assert use.prompt_tokens_details.cached_tokens == use.prompt_tokens - 1


def test_replies_follow_a_json_schema_or_any_json_object_through_the_openai_client(client: openai.OpenAI):
    """``response_format`` through the openai client: its ``parse`` helper sends a pydantic model's schema
    (strict) and reads the reply back into the model; ``json_object`` gives any JSON object, streamed or
    whole, the same greedy text; every reply ends with ``stop`` when its JSON is complete."""
    import pydantic

    class Book(pydantic.BaseModel):
        title: str = pydantic.Field(max_length=12)
        year: int = pydantic.Field(ge=1700, le=1900)
        kept: bool

    messages = [{"role": "user", "content": "Name a novel as JSON. " + _prompt()}]
    parsed = client.chat.completions.parse(
        model="demo", messages=messages, response_format=Book, max_tokens=120, temperature=0
    )
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Book)
    assert len(choice.message.parsed.title) <= 12 and 1700 <= choice.message.parsed.year <= 1900
    for temperature in (0.0, 1.0):  # sampled replies stay inside the grammar too
        ask = dict(model="demo", messages=messages, max_tokens=300, temperature=temperature, seed=5)
        whole = client.chat.completions.create(**ask, response_format={"type": "json_object"})
        streamed = client.chat.completions.create(**ask, response_format={"type": "json_object"}, stream=True)
        text = "".join(p.choices[0].delta.content or "" for p in streamed if p.choices)
        assert text == whole.choices[0].message.content
        if whole.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # cut by max_tokens: the start of a JSON object
            assert whole.choices[0].finish_reason == "length" and text.startswith("{")


def test_every_choice_of_a_request_with_a_schema_follows_it(client: openai.OpenAI):
    """``n`` choices of one request with a schema, sampled: each is a request of its own with its own place
    in the grammar, and each reply follows the schema."""
    schema = {
        "type": "object",
        "properties": {
            "mood": {"enum": ["calm", "cross", "merry"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["mood", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "mood", "schema": schema}}
    reply = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "How is she? " + _prompt()}],
        response_format=fmt,
        n=3,
        temperature=1.0,
        seed=11,
        max_tokens=60,
    )
    assert len(reply.choices) == 3
    for choice in reply.choices:
        value = json.loads(choice.message.content)
        assert (
            value["mood"] in ("calm", "cross", "merry") and value["n"] <= 9 and choice.finish_reason == "stop"
        )


def test_structured_outputs_hold_replies_to_a_choice_a_regex_or_a_grammar(client: openai.OpenAI):
    """vLLM's ``structured_outputs`` through the openai client's ``extra_body``: a choice gives exactly one
    of the choices, a regular expression a reply that matches it whole, a Lark grammar a sentence of it,
    greedy and sampled, on chat and completions; a pattern that does not compile is a 400 naming it."""
    import re

    messages = [{"role": "user", "content": "Is it fine? " + _prompt()}]
    cases = [
        ({"choice": ["yes", "no", "perhaps not"]}, lambda t: t in ("yes", "no", "perhaps not")),
        ({"regex": r"[A-Z][a-z]{2,5} [0-9]{1,3}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{1,3}", t)),
        (
            {"grammar": 'start: "Mr. " NAME\nNAME: /[A-Z][a-z]{1,8}/'},
            lambda t: re.fullmatch(r"Mr\. [A-Z][a-z]{1,8}", t),
        ),
        (  # the same in GBNF, as llama.cpp and vLLM take grammars
            {"grammar": 'root ::= "Mr. " [A-Z] [a-z]{1,8}'},
            lambda t: re.fullmatch(r"Mr\. [A-Z][a-z]{1,8}", t),
        ),
    ]
    for asked, follows in cases:
        for temperature in (0.0, 1.0):
            ask = dict(
                model="demo",
                max_tokens=40,
                temperature=temperature,
                seed=3,
                extra_body={"structured_outputs": asked},
            )
            chat = client.chat.completions.create(messages=messages, **ask)
            text = client.completions.create(prompt="It is ", **ask).choices[0].text
            for reply in (chat.choices[0].message.content, text):
                assert follows(reply), (asked, reply)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="demo", messages=messages, extra_body={"structured_outputs": {"regex": "(unclosed"}}
        )
    assert (
        info.value.body["param"] == "structured_outputs.regex"
        and "cannot be followed" in info.value.body["message"]
    )
    # vLLM's earlier fields, as older clients send them: held the same way, and refused by their own name
    guided = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=40, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert guided.choices[0].message.content in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt="x", extra_body={"guided_regex": "(unclosed"})
    assert info.value.body["param"] == "guided_regex" and "cannot be followed" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt="x", extra_body={"typical_p": 0.5})
    assert info.value.body["param"] == "typical_p" and "not supported" in info.value.body["message"]
    # vLLM's sampling extensions: min-p 1 leaves a hot request the greedy text; min_tokens holds off the end
    greedy = client.completions.create(model="demo", prompt="It is ", max_tokens=12, temperature=0)
    pinned = client.completions.create(
        model="demo", prompt="It is ", max_tokens=12, temperature=1.5, seed=3, extra_body={"min_p": 1.0}
    )
    assert pinned.choices[0].text == greedy.choices[0].text
    eos = {"logit_bias": {"256": 100}}  # the demo's end-of-text token, pushed to the top
    assert (
        client.completions.create(model="demo", prompt="It is ", max_tokens=12, **eos).choices[0].text == ""
    )
    held = client.completions.create(
        model="demo", prompt="It is ", max_tokens=12, extra_body={"min_tokens": 5}, **eos
    )
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"
    # bad_words: a piece of the greedy text never comes, and the text is the same until it would
    text = greedy.choices[0].text
    word = text[4:7]
    kept = (
        client.completions.create(
            model="demo", prompt="It is ", max_tokens=12, temperature=0, extra_body={"bad_words": [word]}
        )
        .choices[0]
        .text
    )
    assert word not in kept and kept[:5] == text[:5] and kept[6] != text[6]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city for some days",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
NOW_TOOL = {"type": "function", "function": {"name": "now", "description": "The time"}}


def _streamed_calls(stream: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    """A streamed reply's text, its calls (name, arguments) gathered by index, and its finish."""
    text, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for call in delta.tool_calls or []:
            name, args = calls.get(call.index, ("", ""))
            calls[call.index] = (name + (call.function.name or ""), args + (call.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return text, [calls[i] for i in sorted(calls)], finish


def test_a_required_tool_call_follows_the_tools_schema_whole_and_streamed(client: openai.OpenAI):
    """``tool_choice`` "required" with ``parallel_tool_calls`` false, and a named function: the reply is
    one call to an offered tool, its arguments following the tool's schema, with no text, finish
    ``tool_calls``; streamed, the same calls arrive in ``tool_calls`` deltas, their arguments as they come
    (a call that the token limit cut short, with its arguments so far). Greedy and sampled."""
    messages = [{"role": "user", "content": "What is the weather in Bath? " + _prompt()}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, parallel in (("required", False), (named, False), (named, True)):
        for temperature in (0.0, 1.0):
            ask = dict(
                model="demo",
                messages=messages,
                tools=[WEATHER_TOOL, NOW_TOOL],
                tool_choice=choice,
                parallel_tool_calls=parallel,
                max_tokens=150,  # the demo's context is 1,024 tokens, the byte-level prompt with tools 850
                temperature=temperature,
                seed=9,
            )
            whole = client.chat.completions.create(**ask)
            reply = whole.choices[0]
            if not parallel:
                assert reply.finish_reason == "tool_calls" and reply.message.content is None, reply
                assert len(reply.message.tool_calls) == 1
            calls = reply.message.tool_calls
            assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
            cut = reply.finish_reason == "length"  # the last call cut short: its arguments as far as written
            if cut:
                assert calls[-1].function.arguments.startswith("{"), calls[-1]
            for call in calls[:-1] if cut else calls:
                assert call.function.name in (
                    ("get_weather", "now") if choice == "required" else ("get_weather",)
                )
                args = json.loads(call.function.arguments)
                if call.function.name == "get_weather":
                    assert set(args) == {"city", "days"} and isinstance(args["city"], str)
                    assert len(args["city"]) <= 12 and 1 <= args["days"] <= 7
                else:
                    assert args == {}
            text, streamed, finish = _streamed_calls(client.chat.completions.create(**ask, stream=True))
            assert streamed == [(c.function.name, c.function.arguments) for c in calls]
            assert finish == reply.finish_reason and text == (reply.message.content or "")


def test_a_reply_that_calls_a_tool_on_its_own_is_read_into_tool_calls(client: openai.OpenAI):
    """``tool_choice`` "auto": the demo model writes text, which stays text; held by ``structured_outputs``
    to a sentence and then a call in the Hermes layout, its text and its call are read apart, whole and
    streamed, with the finish ``tool_calls``. Without tools the same reply is all text."""
    messages = [{"role": "user", "content": "What time is it? " + _prompt()}]
    plain = client.chat.completions.create(
        model="demo", messages=messages, tools=[NOW_TOOL], max_tokens=16, temperature=0
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    shape = r'[A-Z][a-z]{2,6}\. <tool_call>\n\{"name": "now", "arguments": \{\}\}\n</tool_call>'
    ask = dict(
        model="demo",
        messages=messages,
        max_tokens=80,
        temperature=0,
        extra_body={"structured_outputs": {"regex": shape}},
    )
    whole = client.chat.completions.create(**ask, tools=[NOW_TOOL, WEATHER_TOOL])
    reply = whole.choices[0]
    assert reply.finish_reason == "tool_calls" and re.fullmatch(r"[A-Z][a-z]{2,6}\.", reply.message.content)
    assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls] == [("now", "{}")]
    text, streamed, finish = _streamed_calls(
        client.chat.completions.create(**ask, tools=[NOW_TOOL, WEATHER_TOOL], stream=True)
    )
    assert (text, streamed, finish) == (reply.message.content, [("now", "{}")], "tool_calls")
    bare = client.chat.completions.create(**ask).choices[0]
    assert bare.finish_reason == "stop" and bare.message.tool_calls is None
    assert re.fullmatch(shape.replace("\\n", "\n"), bare.message.content)


def test_a_conversation_goes_on_after_a_tools_answer(engine: Launched, client: openai.OpenAI):
    """The call a reply made and the tool's answer go back in the next request: the prompt holds the tools,
    the call and the answer in the Hermes layout (`/tokenize` shows it), and the reply goes on from there.
    ``tool_choice`` "none" leaves the tools out of the prompt."""
    first = [{"role": "user", "content": "Weather in Bath for two days? " + _prompt()}]
    ask = dict(model="demo", tools=[WEATHER_TOOL], max_tokens=100, temperature=0, parallel_tool_calls=False)
    reply = client.chat.completions.create(**ask, messages=first, tool_choice="required").choices[0]
    call = reply.message.tool_calls[0]
    history = [
        *first,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 11, "sky": "rain"}'},
    ]
    status, body = http(
        "POST",
        f"{engine.url}/tokenize",
        json.dumps({"model": "demo", "messages": history, "tools": [WEATHER_TOOL]}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {engine.key}"},
    )
    assert status == 200
    prompt = bytes(t for t in json.loads(body)["tokens"] if t < 256).decode()
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in prompt  # the offered tool, a line of JSON
    args = json.dumps(json.loads(call.function.arguments))
    assert f'assistant: <tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>\n' in prompt
    assert 'user: <tool_response>\n{"temp_c": 11, "sky": "rain"}\n</tool_response>\n' in prompt
    after = client.chat.completions.create(**ask, messages=history, max_completion_tokens=12).choices[0]
    assert after.message.content and after.finish_reason in ("length", "stop", "tool_calls")
    status, body = http(
        "POST",
        f"{engine.url}/tokenize",
        json.dumps(
            {"model": "demo", "messages": first, "tools": [WEATHER_TOOL], "tool_choice": "none"}
        ).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {engine.key}"},
    )
    assert status == 200 and b"get_weather" not in bytes(t for t in json.loads(body)["tokens"] if t < 256)
    status, body = http(
        "POST",
        f"{engine.url}/tokenize",
        json.dumps({"model": "demo", "messages": first, "chat_template_kwargs": {"tools": []}}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {engine.key}"},
    )
    assert status == 400 and json.loads(body)["error"]["param"] == "chat_template_kwargs.tools"


def test_bad_tools_are_refused_naming_the_field(client: openai.OpenAI):
    messages = [{"role": "user", "content": "hi"}]
    bad_schema = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strnig"}}}},
    }
    cases = [
        (
            dict(tools=[NOW_TOOL], tool_choice={"type": "function", "function": {"name": "later"}}),
            "tool_choice.function.name",
        ),
        (dict(tools=[NOW_TOOL, NOW_TOOL]), "tools.1.function.name"),
        (dict(tools=[NOW_TOOL, bad_schema], tool_choice="required"), "tools.1.function.parameters"),
        (
            dict(tools=[NOW_TOOL], tool_choice="required", response_format={"type": "json_object"}),
            "tool_choice",
        ),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="demo", messages=messages, max_tokens=4, **extra)
        assert info.value.body["param"] == param, info.value.body


def test_continue_final_message_goes_on_with_the_assistants_text(engine: Launched, client: openai.OpenAI):
    """vLLM's ``continue_final_message``: the last (assistant) message is the start of the reply, so the
    greedy reply is the completion of the transcript that ends with that text (the demo's chat layout is a
    plain transcript), and ``/tokenize`` counts the prompt the chat read; a last message that is not the
    assistant's is a 400 naming the field."""
    question = _prompt()
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": "Her name was"}]
    chat = client.chat.completions.create(
        model="demo",
        messages=messages,
        max_tokens=16,
        temperature=0,
        extra_body={"continue_final_message": True},
    )
    text = client.completions.create(
        model="demo", prompt=f"user: {question}\nassistant: Her name was", max_tokens=16, temperature=0
    )
    assert chat.choices[0].message.content == text.choices[0].text
    status, body = http(
        "POST",
        f"{engine.url}/tokenize",
        json.dumps({"model": "demo", "messages": messages, "continue_final_message": True}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {engine.key}"},
    )
    assert status == 200 and json.loads(body)["count"] == chat.usage.prompt_tokens == text.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": question}],
            max_tokens=4,
            extra_body={"continue_final_message": True},
        )
    assert info.value.body["param"] == "continue_final_message"


def _reuse_figures(engine: Launched, workload: str) -> dict[str, float]:
    """`strata bench --url`'s figures of ``workload`` (``turns`` or ``shared``) on a 100-token context, 8
    tokens generated a request, and checked to have times and a rate."""
    from strata_cfg.bench.http_workloads import http_run

    fig = http_run(
        engine.url,
        workload,
        clients=1,
        tokens=8,
        context=1024,
        vocab=256,
        api_key=engine.key,
        prompt_tokens=100,
    )
    assert fig["later_ttft_s"] > 0 and fig["first_turn_ttft_s"] > 0 and fig["tok_s"] > 0
    return fig


def test_the_turns_workload_over_http_reads_what_the_usage_says_was_reused(engine: Launched) -> None:
    """`strata bench --url --workload turns`: each later turn's usage says its prompt was kept but for the
    new message and the token before it (the demo drafts, so its drafter's last row is written again)."""
    from strata_cfg.schema.workloads import TURN_MESSAGE, TURNS

    fig = _reuse_figures(engine, "turns")
    sent = [100 + (k + 1) * TURN_MESSAGE for k in range(TURNS)]
    assert fig["reused_pct"] == pytest.approx(100 * sum(n - 1 for n in sent[:-1]) / sum(sent[1:]))


def test_the_shared_workload_over_http_copies_the_context_the_first_request_reads(engine: Launched) -> None:
    """`strata bench --url --workload shared`: four requests with one context sent at once (they reach the
    engine in any order); but for the one that read it, each one's usage says the context was reused but for
    its last token (the demo drafts), copied from the reader's slot once it had read it or kept in a freed
    one, and the server counts at least one copy."""
    from strata_cfg.schema.workloads import SHARED_REQUESTS, TURN_MESSAGE

    copies = _metrics(engine)["strata_prefix_reuse_copies_total"]
    fig = _reuse_figures(engine, "shared")
    sent = (SHARED_REQUESTS - 1) * (100 + TURN_MESSAGE)
    assert fig["reused_pct"] == pytest.approx(100 * (SHARED_REQUESTS - 1) * 99 / sent)
    assert _metrics(engine)["strata_prefix_reuse_copies_total"] >= copies + 1


def test_the_conversations_workload_over_http_reuses_histories_from_the_prefix_store(
    engine: Launched,
) -> None:
    """`strata bench --url --workload conversations`: three conversations over the demo's two slots, taking
    turns; the demo's prefix store gives each later turn its sent prompt back, where it was stored (a turn
    adds 32 ids and its reply, which is not sent back: only every other later turn's history is stored
    anew), so the usage's share reused lies between half and all of what a slot per conversation lends."""
    from strata_cfg.bench.http_workloads import bench_url
    from strata_cfg.schema.workloads import TURN_MESSAGE, TURNS

    res = bench_url(engine.url, "conversations", tokens=8, repeats=1, api_key=engine.key, prompt_tokens=100)
    assert res["conversations"] == 3
    fig = res["cases"]["conversations"]["median"]
    sent = [100 + (k + 1) * TURN_MESSAGE for k in range(TURNS)]
    most = 100 * sum(n - 1 for n in sent[:-1]) / sum(sent[1:])
    assert most / 2 < fig["reused_pct"] <= most and fig["later_ttft_s"] > 0


def test_chats_that_outnumber_the_slots_get_their_history_back_from_the_prefix_store(
    engine: Launched, client: openai.OpenAI
):
    """The demo keeps a prefix store: three chats over its two slots, one message each in turn, so the
    first chat's slot serves the third before the first chat's next turn. That turn's usage says its
    history was reused (all but the new message, the reply's last token and a drafter's row at most), and
    the server counts one copy back from the store."""
    chats = [
        [{"role": "system", "content": f"Chat {c}: " + "Answer as a narrator of manners would. " * 4}]
        for c in range(3)
    ]
    before = _metrics(engine)
    for turn in range(2):
        for chat in chats:
            chat.append({"role": "user", "content": f"Turn {turn}: who called at Longbourn?"})
            reply = client.chat.completions.create(model="demo", messages=chat, max_tokens=12, temperature=0)
            chat.append({"role": "assistant", "content": reply.choices[0].message.content})
            usage = reply.usage
            if turn == 0:  # only the chat template's opening, which every chat shares, at most
                assert usage.prompt_tokens_details.cached_tokens < len("Chat 0: ") + 16
            else:  # the history came back: at most the new message and a few tokens around it were read
                read = usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
                assert read <= len(f"Turn {turn}: who called at Longbourn?") + 40
    after = _metrics(engine)
    assert after["strata_prefix_reuse_restores_total"] - before["strata_prefix_reuse_restores_total"] >= 3
    assert after["strata_prefix_store_saved_total"] > before["strata_prefix_store_saved_total"]
    assert 0 < after["strata_prefix_store_bytes"] <= 256 << 20


def test_a_cache_salt_keeps_one_partys_prompts_from_another(client: openai.OpenAI):
    """The same chat sent under two salts: the second reads it whole (its usage reuses nothing, so it learns
    nothing of the first); sent again under its own salt, all but its last token are reused."""
    messages = [{"role": "user", "content": _prompt()}]

    def cached(salt: str) -> tuple[int, int]:
        reply = client.chat.completions.create(
            model="demo", messages=messages, max_tokens=4, temperature=0, extra_body={"cache_salt": salt}
        )
        return reply.usage.prompt_tokens_details.cached_tokens, reply.usage.prompt_tokens

    assert cached("party-a")[0] == 0
    assert cached("party-b")[0] == 0
    reused, sent = cached("party-b")
    assert reused == sent - 1


def test_seeded_sampling_is_reproducible(client: openai.OpenAI):
    prompt, seed = _prompt(), secrets.randbelow(2**31) + 1
    texts = [
        client.completions.create(
            model="demo", prompt=prompt, max_tokens=20, temperature=0.9, top_p=0.95, seed=seed
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert texts[0] == texts[1]


def test_models_and_status_show_the_plan(engine: Launched, client: openai.OpenAI):
    plan = json.loads((engine.run_dir / "plan.json").read_text())
    models = client.models.list().data
    assert [m.id for m in models] == [plan["serve"]["model_name"]]
    one = client.models.retrieve(plan["serve"]["model_name"])  # GET /v1/models/{model}
    assert one.id == models[0].id and one.model_dump()["max_model_len"] == plan["memory"]["context"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("another-model")
    status = get_json(f"{engine.url}/v1/status", engine.key)
    assert status["state"] == "ready"
    assert status["plan"] == plan
    assert status["decisions"] == plan["decisions"]
    assert len(status["engine"]["slots"]) == plan["batch"]["slots"]


def test_three_times_more_clients_than_slots_all_complete_whole(engine: Launched, client: openai.OpenAI):
    slots = len(get_json(f"{engine.url}/v1/status", engine.key)["engine"]["slots"])
    n = 3 * slots
    prompts = [_prompt() for _ in range(n)]
    results: dict[int, openai.types.Completion] = {}
    start = threading.Barrier(n)

    def one(i: int) -> None:
        start.wait()
        results[i] = client.completions.create(model="demo", prompt=prompts[i], max_tokens=48, temperature=0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(n))
    for i, r in results.items():
        _served(r, 48)
        # Nothing lost or mixed up: each reply equals the same request served alone.
        alone = client.completions.create(model="demo", prompt=prompts[i], max_tokens=48, temperature=0)
        assert r.choices[0].text == alone.choices[0].text
        assert r.usage.completion_tokens == alone.usage.completion_tokens


def test_a_client_that_disconnects_frees_its_slot(engine: Launched, client: openai.OpenAI):
    before = _metrics(engine)
    stream = client.completions.create(
        # A greedy reply from this prompt runs past 900 tokens on the demo model.
        model="demo",
        prompt="Once upon a time",
        max_tokens=900,
        temperature=0,
        stream=True,
    )
    try:
        for i, _ in enumerate(stream):
            if i == 3:
                break
        wait_for(lambda: _busy_slots(engine) == 1, 10, "the request to hold a slot")
    finally:
        stream.close()
    wait_for(lambda: _busy_slots(engine) == 0, 10, "the slot to be freed")
    after = _metrics(engine)
    assert after['strata_requests_total{endpoint="completions",outcome="cancelled"}'] == (
        before.get('strata_requests_total{endpoint="completions",outcome="cancelled"}', 0) + 1
    )
    # The request stopped early: far fewer than its 900 tokens were made.
    assert after["strata_tokens_total"] - before["strata_tokens_total"] < 600
    # And the freed slot serves the next request.
    _served(client.completions.create(model="demo", prompt=_prompt(), max_tokens=5), 5)


def test_a_client_that_disconnects_before_a_whole_reply_frees_its_slot(engine: Launched):
    cancelled = 'strata_requests_total{endpoint="completions",outcome="cancelled"}'
    before = _metrics(engine).get(cancelled, 0)
    body = json.dumps({"model": "demo", "prompt": "Once upon a time", "max_tokens": 900, "temperature": 0})
    port = int(engine.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:  # a client that gives up before the reply
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {engine.key}\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        wait_for(lambda: _busy_slots(engine) == 1, 10, "the request to hold a slot")
    wait_for(lambda: _busy_slots(engine) == 0, 10, "the slot to be freed")
    wait_for(
        lambda: _metrics(engine).get(cancelled, 0) == before + 1, 10, "the cancelled request to be counted"
    )


def test_metrics_count_what_was_served(engine: Launched, client: openai.OpenAI):
    before = _metrics(engine)
    r = client.completions.create(
        model="demo", prompt=_prompt(), max_tokens=7 + secrets.randbelow(10), temperature=0
    )
    n = r.usage.completion_tokens
    # The server's own counters are exact when the reply arrives.
    after = _metrics(engine)
    ok = 'strata_requests_total{endpoint="completions",outcome="ok"}'
    assert after[ok] == before.get(ok, 0) + 1  # absent before the first completion is counted
    assert after["strata_completion_tokens_total"] == before["strata_completion_tokens_total"] + n
    assert after["strata_ready"] == 1
    # The engine's are a snapshot taken on the engine thread, at most 50 ms old.
    wait_for(
        lambda: _metrics(engine)["strata_tokens_total"] >= before["strata_tokens_total"] + n,
        5,
        "engine totals",
    )
    after = _metrics(engine)
    assert after["strata_windows_total"] > before["strata_windows_total"]
    assert after["strata_slots"] == 2 and after["strata_slots_busy"] == 0 and after["strata_queue_depth"] == 0


def test_requests_without_the_key_get_401(engine: Launched):
    wrong = openai.OpenAI(base_url=f"{engine.url}/v1", api_key=secrets.token_hex(8), max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="the API key is not valid"):
        wrong.completions.create(model="demo", prompt="hi", max_tokens=2)
    for path in ("/v1/models", "/metrics", "/v1/status"):
        status, body = http("GET", f"{engine.url}{path}")
        assert status == 401
        assert "no API key given" in json.loads(body)["error"]["message"]
    status, body = http("POST", f"{engine.url}/v1/completions", b"{}", {"Content-Type": "application/json"})
    assert status == 401
    assert http("GET", f"{engine.url}/health")[0] == 200  # open, for supervisors and load balancers


BAD_INPUTS = [
    # (path, content type, raw body, status, param, words in the message)
    ("/v1/completions", "application/json", b'{"model": "demo", "prompt": ', 400, None, "not valid JSON"),
    (
        "/v1/completions",
        "text/plain",
        b'{"model": "demo", "prompt": "hi"}',
        415,
        "Content-Type",
        "application/json",
    ),
    ("/v1/completions", "application/json", b'{"prompt": "hi"}', 400, "model", "`model` is required"),
    ("/v1/completions", "application/json", b'{"model": "demo"}', 400, "prompt", "`prompt` is required"),
    (
        "/v1/chat/completions",
        "application/json",
        b'{"model": "demo"}',
        400,
        "messages",
        "`messages` is required",
    ),
    (
        "/v1/completions",
        "application/json",
        b'{"model": "demo", "prompt": "hi", "max_tokens": "many"}',
        400,
        "max_tokens",
        "valid integer",
    ),
    (
        "/v1/completions",
        "application/json",
        b'{"model": "demo", "prompt": "hi", "max_tokens": -5}',
        400,
        "max_tokens",
        "greater than or equal to 0",
    ),
    (
        "/v1/completions",
        "application/json",
        b'{"model": "demo", "prompt": "hi", "max_tokens": 100000000}',
        400,
        "max_tokens",
        "the context is 1024 tokens",
    ),
    (
        "/v1/completions",
        "application/json",
        json.dumps({"model": "demo", "prompt": "x" * 1100}).encode(),
        400,
        "prompt",
        "the prompt is 1100 tokens, but the context is 1024 tokens",
    ),
    (
        "/v1/completions",
        "application/json",
        b'{"model": "gpt-9", "prompt": "hi"}',
        404,
        "model",
        "`gpt-9` does not exist",
    ),
    (
        "/v1/completions",
        "application/json",
        b'{"model": "demo", "prompt": "hi", "n": 17}',
        400,
        "n",
        "less than or equal to 16",
    ),
    (
        "/v1/chat/completions",
        "application/json",
        b'{"model": "demo", "messages": [{"role": "user", "content": 7}]}',
        400,
        "messages.0.content",
        "a string or a list of text parts",
    ),
    (
        "/v1/chat/completions",
        "application/json",
        json.dumps(
            {
                "model": "demo",
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 5}},
                },
            }
        ).encode(),
        400,
        "response_format.json_schema.schema",
        "cannot be followed",
    ),
    ("/v1/nothing", "application/json", b"{}", 404, None, "no route POST /v1/nothing"),
]


@pytest.mark.parametrize(("path", "ctype", "raw", "status", "param", "words"), BAD_INPUTS)
def test_bad_input_gets_a_4xx_naming_the_field_and_the_engine_keeps_serving(
    engine: Launched, client: openai.OpenAI, path, ctype, raw, status, param, words
):
    headers = {"Content-Type": ctype, "Authorization": f"Bearer {engine.key}"}
    got, body = http("POST", f"{engine.url}{path}", raw, headers)
    assert got == status
    error = json.loads(body)["error"]
    assert words in error["message"]
    assert error["param"] == param
    assert "Traceback" not in body.decode()
    _served(client.completions.create(model="demo", prompt=_prompt(), max_tokens=4), 4)


def test_long_prompts_at_the_default_temperature_are_served_and_the_engine_stays_up(
    engine: Launched, client: openai.OpenAI
):
    """Prompts longer than one prefill chunk, sampled (temperature 1.0 is the API's default)."""
    ids = [(i * 37) % 250 + 1 for i in range(513)]
    r = client.completions.create(model="demo", prompt=ids, max_tokens=4)
    _served(r, 4)
    assert r.usage.prompt_tokens == 513
    chat = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "x" * 1001}], max_tokens=3, temperature=0.7
    )
    assert chat.choices[0].finish_reason in ("length", "stop")
    _served(client.completions.create(model="demo", prompt=_prompt(), max_tokens=4), 4)


def test_loadtest_reports_requests_errors_and_latency(engine: Launched):
    proc = strata(
        *("loadtest", engine.url, "--clients", "4", "--seconds", "2", "--max-tokens", "16", "--json"),
        *("--api-key-env", "STRATA_TEST_KEY"),
        env={"STRATA_TEST_KEY": engine.key},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["errors"] == 0
    assert result["requests"] >= 4
    assert result["tokens"] == 16 * result["requests"]
    assert 0 < result["latency_p50_s"] <= result["latency_p95_s"]


def _load(engine: Launched, **kw: Any) -> Any:
    """`strata_cfg.bench.load_test.run_load` against the launched engine, with its key."""
    from strata_cfg.bench.load_test import run_load

    return run_load(engine.url, api_key=engine.key, **kw)


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_loadtest_holds_a_conversation_per_client_and_reports_the_prompt_reused(
    engine: Launched, stream: bool
):
    """Three chats over the demo's two slots, three turns each: every request sends the shared system
    prompt, the chat so far and a new message; the server reuses most of each prompt (the system prompt
    copied between slots, each chat's history kept in its slot or in the prefix store), and the report
    says how much, from the usage."""
    from strata_cfg.bench.load_test import CHAT_SYSTEM

    result = _load(engine, clients=3, requests_per_client=3, max_tokens=8, chat=True, stream=stream)
    j = result.to_json()
    assert j["errors"] == 0 and j["requests"] == 9 and j["chat"] is True
    assert all(s.text for s in result.served) and j["tokens"] == 8 * 9
    # Every prompt holds the system prompt at least; later turns hold it and the chat so far.
    assert all(s.prompt_tokens > len(CHAT_SYSTEM) for s in result.served)
    assert j["prompt_tokens"] == sum(s.prompt_tokens for s in result.served)
    assert j["reused_pct"] > 60 and j["cached_tokens"] > 9 * (len(CHAT_SYSTEM) // 2)
    assert any("not read again" in line for line in result.lines())
    assert result.lines()[0].startswith("3 chats, 8 tokens each")


@pytest.mark.parametrize("stream", [False, True])
def test_a_loadtest_with_a_choice_holds_every_reply_to_it(engine: Launched, stream: bool):
    """`run_load`'s ``shape`` (the loadtest's --choice and its kin) goes in every request as
    ``structured_outputs``: every reply, whole or streamed, is one of the choices."""
    choices = ["yes", "no", "not today"]
    result = _load(
        engine, clients=2, requests_per_client=3, max_tokens=16, stream=stream, shape={"choice": choices}
    )
    assert result.to_json()["errors"] == 0 and len(result.served) == 6
    assert all(s.text in choices for s in result.served)


def test_the_chat_flag_reaches_the_loadtest(engine: Launched):
    proc = strata(
        *(
            "loadtest",
            engine.url,
            "--clients",
            "2",
            "--seconds",
            "1",
            "--max-tokens",
            "16",
            "--json",
            "--chat",
            "--regex",
            "[A-Z][a-z]{1,6}",
        ),
        *("--api-key-env", "STRATA_TEST_KEY"),
        env={"STRATA_TEST_KEY": engine.key},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["chat"] is True and result["errors"] == 0 and result["cached_tokens"] > 0
    # The regex ends every reply within 7 characters (one token each): free, they run to their 16.
    assert result["tokens"] <= 7 * result["requests"]


def test_a_sampled_loadtest_sends_requests_the_server_accepts(engine: Launched):
    proc = strata(
        *("loadtest", engine.url, "--clients", "2", "--seconds", "1", "--max-tokens", "8", "--json"),
        *("--temperature", "0.8", "--top-k", "20", "--presence-penalty", "1.5", "--frequency-penalty", "0.5"),
        *("--api-key-env", "STRATA_TEST_KEY"),
        env={"STRATA_TEST_KEY": engine.key},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["errors"] == 0 and result["requests"] >= 2
    assert result["tokens"] == 8 * result["requests"]


def test_bench_drives_the_launched_engine_over_http(engine: Launched):
    before = _metrics(engine)
    proc = strata(
        *("bench", "--url", engine.url, "--workload", "two-decodes", "--repeats", "2", "--tokens", "24"),
        *("--api-key-env", "STRATA_TEST_KEY", "--json"),
        env={"STRATA_TEST_KEY": engine.key},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    plan = json.loads((engine.run_dir / "plan.json").read_text())
    assert (
        result["plan"]["mode"] == plan["batch"]["mode"]
        and result["plan"]["batch_mtp"] == plan["batch"]["mtp"]
    )
    case = result["cases"]["two-decodes"]
    assert len(case["runs"]) == 2
    assert case["median"]["tok_s"] > 0 and case["median"]["rows_per_window"] >= 1
    assert case["median"]["generation_tok_s"] > 0  # as the in-process harness reports it
    median = case["median"]
    assert median["longest_gap_ms"] > 0  # timed between the streams' chunks
    assert 0 < median["gap_p50_ms"] <= median["gap_p99_ms"] <= median["longest_gap_ms"]
    # Two runs of two 24-token streams went through the engine (greedy replies may end early at EOS).
    after = _metrics(engine)
    ok = 'strata_requests_total{endpoint="completions",outcome="ok"}'
    assert after[ok] - before.get(ok, 0) == 4
    tokens = "strata_completion_tokens_total"
    assert 0 < after[tokens] - before.get(tokens, 0) <= 4 * 24


def _bench_moved(engine: Launched, *args: str) -> dict[str, float]:
    """Run `strata bench --url` against the launched demo with ``args``; what it moved the server's
    counters by."""
    before = _metrics(engine)
    proc = strata(
        *("bench", "--url", engine.url, *args, "--api-key-env", "STRATA_TEST_KEY", "--json"),
        env={"STRATA_TEST_KEY": engine.key},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = _metrics(engine)
    return {k: v - before.get(k, 0) for k, v in after.items()}


def test_bench_over_http_holds_every_reply_to_a_shape(engine: Launched):
    """`strata bench --url ... --choice ab`: every decoding request carries the choice as its
    ``structured_outputs``, so each of the two streams of each run ends after its two tokens."""
    moved = _bench_moved(
        engine, "--workload", "two-decodes", "--repeats", "2", "--tokens", "24", "--choice", "ab"
    )
    assert moved["strata_completion_tokens_total"] == 2 * 2 * 2  # two runs of two streams, two tokens each


def test_bench_reads_a_prompt_over_http(engine: Launched):
    """`--workload prompt` over HTTP: one fresh prompt of --prompt-tokens ids per run, read for one token;
    its read rate is the prompt over the time to its first token."""
    before = _metrics(engine)
    proc = strata(
        *("bench", "--url", engine.url, "--workload", "prompt", "--repeats", "2", "--prompt-tokens", "150"),
        *("--api-key-env", "STRATA_TEST_KEY", "--json"),
        env={"STRATA_TEST_KEY": engine.key},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    runs = result["cases"]["prompt"]["runs"]
    assert len(runs) == 2 and all(r["prompt_tokens"] == 150 for r in runs)
    assert all(r["tok_s"] == pytest.approx(150 / r["prompt_read_s"]) for r in runs)
    after = _metrics(engine)
    ok = 'strata_requests_total{endpoint="completions",outcome="ok"}'
    assert after[ok] - before.get(ok, 0) == 2
    assert 0 < after["strata_completion_tokens_total"] - before.get("strata_completion_tokens_total", 0) <= 2

    context = json.loads((engine.run_dir / "plan.json").read_text())["memory"]["context"]
    too_long = strata(
        *("bench", "--url", engine.url, "--workload", "prompt", "--prompt-tokens", str(context)),
        *("--api-key-env", "STRATA_TEST_KEY"),
        env={"STRATA_TEST_KEY": engine.key},
    )
    assert too_long.returncode == 1
    assert f"--prompt-tokens {context}" in too_long.stderr and f"at most {context - 1}" in too_long.stderr


def test_a_sampled_bench_over_http_sends_requests_the_server_accepts(engine: Launched):
    moved = _bench_moved(
        engine,
        *("--workload", "solo", "--repeats", "1", "--tokens", "16"),
        *("--temperature", "0.8", "--top-p", "0.9", "--top-k", "20"),
        *("--presence-penalty", "1.5", "--frequency-penalty", "0.5"),
    )
    assert moved['strata_requests_total{endpoint="completions",outcome="ok"}'] == 1


def test_tokenize_and_detokenize_read_prompts_as_the_completion_endpoints_do(engine: Launched):
    """`/tokenize` gives a text's ids (a chat's through the chat template) and the context they must fit
    in; `/detokenize` gives the text back; bad input gets a 4xx naming the field."""
    from strata_runtime.weights.tokenizer import ByteTokenizer

    json_type = {"Content-Type": "application/json"}
    key = {**json_type, "Authorization": f"Bearer {engine.key}"}
    tok = ByteTokenizer(384)  # the demo model's

    def post(path: str, body: object, headers: dict[str, str] = key) -> tuple[int, dict]:
        status, raw = http("POST", f"{engine.url}{path}", json.dumps(body).encode(), headers)
        return status, json.loads(raw)

    context = get_json(f"{engine.url}/v1/models", engine.key)["data"][0]["max_model_len"]
    text = "naïve <|im_start|>café"
    status, got = post("/tokenize", {"model": "demo", "prompt": text})
    assert status == 200 and got == {
        "count": len(tok.encode(text)),
        "max_model_len": context,
        "tokens": tok.encode(text),
    }
    chat = [{"role": "user", "content": "Hello"}]
    status, got = post("/tokenize", {"messages": chat})
    assert status == 200 and got["tokens"] == tok.apply_chat_template(chat)
    status, got = post("/detokenize", {"tokens": tok.encode(text)})
    assert status == 200 and got == {"prompt": text}
    for path, body, param in [
        ("/tokenize", {"prompt": "a", "messages": chat}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/detokenize", {"tokens": [1, 384]}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
        ("/tokenize", {"model": "other", "prompt": "a"}, "model"),
    ]:
        status, err = post(path, body)
        assert 400 <= status < 500 and err["error"]["param"] == param, (path, body, err)
        assert f"`{param}`" in err["error"]["message"] or param == "model", err
    assert post("/tokenize", {"prompt": "a"}, json_type)[0] == 401


def test_ignore_eos_generates_past_end_of_text(client: openai.OpenAI):
    """Every choice pushed to end-of-text (id 256 of the demo's byte-level vocabulary): the reply ends at
    once; with the ``ignore_eos`` extension it runs to ``max_tokens``, streamed or whole."""
    biased = {"logit_bias": {"256": 100}, "temperature": 0}
    short = client.completions.create(model="demo", prompt=_prompt(), max_tokens=6, extra_body=biased)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens == 0
    long = client.completions.create(
        model="demo", prompt=_prompt(), max_tokens=6, extra_body={**biased, "ignore_eos": True}
    )
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 6
    chunks = list(
        client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": _prompt()}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={**biased, "ignore_eos": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_stop_token_ids_end_the_reply_before_the_token(client: openai.OpenAI):
    """The ``stop_token_ids`` extension: a token of the greedy reply given as a stop id ends the reply just
    before its first appearance (the demo's ids are bytes)."""
    prompt, text = _full_length_prompt(client, 16)
    stop = text.encode()[5]
    cut = text.encode().index(stop)
    ask = {"model": "demo", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    r = client.completions.create(**ask, extra_body={"stop_token_ids": [stop]})
    assert r.choices[0].text.encode() == text.encode()[:cut]
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == cut


def test_logprobs_whole_and_streamed_through_the_client(client: openai.OpenAI):
    """Chat ``logprobs`` + ``top_logprobs`` and completions ``logprobs``: one entry per generated token, whose
    bytes add up to the reply, the same streamed as whole; greedy, so each is the most likely at its place."""
    messages = [{"role": "user", "content": _prompt()}]
    ask = {"model": "demo", "messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": True}
    whole = client.chat.completions.create(**ask, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens > 0
    assert bytes(b for e in content for b in e.bytes).decode() == whole.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
        assert e.logprob <= 0.0
    parts = list(client.chat.completions.create(**ask, top_logprobs=3, stream=True))
    streamed = [
        e for c in parts if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(model="demo", messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None

    prompt, text = _full_length_prompt(client, 10)
    legacy = client.completions.create(model="demo", prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value and max(top.values()) == value and len(top) <= 2
    sampled = client.completions.create(
        model="demo", prompt=prompt, max_tokens=10, temperature=1.5, seed=5, logprobs=0
    )
    assert len(sampled.choices[0].logprobs.token_logprobs) == sampled.usage.completion_tokens

    # Every token forced to byte 0xC3, a UTF-8 lead byte: each waits for the next before its text is out, and
    # its log-probability goes out with that text.
    forced = {"model": "demo", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    forced["extra_body"] = {"logit_bias": {"195": 100}}
    chunks = list(client.completions.create(**forced, stream=True))
    names = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert names == ["bytes:\\xc3"] * 6
    assert all(c.choices[0].text or c.choices[0].finish_reason for c in chunks if c.choices)  # none empty


def test_echo_returns_the_prompt_with_its_logprobs_as_an_evaluation_harness_asks(client: openai.OpenAI):
    """``echo`` + ``logprobs`` + ``max_tokens: 1`` (how lm-evaluation-harness scores a continuation): the
    prompt's text and tokens come first, its first token without a figure, each later one with the figure a
    request whose prompt stops just before it gives it; streamed the same as whole."""
    prompt = _prompt()
    ids = list(prompt.encode())  # the demo model's ids are bytes
    ask = {"model": "demo", "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    whole = client.completions.create(**ask)
    choice = whole.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1
    assert "".join(lp.tokens[: len(ids)]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[: len(ids)] == list(range(len(ids)))
    for j in (1, len(ids) // 2, len(ids) - 1):
        alone = client.completions.create(
            model="demo",
            prompt=ids[:j],
            max_tokens=1,
            temperature=0,
            logprobs=0,
            extra_body={"logit_bias": {str(ids[j]): 100}},
        )
        assert alone.choices[0].logprobs.tokens == [lp.tokens[j]]
        assert abs(alone.choices[0].logprobs.token_logprobs[0] - lp.token_logprobs[j]) < 1e-4
    chunks = list(client.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    streamed = [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
    ]
    assert streamed == lp.tokens
    plain = client.completions.create(model="demo", prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None


def _post(engine: Launched, path: str, body: dict) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {engine.key}", "Content-Type": "application/json"}
    status, raw = http("POST", f"{engine.url}{path}", json.dumps(body).encode(), headers)
    return status, json.loads(raw)


def test_an_evaluation_harness_scores_through_the_tokenizer_endpoints_and_a_batch(
    engine: Launched, client: openai.OpenAI
):
    """What lm-evaluation-harness's local-completions model does with no tokenizer of its own: reads
    /tokenizer_info, tokenizes through /tokenize, and scores continuations by echoing a batch of id prompts
    with ``logprobs: 1`` (``max_tokens`` 1, or 0 in its older versions). A continuation that is the model's
    own greedy reply is greedy by the harness's test, and scores the sum of that reply's own figures."""
    info = get_json(f"{engine.url}/tokenizer_info", engine.key)
    max_len = get_json(f"{engine.url}/v1/models", engine.key)["data"][0]["max_model_len"]
    assert (info["model_max_length"], info["tokenizer_class"]) == (max_len, "ByteTokenizer")
    status, eos = _post(engine, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert status == 200 and eos["tokens"] == [256]  # the demo's end-of-text id
    jinja2 = pytest.importorskip("jinja2")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes."}]
    rendered = jinja2.Template(info["chat_template"]).render(messages=messages, add_generation_prompt=True)
    status, chat_ids = _post(engine, "/tokenize", {"messages": messages})
    assert _post(engine, "/detokenize", {"tokens": chat_ids["tokens"]})[1]["prompt"] == rendered

    prompt, reply = _full_length_prompt(client, 8)
    scored = client.completions.create(
        model="demo", prompt=prompt, max_tokens=8, temperature=0, logprobs=1
    ).choices[0]
    context = _post(engine, "/tokenize", {"prompt": prompt})[1]["tokens"]
    other = _post(engine, "/tokenize", {"prompt": prompt + " an end"})[1]["tokens"]
    pairs = [(context, list(reply.encode())), (context, other[len(context) :])]
    for max_tokens in (1, 0):
        status, out = _post(
            engine,
            "/v1/completions",
            {
                "model": "demo",
                "prompt": [c + x for c, x in pairs],
                "max_tokens": max_tokens,
                "temperature": 0,
                "logprobs": 1,
                "echo": True,
                "seed": 1234,
            },
        )
        assert status == 200, out
        choices = sorted(out["choices"], key=lambda c: c["index"])
        assert [c["index"] for c in choices] == [0, 1]
        assert out["usage"]["prompt_tokens"] == sum(len(c) + len(x) for c, x in pairs)
        assert out["usage"]["completion_tokens"] == (2 if max_tokens else 0)
        results = []
        for choice, (c, x) in zip(choices, pairs, strict=True):
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(c) + len(x) + max_tokens
            end = len(lp["tokens"]) - max_tokens
            figures, tops = lp["token_logprobs"][len(c) : end], lp["top_logprobs"][len(c) : end]
            greedy = all(f == max(top.values()) for f, top in zip(figures, tops, strict=True))
            results.append((sum(figures), greedy))
        assert results[0][1] is True  # the model's own reply
        assert abs(results[0][0] - sum(scored.logprobs.token_logprobs)) < 1e-3
    status, err = _post(engine, "/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 0})
    assert status == 400 and err["error"]["param"] == "max_tokens"
    chunks = list(
        client.completions.create(model="demo", prompt=prompt, max_tokens=0, echo=True, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_and_batches_whole_and_streamed(engine: Launched, client: openai.OpenAI):
    """``n`` choices, whole or streamed, on both endpoints: greedy, each is the reply of the same request
    alone; sampled, each runs to its own end. A streamed batch of prompts names each chunk's choice. (A
    sampled choice's text depends on the windows it shares, as drafting takes its random numbers, so
    sampled choices are not compared with single requests.)"""
    prompt, text = _full_length_prompt(client, 10)
    ask = {"model": "demo", "prompt": prompt, "max_tokens": 10, "temperature": 0}
    whole = client.completions.create(**ask, n=3)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == [text] * 3
    assert whole.usage.prompt_tokens == len(prompt.encode())  # the prompt counts once
    assert whole.usage.completion_tokens == 30
    texts = ["", "", ""]
    chunks = list(client.completions.create(**ask, n=3, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [text] * 3
    assert chunks[-1].usage == whole.usage  # the last chunk: the prompt once, every choice's tokens
    sampled = client.completions.create(**{**ask, "temperature": 0.9, "seed": 7}, n=2)
    assert sorted(c.index for c in sampled.choices) == [0, 1]
    assert all(c.finish_reason in ("length", "stop") for c in sampled.choices)

    messages = [{"role": "user", "content": _prompt()}]
    chat = {"model": "demo", "messages": messages, "max_tokens": 8, "temperature": 0}
    one = client.chat.completions.create(**chat).choices[0].message.content
    assert [c.message.content for c in client.chat.completions.create(**chat, n=2).choices] == [one, one]
    streamed = ["", ""]
    roles = set()
    ends = {}
    for chunk in client.chat.completions.create(**{**chat, "temperature": 0.9}, n=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            roles.add((choice.index, choice.delta.role))
            ends[choice.index] = choice.finish_reason or ends.get(choice.index)
    assert {(0, "assistant"), (1, "assistant")} <= roles
    assert set(ends) == {0, 1} and all(ends.values())

    batch = [list(prompt.encode()), list(_prompt().encode())]
    whole_batch = client.completions.create(model="demo", prompt=batch, max_tokens=6, temperature=0)
    by_index = ["", ""]
    for chunk in client.completions.create(
        model="demo", prompt=batch, max_tokens=6, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            by_index[choice.index] += choice.text
    assert by_index == [c.text for c in sorted(whole_batch.choices, key=lambda c: c.index)]
    assert text.startswith(by_index[0]) and by_index[0]


class _OtherServer:
    """A stand-in OpenAI-compatible server that is not strata: /v1/models and streamed /v1/completions
    (one "a" a millisecond, then the usage), no /v1/status; it counts the completions it served."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        served = self.served = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    body = json.dumps({"data": [{"id": "other"}]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                else:
                    self.send_error(404)

            def do_POST(self) -> None:
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                served.append(req)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                n = int(req["max_tokens"])
                for i in range(n):
                    time.sleep(0.001)
                    end = "length" if i == n - 1 else None
                    chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": end}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_bench_measures_the_engine_beside_another_openai_server_interleaved(engine: Launched):
    """`strata bench --url A --url B`: both servers measured in turn, the second against the first; the one
    that is not strata (no /v1/status) without window statistics."""
    other = _OtherServer()
    before = _metrics(engine)
    try:
        proc = strata(
            *("bench", "--url", f"strata={engine.url}", "--url", f"other={other.url}"),
            *("--workload", "two-decodes", "--repeats", "2", "--tokens", "12"),
            *("--api-key-env", "STRATA_TEST_KEY", "--json"),
            env={"STRATA_TEST_KEY": engine.key},
        )
    finally:
        other.close()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.count("repeat ") == 4 and "other:" in proc.stderr  # a progress line per run
    result = json.loads(proc.stdout)
    ours, theirs = result["arms"]["strata"], result["arms"]["other"]
    assert (
        result["base"] == "strata" and ours["server"] == "strata" and theirs["server"] == "openai-compatible"
    )
    assert ours["plan"]["slots"] >= 1 and theirs["plan"] is None
    case = theirs["cases"]["two-decodes"]
    assert len(case["runs"]) == 2 and case["median"]["tok_s"] > 0 and "ms_per_window" not in case["median"]
    assert case["ratio"] == pytest.approx(
        case["median"]["tok_s"] / ours["cases"]["two-decodes"]["median"]["tok_s"]
    )
    assert ours["cases"]["two-decodes"]["median"]["rows_per_window"] >= 1
    # Two runs of two streams each went to each server, with the same requests.
    assert len(other.served) == 4 and all(r["max_tokens"] == 12 and r["stream"] for r in other.served)
    ok = 'strata_requests_total{endpoint="completions",outcome="ok"}'
    assert _metrics(engine)[ok] - before.get(ok, 0) == 4


def test_strata_status_reports_the_launch_and_what_its_engine_served(engine: Launched, client: openai.OpenAI):
    """`strata status RUN_DIR`: the launch ready at its address, its pids, and from ``/v1/status`` (read with
    the key the profile names) its slots and the tokens it generated; without the key, the status part is
    left out and the line names the variable."""
    run = str(engine.run_dir)
    bare = strata("status", run, "--json")
    assert bare.returncode == 0, bare.stderr
    (only,) = json.loads(bare.stdout)["launches"]
    assert only["state"] == "ready" and only["url"] == f"{engine.url}/v1" and only["status"] is None
    assert "set STRATA_TEST_KEY to read its /v1/status" in only["note"]
    assert only["engine_pid"] == engine.engine_pid() and only["launcher_pid"] == engine.proc.pid
    key = {"STRATA_TEST_KEY": engine.key or ""}
    before = json.loads(strata("status", run, "--json", env=key).stdout)["launches"][0]["status"]
    _served(client.completions.create(model="demo", prompt=_prompt(), max_tokens=6), 6)
    out = strata("status", run, "--json", env=key)
    (after,) = json.loads(out.stdout)["launches"]
    st = after["status"]
    assert st["slots"] == 2 and st["slots_busy"] == 0 and st["queued"] == 0
    assert st["tokens"] >= before["tokens"] + 6 and st["windows"] > before["windows"]
    assert after["engine_starts"] >= 1 and st["uptime_s"] > 0
    wrong = json.loads(strata("status", run, "--json", env={"STRATA_TEST_KEY": "wrong"}).stdout)
    assert (
        wrong["launches"][0]["note"]
        == "its /v1/status did not answer: the key in STRATA_TEST_KEY was refused"
    )
    text = strata("status", run, env=key)
    assert text.returncode == 0
    assert text.stdout.startswith(f"demo: ready at {engine.url}/v1, model `demo`\n")
    assert "slots 0 of 2 busy, 0 queued; " in text.stdout and " tokens generated in " in text.stdout


def test_strata_logs_follows_the_engine_log_as_it_serves(engine: Launched, client: openai.OpenAI):
    """`strata logs RUN_DIR -f`: the log's last line, then each line the engine writes as it serves (here
    the access log's line of a completion); Ctrl-C ends it with 0."""
    import select
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "strata_cfg", "logs", str(engine.run_dir), "-f", "-n", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline()  # the last line so far
        _served(client.completions.create(model="demo", prompt=_prompt(), max_tokens=3), 3)
        deadline, seen = time.monotonic() + 30, []
        while not any('"POST /v1/completions HTTP/1.1" 200' in line for line in seen):
            assert time.monotonic() < deadline, seen
            if select.select([proc.stdout], [], [], 0.5)[0]:
                seen.append(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0, proc.stderr.read() if proc.stderr else ""


def test_a_killed_engine_is_restarted_by_the_launcher(engine: Launched, client: openai.OpenAI):
    old = engine.engine_pid()
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: "ready again" in engine.output(), 60, "the restarted engine")
    out = engine.output()
    assert "the engine was killed by SIGKILL" in out
    assert re.search(r"restarting in \d+(\.\d+)? s \(restart 1 of at most \d+\)", out)
    assert engine.engine_pid() != old and not alive(old)
    _served(client.completions.create(model="demo", prompt=_prompt(), max_tokens=6), 6)


def test_sigterm_stops_the_launcher_and_the_engine_cleanly(engine: Launched):
    engine_pid = engine.engine_pid()
    started = time.monotonic()
    assert engine.stop(timeout=30) == 0
    assert time.monotonic() - started < 30
    assert "the engine stopped cleanly" in engine.output()
    assert not alive(engine_pid)
    assert not (engine.run_dir / "launch.pid").exists()
    assert not engine.healthy()
