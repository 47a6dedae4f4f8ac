"""The OpenAI wire format, without a server: what each bad body is told, and what a good one becomes.

These are pure functions; the tests that the same errors reach a real client over HTTP, and that the engine
keeps serving afterwards, are in test_srv_openai.py.
"""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata_runtime.chat import ToolCall
from strata_runtime.server import metrics
from strata_runtime.server import protocol as p
from strata_runtime.server.tools import tool_use
from strata_runtime.structured import choice_grammar, grammars_for, json_grammar, lark_grammar, regex_grammar
from strata_runtime.weights.tokenizer import ByteTokenizer

BAD_COMPLETIONS = [
    # (body, status, param, words the message must contain)
    ({"prompt": "hi"}, 400, "model", ["`model`", "required"]),
    ({"model": "m"}, 400, "prompt", ["`prompt`", "required"]),
    ({"model": "m", "prompt": "hi", "max_tokens": -3}, 400, "max_tokens", ["`max_tokens`", "greater than"]),
    ({"model": "m", "prompt": "hi", "max_tokens": "12"}, 400, "max_tokens", ["`max_tokens`", "integer"]),
    ({"model": "m", "prompt": "hi", "max_tokens": True}, 400, "max_tokens", ["`max_tokens`", "integer"]),
    ({"model": "m", "prompt": "hi", "temperature": 7.5}, 400, "temperature", ["`temperature`", "less than"]),
    ({"model": "m", "prompt": "hi", "temperature": "hot"}, 400, "temperature", ["`temperature`", "number"]),
    ({"model": "m", "prompt": "hi", "top_p": 0}, 400, "top_p", ["`top_p`", "greater than"]),
    ({"model": "m", "prompt": "hi", "seed": -1}, 400, "seed", ["`seed`"]),
    ({"model": "m", "prompt": "hi", "stop": 5}, 400, "stop", ["`stop`", "list of up to 4 strings"]),
    ({"model": "m", "prompt": 42}, 400, "prompt", ["`prompt`", "token ids"]),
    ({"model": "m", "prompt": [[1, 2], "x"]}, 400, "prompt", ["`prompt`", "batch"]),  # one kind per batch
    ({"model": "m", "prompt": "hi", "n": 17}, 400, "n", ["`n`", "less than or equal to 16"]),
    ({"model": "m", "prompt": "hi", "n": 0}, 400, "n", ["`n`", "greater than or equal to 1"]),
    ({"model": "m", "prompt": "hi", "echo": 1}, 400, "echo", ["`echo`", "boolean"]),
    ({"model": "m", "prompt": "hi", "best_of": 2}, 400, "best_of", ["`best_of`", "not supported"]),
    ({"model": "m", "prompt": "hi", "stream": "yes"}, 400, "stream", ["`stream`", "boolean"]),
    ({"model": "m", "prompt": "hi", "ignore_eos": 1}, 400, "ignore_eos", ["`ignore_eos`", "boolean"]),
    ({"model": "m", "prompt": "hi", "cache_salt": ""}, 400, "cache_salt", ["`cache_salt`", "at least 1"]),
    ({"model": "m", "prompt": "hi", "cache_salt": 7}, 400, "cache_salt", ["`cache_salt`", "string"]),
    ({"model": "m", "prompt": "hi", "priority": "high"}, 400, "priority", ["`priority`", "integer"]),
    ({"model": "m", "prompt": "hi", "priority": 2**31}, 400, "priority", ["`priority`"]),
]


@pytest.mark.parametrize(("body", "status", "param", "words"), BAD_COMPLETIONS)
def test_bad_completion_bodies_name_the_field(body, status, param, words):
    with pytest.raises(p.ApiError) as info:
        p.parse_completion(body)
    err = info.value
    assert (err.status, err.param) == (status, param)
    for w in words:
        assert w in err.message
    assert err.body()["error"]["param"] == param
    assert err.body()["error"]["type"] == "invalid_request_error"


BAD_CHATS = [
    ({"model": "m"}, "messages", ["`messages`", "required"]),
    ({"model": "m", "messages": []}, "messages", ["`messages`", "at least 1"]),
    ({"model": "m", "messages": "hello"}, "messages", ["`messages`", "list"]),
    ({"model": "m", "messages": [{"content": "hi"}]}, "messages.0.role", ["`messages.0.role`", "required"]),
    (
        {"model": "m", "messages": [{"role": "wizard", "content": "hi"}]},
        "messages.0.role",
        ["`messages.0.role`"],
    ),
    (
        {"model": "m", "messages": [{"role": "user", "content": 3}]},
        "messages.0.content",
        ["`messages.0.content`", "a string or a list of text parts"],
    ),
    (
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]},
        "functions",
        ["`functions`", "not supported"],
    ),
    (
        {
            "model": "m",
            "messages": [
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {}}]}
            ],
        },
        "messages.0.tool_calls.0.function.name",
        ["`messages.0.tool_calls.0.function.name`", "required"],
    ),
    (
        {
            "model": "m",
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
                    ],
                }
            ],
        },
        "messages.0.tool_calls.0.function.arguments",
        ["`messages.0.tool_calls.0.function.arguments`", "string"],
    ),
]


@pytest.mark.parametrize(("body", "param", "words"), BAD_CHATS)
def test_bad_chat_bodies_name_the_field(body, param, words):
    with pytest.raises(p.ApiError) as info:
        p.parse_chat(body)
    assert info.value.status == 400
    assert info.value.param == param
    for w in words:
        assert w in info.value.message


def test_body_that_is_not_an_object_is_refused():
    for raw in ([1, 2], "text", 3, None):
        with pytest.raises(p.ApiError, match="JSON object"):
            p.parse_completion(raw)


def test_unknown_model_is_404_naming_both_models():
    with pytest.raises(p.ApiError) as info:
        p.check_model("gpt-4o", "demo")
    assert info.value.status == 404
    assert info.value.code == "model_not_found"
    assert "`gpt-4o`" in info.value.message and "`demo`" in info.value.message


def test_text_parts_and_unknown_fields_are_accepted():
    body = p.parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}],
                },
            ],
            "user": "someone",  # an OpenAI field this server ignores
            "max_completion_tokens": 7,
        }
    )
    assert p.chat_messages(body) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    prepared = p.prepare(body, [5, 6, 7], context=64, vocab_size=64, default_max_tokens=None)
    assert prepared.request.max_tokens == 7


def test_prompt_token_ids_are_checked_against_the_vocabulary():
    rng = random.Random(110)
    vocab = rng.randrange(100, 1000)
    ids = [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 20))]
    body = p.parse_completion({"model": "m", "prompt": ids})
    assert p.prompts(body, tokenizer=None, vocab_size=vocab) == [(ids, None)]  # type: ignore[arg-type]
    body = p.parse_completion({"model": "m", "prompt": [*ids, vocab]})
    with pytest.raises(p.ApiError, match=f"token id {vocab} is outside") as info:
        p.prompts(body, tokenizer=None, vocab_size=vocab)  # type: ignore[arg-type]
    assert info.value.param == "prompt"
    body = p.parse_completion({"model": "m", "prompt": [ids, [*ids, vocab]]})
    with pytest.raises(p.ApiError, match=f"`prompt.1`: token id {vocab} is outside") as info:
        p.prompts(body, tokenizer=None, vocab_size=vocab)  # type: ignore[arg-type]
    assert info.value.param == "prompt.1"
    body = p.parse_completion({"model": "m", "prompt": [ids, []]})
    with pytest.raises(p.ApiError, match="`prompt.1` must not be empty"):
        p.prompts(body, tokenizer=None, vocab_size=vocab)  # type: ignore[arg-type]
    body = p.parse_completion({"model": "m", "prompt": [ids] * (p.MAX_CHOICES + 1)})
    with pytest.raises(p.ApiError, match=f"at most {p.MAX_CHOICES} choices"):
        p.prompts(body, tokenizer=None, vocab_size=vocab)  # type: ignore[arg-type]
    body = p.parse_completion({"model": "m", "prompt": [ids] * 5, "n": 13})  # 65 choices
    with pytest.raises(p.ApiError, match=r"got 5 x 13"):
        p.prompts(body, tokenizer=None, vocab_size=vocab)  # type: ignore[arg-type]


def test_n_choices_draw_from_consecutive_seeds_and_count_their_prompt_once():
    body = p.parse_completion({"model": "m", "prompt": "hi", "n": 3, "seed": 2**63 - 2, "temperature": 0.5})
    prepared = p.prepare(body, [5, 6], context=64, vocab_size=64, default_max_tokens=16)
    got = p.choices(prepared, body.n)
    assert [c.request.sampling.seed for c in got] == [2**63 - 2, 2**63 - 1, 0]
    assert [c.choice for c in got] == [0, 1, 2]
    assert all(c.request.prompt_ids == (5, 6) and c.request.sampling.temperature == 0.5 for c in got)
    unseeded = p.prepare(
        p.parse_completion({"model": "m", "prompt": "hi", "n": 2}),
        [5],
        context=64,
        vocab_size=64,
        default_max_tokens=16,
    )
    assert [c.request.sampling.seed for c in p.choices(unseeded, 2)] == [None, None]


def test_stop_token_ids_reach_the_request_and_are_checked_against_the_vocabulary():
    body = p.parse_completion({"model": "m", "prompt": "hi", "stop_token_ids": [7, 9]})
    assert p.prepare(body, [5], context=64, vocab_size=64, default_max_tokens=16).request.stop_ids == (7, 9)
    body = p.parse_completion({"model": "m", "prompt": "hi", "stop_token_ids": [64]})
    with pytest.raises(p.ApiError, match="`stop_token_ids`: token id 64 is outside") as info:
        p.prepare(body, [5], context=64, vocab_size=64, default_max_tokens=16)
    assert info.value.param == "stop_token_ids"
    for bad, param, words in (
        (["7"], "stop_token_ids.0", "valid integer"),
        (7, "stop_token_ids", "valid list"),
        (list(range(p.MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids", f"at most {p.MAX_STOP_TOKEN_IDS} items"),
    ):
        with pytest.raises(p.ApiError) as info:
            p.parse_completion({"model": "m", "prompt": "hi", "stop_token_ids": bad})
        assert (
            info.value.param == param and f"`{param}`" in info.value.message and words in info.value.message
        )


def test_a_batch_of_prompts_is_one_prompt_each():
    from strata_runtime.weights.tokenizer import ByteTokenizer

    tok = ByteTokenizer(300)
    body = p.parse_completion({"model": "m", "prompt": ["ab", "c"]})
    assert p.prompts(body, tok, 300) == [([97, 98], "ab"), ([99], "c")]
    body = p.parse_completion({"model": "m", "prompt": [[1, 2], [3]]})
    assert p.prompts(body, tok, 300) == [([1, 2], None), ([3], None)]


def test_max_tokens_0_reads_the_prompt_alone_and_only_with_echo():
    for body in (
        p.parse_completion({"model": "m", "prompt": "hi", "max_tokens": 0}),
        p.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
    ):
        with pytest.raises(p.ApiError, match="0 only with `echo`") as info:
            p.prepare(body, [5, 6], context=64, vocab_size=64, default_max_tokens=16)
        assert info.value.param == "max_tokens"
    body = p.parse_completion({"model": "m", "prompt": "hi", "max_tokens": 0, "echo": True})
    prepared = p.prepare(body, [5, 6], context=64, vocab_size=64, default_max_tokens=16, echo="hi")
    assert (prepared.request.max_tokens, prepared.generate, prepared.echo) == (1, False, "hi")


@given(
    context=st.integers(16, 5000),
    n_prompt=st.integers(1, 6000),
    max_tokens=st.one_of(st.none(), st.integers(1, 10_000)),
)
def test_prompt_and_max_tokens_must_fit_the_context(context, n_prompt, max_tokens):
    body = p.parse_completion({"model": "m", "prompt": "x", "max_tokens": max_tokens})
    ids = [1] * n_prompt
    room = context - n_prompt
    if room < 1:
        with pytest.raises(p.ApiError) as info:
            p.prepare(body, ids, context=context, vocab_size=64, default_max_tokens=16)
        assert info.value.param == "prompt"
        assert f"the prompt is {n_prompt} tokens" in info.value.message
        assert f"the context is {context} tokens" in info.value.message
    elif max_tokens is not None and max_tokens > room:
        with pytest.raises(p.ApiError) as info:
            p.prepare(body, ids, context=context, vocab_size=64, default_max_tokens=16)
        assert info.value.param == "max_tokens"
        assert f"at most {room} can be generated" in info.value.message
    else:
        prepared = p.prepare(body, ids, context=context, vocab_size=64, default_max_tokens=16)
        expected = min(16, room) if max_tokens is None else max_tokens
        assert prepared.request.max_tokens == expected
        assert prepared.prompt_tokens == n_prompt


def test_sampling_and_stop_reach_the_engine_request():
    rng = random.Random(111)
    temperature, top_p, seed = (
        round(rng.uniform(0.1, 1.9), 3),
        round(rng.uniform(0.1, 1.0), 3),
        rng.randrange(1, 2**31),
    )
    body = p.parse_completion(
        {
            "model": "m",
            "prompt": "x",
            "max_tokens": 5,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "stop": ["\n\n", "END"],
        }
    )
    prepared = p.prepare(body, [3, 4], context=100, vocab_size=64, default_max_tokens=16)
    r = prepared.request
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.seed) == (temperature, top_p, seed)
    assert r.stop_strings == ("\n\n", "END")  # cut by the engine, as for `strata generate`
    assert r.prompt_ids == (3, 4) and not r.ignore_eos
    for parse, extra in (
        (p.parse_completion, {"prompt": "x"}),
        (p.parse_chat, {"messages": [{"role": "user"}]}),
    ):
        body = parse({"model": "m", **extra, "ignore_eos": True, "cache_salt": "tenant-7", "priority": -3})
        req = p.prepare(body, [3], context=100, vocab_size=64, default_max_tokens=16).request
        assert req.ignore_eos and req.cache_salt == "tenant-7" and req.priority == -3
    assert r.cache_salt == "" and r.priority == 0  # none given: the salt and priority of most requests
    assert r.request_id.startswith("cmpl-")
    for stop in (["a", "b", "c", "d", "e"], [""]):
        body = p.parse_completion({"model": "m", "prompt": "x", "stop": stop})
        with pytest.raises(p.ApiError, match="`stop` must be"):
            p.prepare(body, [3], context=100, vocab_size=64, default_max_tokens=16)


def test_metrics_exposition_counts_and_buckets():
    rng = random.Random(112)
    counters = metrics.ServerCounters()
    latencies = [rng.uniform(0.01, 200.0) for _ in range(rng.randrange(5, 50))]
    for s in latencies:
        counters.latency.observe(s)
    per_token = [rng.uniform(0.0005, 2.0) for _ in range(rng.randrange(5, 50))]
    for s in per_token:
        counters.per_token.observe(s)
    counters.first_token.observe(0.3)
    counters.requests["chat", "ok"] += 3
    counters.requests["completions", "client_error"] += 2
    windows, accepted, discarded = rng.randrange(1, 1000), rng.randrange(1, 500), rng.randrange(1, 50)
    stats = {
        "plan": {"mode": "serial"},
        "queue": 2,
        "slots": [
            {"slot": 0, "state": "decode"},
            {"slot": 1, "state": "free"},
            {"slot": 2, "state": "prefill"},
        ],
        "totals": {
            "windows": windows,
            "accepted": accepted,
            "ms": 1500.0,
            "discarded_rows": discarded,
            "decided_on_device": windows - 1,
        },
        "compiled_at_launch": {"kernels": 3, "seconds": 4.25, "recent": ["a<1>", "a<2>", "b<1>"]},
    }
    text = metrics.render(counters, stats, ready=True, in_flight=4)
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['strata_requests_total{endpoint="chat",outcome="ok"}'] == 3
    assert values['strata_requests_total{endpoint="completions",outcome="client_error"}'] == 2
    assert values["strata_windows_total"] == windows
    assert values["strata_proposals_accepted_total"] == accepted
    assert values["strata_window_seconds_total"] == 1.5
    assert values["strata_discarded_rows_total"] == discarded
    assert values["strata_windows_decided_on_device_total"] == windows - 1
    assert values["strata_kernels_compiled_at_launch_total"] == 3
    assert values["strata_kernel_compile_at_launch_seconds_total"] == 4.25
    assert values["strata_queue_depth"] == 2
    assert values["strata_slots"] == 3
    assert values["strata_slots_busy"] == 2
    assert values['strata_slots_by_state{state="prefill"}'] == 1
    assert values["strata_requests_in_flight"] == 4
    assert values['strata_request_seconds_bucket{le="+Inf"}'] == len(latencies)
    for bound in metrics.LATENCY_BUCKETS_S:
        expected = sum(1 for s in latencies if s <= bound)
        assert values[f'strata_request_seconds_bucket{{le="{float(bound)!r}"}}'] == expected
    assert math.isclose(values["strata_request_seconds_sum"], sum(latencies))
    for bound in metrics.TOKEN_BUCKETS_S:  # the time per token has buckets of its own
        expected = sum(1 for s in per_token if s <= bound)
        assert values[f'strata_time_per_output_token_seconds_bucket{{le="{float(bound)!r}"}}'] == expected
    assert values["strata_time_per_output_token_seconds_count"] == len(per_token)
    assert values['strata_time_to_first_token_seconds_bucket{le="0.25"}'] == 0
    assert values['strata_time_to_first_token_seconds_bucket{le="0.5"}'] == 1
    assert "# TYPE strata_windows_total counter" in text


# ---- OpenAI's optional fields, and what this server refuses by name ---------------------------------------


def test_null_optional_fields_mean_their_defaults():
    nulls = {
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "stream": None,
        "stream_options": None,
        "max_tokens": None,
        "seed": None,
        "stop": None,
        "n": None,
        "presence_penalty": None,
        "frequency_penalty": None,
        "logit_bias": None,
        "response_format": None,
        "echo": None,
    }
    body = p.parse_completion({"model": "m", "prompt": "x", **nulls})
    assert (body.temperature, body.top_p, body.top_k, body.stream, body.n) == (1.0, 1.0, 0, False, 1)
    prepared = p.prepare(body, [3], context=100, vocab_size=64, default_max_tokens=16)
    assert prepared.request.sampling == p.SamplingParams(temperature=1.0)
    assert prepared.request.max_tokens == 16 and not prepared.stream
    chat = p.parse_chat(
        {"model": "m", "messages": [{"role": "user", "content": None, "name": None}], **nulls}
    )
    assert p.chat_messages(chat) == [{"role": "user", "content": ""}]
    # A required field that is null is missing, and is said to be.
    with pytest.raises(p.ApiError, match="`model` is required"):
        p.parse_completion({"model": None, "prompt": "x"})


REFUSED = [
    # (endpoint, extra fields, param, words)
    (
        "completions",
        {"stream_options": {"include_usage": True}},
        "stream_options",
        ["only allowed", "`stream`"],
    ),
    ("chat", {"stream": False, "stream_options": {}}, "stream_options", ["`stream_options`"]),
    ("chat", {"echo": True}, "echo", ["`echo`", "not supported"]),
    ("chat", {"best_of": 3}, "best_of", ["`best_of`", "not supported"]),
    ("completions", {"best_of": 1.0}, "best_of", ["`best_of`"]),  # 1.0 is not the integer 1
    ("completions", {"logprobs": 21}, "logprobs", ["`logprobs`", "20"]),
    ("completions", {"logprobs": True}, "logprobs", ["`logprobs`"]),  # a count, not a switch, on completions
    ("chat", {"logprobs": 1}, "logprobs", ["`logprobs`"]),  # a switch on chat
    ("chat", {"top_logprobs": 2}, "top_logprobs", ["`top_logprobs`", "`logprobs` set to true"]),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", ["`top_logprobs`"]),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format", ['{"type": "json_object"}']),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema", ["an object"]),
    (
        "completions",
        {"response_format": {"type": "json_schema", "json_schema": {}}},
        "response_format.json_schema.name",
        ["`response_format.json_schema.name`", "64"],
    ),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
        "response_format.json_schema.name",
        ["letters, digits"],
    ),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
        "response_format.json_schema.schema",
        ["JSON schema (an object)"],
    ),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
        "response_format.json_schema.strict",
        ["true or false"],
    ),
    ("chat", {"response_format": "text"}, "response_format", ['{"type": "text"}']),
    ("chat", {"structured_outputs": {}}, "structured_outputs", ["exactly one of", "`choice`"]),
    (
        "completions",
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs",
        ["exactly one of"],
    ),
    (
        "chat",
        {"structured_outputs": {"whitespace_pattern": " "}},
        "structured_outputs",
        ["(not `whitespace_pattern`)"],
    ),
    ("chat", {"structured_outputs": {"choice": []}}, "structured_outputs.choice", ["one or more non-empty"]),
    (
        "chat",
        {"structured_outputs": {"choice": ["a", ""]}},
        "structured_outputs.choice",
        ["non-empty strings"],
    ),
    ("chat", {"structured_outputs": {"regex": ""}}, "structured_outputs.regex", ["non-empty string"]),
    (
        "chat",
        {"structured_outputs": {"json": "{nope"}},
        "structured_outputs.json",
        ["is not JSON", "character 1"],
    ),
    ("chat", {"structured_outputs": {"json": [1]}}, "structured_outputs.json", ["a JSON schema"]),
    ("chat", {"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object", ["must be true"]),
    (
        "chat",
        {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
        "structured_outputs",
        ["give one of `response_format`, `structured_outputs`, not several"],
    ),
    (
        "completions",
        {"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]},
        "guided_choice",
        ["give one of `structured_outputs`, `guided_choice`, not several"],
    ),
    ("chat", {"guided_choice": []}, "guided_choice", ["one or more non-empty"]),
    ("chat", {"guided_json": "{nope"}, "guided_json", ["`guided_json` is not JSON"]),
    ("completions", {"guided_regex": 7}, "guided_regex", ["non-empty string"]),
    (
        "chat",
        {"typical_p": 0.5},
        "typical_p",
        ["`typical_p` is not supported by this server (leave it out or send 1)"],
    ),
    ("chat", {"min_p": 1.5}, "min_p", ["`min_p`", "less than or equal to 1"]),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty", ["`repetition_penalty`", "0.001"]),
    ("completions", {"min_tokens": -1}, "min_tokens", ["`min_tokens`"]),
    ("chat", {"use_beam_search": True}, "use_beam_search", ["send false)"]),
    ("chat", {"allowed_token_ids": []}, "allowed_token_ids", ["`allowed_token_ids`"]),
    ("chat", {"bad_words": "no"}, "bad_words", ["`bad_words`"]),
    ("chat", {"bad_words": ["fine", 7]}, "bad_words.1", ["`bad_words.1`"]),
    ("completions", {"bad_words": ["x"] * 257}, "bad_words", ["`bad_words`"]),
    ("completions", {"repeat_penalty": 1.2}, "repeat_penalty", ["`repeat_penalty`"]),
    ("chat", {"presence_penalty": 2.5}, "presence_penalty", ["`presence_penalty`", "less than"]),
    ("completions", {"frequency_penalty": -3}, "frequency_penalty", ["`frequency_penalty`"]),
    ("completions", {"logit_bias": {"65": "up"}}, "logit_bias", ["`logit_bias`", "number"]),
    ("completions", {"logit_bias": [65]}, "logit_bias", ["`logit_bias`"]),
]


@pytest.mark.parametrize(("endpoint", "extra", "param", "words"), REFUSED)
def test_fields_that_would_change_the_answer_are_refused_by_name(endpoint, extra, param, words):
    base = {"prompt": "x"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "x"}]}
    parse = p.parse_completion if endpoint == "completions" else p.parse_chat
    with pytest.raises(p.ApiError) as info:
        parse({"model": "m", **base, **extra})
    assert (info.value.status, info.value.param) == (400, param)
    for w in words:
        assert w in info.value.message


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_sampling_fields_this_server_lacks_are_accepted_where_they_ask_for_nothing(endpoint):
    """A client that always sends vLLM's or llama.cpp's sampling extras at their neutral values (``min_p``
    0, ``repetition_penalty`` 1, ...) is served; the same fields asking for anything are refused above."""
    base = {"prompt": "x"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "x"}]}
    parse = p.parse_completion if endpoint == "completions" else p.parse_chat
    neutral = {name: values[0] for name, values in p.NOT_SAMPLED_HERE.items() if values}
    neutral |= {"min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "allowed_token_ids": None}
    body = parse({"model": "m", **base, **neutral})
    got = p.prepare(body, [1, 2], context=64, vocab_size=300, default_max_tokens=None)
    assert (
        got.request.sampling
        == p.prepare(
            parse({"model": "m", **base}), [1, 2], context=64, vocab_size=300, default_max_tokens=None
        ).request.sampling
    )


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bad_words_reach_the_request_and_a_blank_one_is_refused(endpoint):
    base = {"prompt": "x"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "x"}]}
    parse = p.parse_completion if endpoint == "completions" else p.parse_chat
    got = p.prepare(
        parse({"model": "m", **base, "bad_words": ["sorry", " I cannot"]}),
        [1, 2],
        context=64,
        vocab_size=300,
        default_max_tokens=None,
    )
    assert got.request.sampling.bad_words == ("sorry", " I cannot")
    with pytest.raises(p.ApiError) as info:
        p.prepare(
            parse({"model": "m", **base, "bad_words": ["ok", "  "]}),
            [1, 2],
            context=64,
            vocab_size=300,
            default_max_tokens=None,
        )
    assert info.value.param == "bad_words" and "blank" in info.value.message


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_min_p_the_repetition_penalty_and_min_tokens_reach_the_request(endpoint):
    """vLLM's ``min_p``, ``repetition_penalty`` and ``min_tokens`` are the request's; ``min_tokens`` past
    the tokens the reply may have (``max_tokens``, or what the context leaves) is refused by name."""
    base = {"prompt": "x"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "x"}]}
    parse = p.parse_completion if endpoint == "completions" else p.parse_chat
    extra = {"min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4}
    got = p.prepare(
        parse({"model": "m", **base, **extra}), [1, 2], context=64, vocab_size=300, default_max_tokens=None
    )
    s = got.request.sampling
    assert (s.min_p, s.repetition_penalty, s.min_tokens) == (0.05, 1.1, 4)
    for body, room in (({"max_tokens": 3}, 3), ({}, 62)):
        asked = parse({"model": "m", **base, **body, "min_tokens": room + 1})
        with pytest.raises(p.ApiError) as info:
            p.prepare(asked, [1, 2], context=64, vocab_size=300, default_max_tokens=None)
        assert info.value.param == "min_tokens" and f"({room})" in info.value.message


def test_truncate_prompt_tokens_include_stop_str_and_allowed_token_ids_reach_the_request():
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens (-1: as many as the context holds with
    room for a token), counted as the prompt in the usage; 0, or with ``echo``, is refused by name.
    ``include_stop_str_in_output`` reaches the request, and so does ``allowed_token_ids``, whose ids
    outside the vocabulary are refused by name."""
    ids = list(range(1, 11))
    base = {"model": "m", "prompt": "x"}

    def prepared(**extra):
        return p.prepare(
            p.parse_completion({**base, **extra}), ids, context=8, vocab_size=300, default_max_tokens=1
        )

    got = prepared(truncate_prompt_tokens=4)
    assert got.request.prompt_ids == (7, 8, 9, 10) and got.prompt_tokens == 4
    assert prepared(truncate_prompt_tokens=-1).request.prompt_ids == tuple(range(4, 11))
    with pytest.raises(p.ApiError) as info:  # more than the prompt holds: the whole prompt, too long here
        prepared(truncate_prompt_tokens=20)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(p.ApiError) as info:
        prepared(truncate_prompt_tokens=0)
    assert info.value.param == "truncate_prompt_tokens" and "must be at least 1, or -1" in info.value.message
    with pytest.raises(p.ApiError) as info:
        p.prepare(
            p.parse_completion({**base, "truncate_prompt_tokens": 3, "echo": True, "max_tokens": 1}),
            ids,
            context=64,
            vocab_size=300,
            default_max_tokens=1,
            echo="x",
        )
    assert info.value.param == "echo" and "cannot be given with `echo`" in info.value.message
    assert prepared(
        truncate_prompt_tokens=4, allowed_token_ids=[5, 7]
    ).request.sampling.allowed_token_ids == (5, 7)
    with pytest.raises(p.ApiError) as info:
        prepared(truncate_prompt_tokens=4, allowed_token_ids=[5, 300])
    assert info.value.param == "allowed_token_ids" and "outside the vocabulary" in info.value.message
    assert not prepared(truncate_prompt_tokens=4).request.keep_stop
    assert prepared(truncate_prompt_tokens=4, include_stop_str_in_output=True).request.keep_stop


def test_vllms_earlier_guided_fields_hold_the_reply_as_structured_outputs_does():
    """``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar`` (vLLM's fields before
    ``structured_outputs``, which older clients still send) give the same grammar as the key they stand
    for; ignored, they would leave the reply free."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    cases = [
        ("guided_json", schema, {"json": schema}),
        ("guided_json", json.dumps(schema), {"json": schema}),
        ("guided_regex", "[a-z]+", {"regex": "[a-z]+"}),
        ("guided_choice", ["yes", "no"], {"choice": ["yes", "no"]}),
        ("guided_grammar", 'root ::= "a" | "b"', {"grammar": 'root ::= "a" | "b"'}),
    ]
    for name, value, same in cases:
        for endpoint in ("completions", "chat"):
            base = (
                {"prompt": "x"}
                if endpoint == "completions"
                else {"messages": [{"role": "user", "content": "x"}]}
            )
            parse = p.parse_completion if endpoint == "completions" else p.parse_chat
            guided = parse({"model": "m", **base, name: value})
            grammar = p.grammar_of(guided)
            assert grammar is not None and grammar == p.grammar_of(
                parse({"model": "m", **base, "structured_outputs": same})
            )
            assert p.grammar_field(guided) == name


def test_response_format_asks_the_engine_for_json_that_follows_its_schema():
    """``json_object`` asks for any JSON object, ``json_schema`` for JSON that follows its schema (any object
    where it gives none), laid out compactly; ``text`` for free text, on both endpoints."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    formats = [
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"type": "object"}),
        ({"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}, schema),
        ({"type": "json_schema", "json_schema": {"name": "any-1"}}, {"type": "object"}),
    ]
    for fmt, want in formats:
        chat = p.parse_chat(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": fmt}
        )
        completion = p.parse_completion({"model": "m", "prompt": "x", "response_format": fmt})
        for body in (chat, completion):
            got = p.prepare(body, [1, 2], context=64, vocab_size=300, default_max_tokens=None)
            grammar = got.request.sampling.grammar
            if want is None:
                assert grammar is None
            else:
                (entry,) = json.loads(grammar)["grammars"]
                assert entry["json_schema"] == {**want, "x-guidance": {"whitespace_flexible": False}}
                assert json_grammar(want) == grammar


def test_structured_outputs_ask_the_engine_for_a_schema_a_regex_a_choice_or_a_lark_grammar():
    """vLLM's ``structured_outputs`` extension: each kind gives the grammar `strata_runtime.structured`
    writes for it, on both endpoints, and a compile failure names the kind's field."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    kinds = [
        ({"json": schema}, json_grammar(schema)),
        ({"json": json.dumps(schema)}, json_grammar(schema)),
        ({"json_object": True}, json_grammar()),
        ({"regex": r"\d{3}"}, regex_grammar(r"\d{3}")),
        ({"choice": ["yes", "no"]}, choice_grammar(["yes", "no"])),
        ({"grammar": 'start: "a" | "b"'}, lark_grammar('start: "a" | "b"')),
    ]
    for asked, want in kinds:
        for raw in (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "structured_outputs": asked},
            {"model": "m", "prompt": "x", "structured_outputs": asked, "response_format": {"type": "text"}},
        ):
            body = p.parse_chat(raw) if "messages" in raw else p.parse_completion(raw)
            got = p.prepare(body, [1, 2], context=64, vocab_size=300, default_max_tokens=None)
            assert got.request.sampling.grammar == want
            assert p.grammar_field(body) == f"structured_outputs.{next(iter(asked))}"
    plain = p.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert p.grammar_field(plain) == "response_format.json_schema.schema"


def test_response_format_text_and_neutral_values_are_accepted():
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    p.parse_chat(
        {**chat, "response_format": {"type": "text"}, "echo": False, "best_of": 1, "logprobs": False}
    )
    p.parse_completion(
        {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    )


def test_penalties_and_logit_bias_reach_the_engine_request():
    rng = random.Random(113)
    presence, frequency = round(rng.uniform(-2, 2), 3), round(rng.uniform(-2, 2), 3)
    vocab = rng.randrange(300, 1000)
    bias = {str(rng.randrange(vocab)): round(rng.uniform(-100, 100), 2) for _ in range(5)}
    bias[str(vocab - 1)] = 100  # an integer bias is a number too
    body = p.parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "presence_penalty": presence,
            "frequency_penalty": frequency,
            "logit_bias": bias,
        }
    )
    s = p.prepare(body, [3], context=100, vocab_size=vocab, default_max_tokens=None).request.sampling
    assert (s.presence_penalty, s.frequency_penalty) == (presence, frequency)
    assert dict(s.logit_bias) == {int(k): float(v) for k, v in bias.items()}


@pytest.mark.parametrize(
    ("bias", "words"),
    [
        ({"abc": 1}, ["'abc' is not a token id"]),
        ({"-1": 1}, ["'-1' is not a token id"]),
        ({"007": 1}, ["'007' is not a token id"]),
        ({"64": 1}, ["token id 64 is outside the vocabulary [0, 64)"]),
        ({"5": 100.5}, ["the bias of token 5 is 100.5", "[-100, 100]"]),
        ({"5": float("nan")}, ["the bias of token 5 is nan"]),
    ],
)
def test_a_bad_logit_bias_names_the_key(bias, words):
    body = p.parse_completion({"model": "m", "prompt": "x", "logit_bias": bias})
    with pytest.raises(p.ApiError) as info:
        p.prepare(body, [3], context=100, vocab_size=64, default_max_tokens=16)
    assert (info.value.status, info.value.param) == (400, "logit_bias")
    for w in words:
        assert w in info.value.message


# ---- hostile bodies ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": "a\ud800b"}, "prompt"),
        ({"model": "m", "prompt": ["ok", "\udfff"]}, "prompt.1"),
        ({"model": "m", "prompt": "x", "stop": ["fine", "bad\ud83d"]}, "stop.1"),
        ({"model": "m", "prompt": "x", "user": "\ud800"}, "user"),  # an ignored field is checked too
        ({"model": "m\ud800", "prompt": "x"}, "model"),
    ],
)
def test_a_lone_surrogate_is_refused_naming_the_field(body, param):
    with pytest.raises(p.ApiError) as info:
        p.parse_completion(body)
    assert (info.value.status, info.value.param) == (400, param)
    assert f"`{param}` is not valid Unicode text" in info.value.message
    assert "lone surrogate U+D" in info.value.message


def test_a_lone_surrogate_in_a_chat_message_names_the_message():
    for content, param in (
        ("hi \ud800", "messages.1.content"),
        ([{"type": "text", "text": "\udc00"}], "messages.1.content.0.text"),
    ):
        body = {
            "model": "m",
            "messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": content}],
        }
        with pytest.raises(p.ApiError) as info:
            p.parse_chat(body)
        assert info.value.param == param
    # A valid pair (an emoji as JSON spells it) is text.
    assert p.parse_chat({"model": "m", "messages": [{"role": "user", "content": "\U0001f600"}]})


def test_a_body_nested_too_deep_is_refused_without_recursing():
    deep: object = 1
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(p.ApiError) as info:
        p.parse_completion({"model": "m", "prompt": "x", "metadata": deep})
    assert (info.value.status, info.value.param) == (400, "metadata")
    assert f"more than {p.MAX_DEPTH} deep" in info.value.message
    shallow: object = "leaf"
    for _ in range(p.MAX_DEPTH - 1):  # the body itself is one level
        shallow = {"k": shallow}
    p.parse_completion({"model": "m", "prompt": "x", "metadata": shallow})


# ---- the expert cache in /v1/status and /metrics -----------------------------------------------------------


def _expert_stats(rng: random.Random) -> dict:
    """An engine's stats() with two stages on two GPUs and a third stage sharing the second GPU."""

    def stage(device: str, layers: list[int]) -> dict:
        hits, misses = rng.randrange(1, 10_000), rng.randrange(1, 5_000)
        expert = rng.randrange(1 << 20, 1 << 24)
        return {
            "device": device,
            "layers": layers,
            "experts": 128,
            "slots": rng.randrange(16, 512),
            "cached": True,
            "expert_bytes": expert,
            "host_bytes": 128 * len(layers) * expert,
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses),
            "swaps": rng.randrange(0, 300),
            "kept": rng.randrange(1, 300),
            "windows": rng.randrange(1, 900),
            "miss_bytes": misses * expert,
            "swap_bytes": rng.randrange(0, 300) * expert,
            "late_reads": rng.randrange(1, misses + 1),
        }

    return {
        "totals": {"tokens": rng.randrange(100, 10_000)},
        "experts": [stage("cuda:0", [0, 1, 2]), stage("cuda:1", [3, 4]), stage("cuda:1", [5])],
    }


def test_expert_cache_entries_get_host_link_bytes_per_generated_token():
    stats = _expert_stats(random.Random(114))
    tokens = stats["totals"]["tokens"]
    shown = metrics.expert_cache(stats)
    assert len(shown) == 3
    for reported, entry in zip(stats["experts"], shown, strict=True):
        assert {k: entry[k] for k in reported} == reported  # every field as the engine gave it
        moved = reported["miss_bytes"] + reported["swap_bytes"]
        assert entry["host_link_bytes"] == moved
        assert entry["host_link_bytes_per_token"] == moved / tokens
    assert (
        metrics.expert_cache({"experts": stats["experts"], "totals": {"tokens": 0}})[0][
            "host_link_bytes_per_token"
        ]
        is None
    )
    assert metrics.expert_cache({}) == []


def test_metrics_report_the_expert_cache_per_gpu():
    stats = _expert_stats(random.Random(115))
    text = metrics.render(metrics.ServerCounters(), stats, ready=True, in_flight=0)
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[0] != "#"
    }
    for device in ("cuda:0", "cuda:1"):
        stages = [e for e in stats["experts"] if e["device"] == device]
        hits, misses = sum(e["hits"] for e in stages), sum(e["misses"] for e in stages)
        label = f'{{device="{device}"}}'
        assert values[f"strata_expert_hits_total{label}"] == hits
        assert values[f"strata_expert_misses_total{label}"] == misses
        assert values[f"strata_expert_swaps_total{label}"] == sum(e["swaps"] for e in stages)
        assert values[f"strata_expert_kept_total{label}"] == sum(e["kept"] for e in stages)
        moved = sum(e["miss_bytes"] + e["swap_bytes"] for e in stages)
        assert values[f"strata_expert_host_bytes_total{label}"] == moved
        assert values[f"strata_expert_late_reads_total{label}"] == sum(e["late_reads"] for e in stages)
        assert math.isclose(values[f"strata_expert_hit_ratio{label}"], hits / (hits + misses))
    assert "# TYPE strata_expert_hits_total counter" in text
    assert "# TYPE strata_expert_hit_ratio gauge" in text
    # No expert cache, no expert metrics; a device with no lookups yet has no ratio.
    assert "strata_expert" not in metrics.render(metrics.ServerCounters(), {}, ready=True, in_flight=0)
    idle = {"experts": [{**stats["experts"][0], "hits": 0, "misses": 0}]}
    idle_text = metrics.render(metrics.ServerCounters(), idle, ready=True, in_flight=0)
    assert 'strata_expert_hits_total{device="cuda:0"} 0' in idle_text
    assert "strata_expert_hit_ratio{" not in idle_text


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NOW = {"type": "function", "function": {"name": "now"}}

BAD_TOOLS = [
    # (extra fields of a chat body, param, words the message must contain)
    ({"tools": {"name": "f"}}, "tools", ["a list of tools"]),
    ({"tools": [{"type": "function"}]}, "tools.0", ["`tools.0.function` must be an object"]),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools.0", ['"type": "function"']),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", ["1 to 64"]),
    ({"tools": [NOW, NOW]}, "tools.1.function.name", ["two tools are named `now`"]),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
        "tools.0.function.parameters",
        ["a JSON schema"],
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]},
        "tools.0.function.strict",
        [],
    ),
    ({"tools": [NOW] * 129}, "tools", ["at most 128"]),
    ({"tool_choice": "required"}, "tool_choice", ['"required" needs `tools`']),
    ({"tools": [NOW], "tool_choice": "always"}, "tool_choice", ['"none", "auto", "required"']),
    (
        {"tools": [NOW], "tool_choice": {"type": "function", "function": {"name": "later"}}},
        "tool_choice.function.name",
        ["no tool is named `later`", "`now`"],
    ),
    ({"tools": [NOW], "parallel_tool_calls": "no"}, "parallel_tool_calls", ["true or false"]),
    (
        {"tools": [NOW], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        ["`response_format` or `structured_outputs`"],
    ),
]


@pytest.mark.parametrize(("extra", "param", "words"), BAD_TOOLS)
def test_bad_tools_name_the_field(extra, param, words):
    body = p.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})
    with pytest.raises(p.ApiError) as info:
        tool_use(body.model_extra or {}, p.grammar_of(body))
    assert (info.value.status, info.value.param) == (400, param)
    for w in words:
        assert w in info.value.message


def _tools_prepared(**extra) -> p.Prepared:
    body = p.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})
    tools = tool_use(body.model_extra or {}, p.grammar_of(body))
    return p.prepare(body, [1, 2], context=64, vocab_size=300, default_max_tokens=None, tools=tools)


def test_tool_choice_decides_what_the_prompt_offers_and_what_the_reply_is_held_to():
    """ "auto" (the default with tools) offers them and holds nothing; "none" offers none; "required" and
    a named function hold the reply to calls; no tools, or an empty list, is a chat without tools."""
    auto = _tools_prepared(tools=[WEATHER, NOW])
    assert auto.tools is not None and auto.tools.choice == "auto" and auto.tools.offered == [WEATHER, NOW]
    assert auto.request.sampling.grammar is None
    assert _tools_prepared(tools=[WEATHER], tool_choice="none").tools is None
    assert _tools_prepared(tools=[]).tools is None and _tools_prepared(tool_choice="none").tools is None
    required = _tools_prepared(tools=[WEATHER, NOW], tool_choice="required")
    named = _tools_prepared(
        tools=[WEATHER, NOW], tool_choice={"type": "function", "function": {"name": "now"}}
    )
    for prepared in (required, named):
        assert prepared.tools is not None and prepared.request.sampling.grammar == prepared.tools.grammar
    # Without a structured output the reply's text is free: `response_format` text is no grammar.
    free = _tools_prepared(tools=[NOW], tool_choice="required", response_format={"type": "text"})
    assert free.request.sampling.grammar is not None


def _walk(grammar: str, text: str) -> str:
    """Where ``text`` leaves ``grammar`` ("ok" where it follows it whole and may end there)."""
    tok = ByteTokenizer(300)
    matcher = grammars_for(tok, 300).matcher(grammar)
    for i, b in enumerate(text.encode()):
        if not matcher.allowed()[b]:
            return f"off at {i}: {text[i:]!r}"
        matcher.accept([b])
    return "ok" if matcher.allowed()[tok.eos_ids[0]] else "unfinished"


def test_a_required_call_follows_the_tools_parameters_in_the_templates_layout():
    """The grammar of "required": one call or more, a line apart, each to an offered tool with arguments
    that follow its parameters (none: an empty object), laid out as chat templates write calls; with
    ``parallel_tool_calls`` false exactly one; a named function only that function."""
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bath"}}\n</tool_call>'
    now = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    grammar = _tools_prepared(tools=[WEATHER, NOW], tool_choice="required").request.sampling.grammar
    assert grammar is not None
    assert _walk(grammar, weather) == "ok" and _walk(grammar, now + "\n" + weather) == "ok"
    assert _walk(grammar, "Sure. " + now).startswith("off at 0")
    at = weather.index('"Bath"')
    assert _walk(grammar, weather.replace('"Bath"', "3")).startswith(f"off at {at}:")  # city is a string
    at = weather.index(": ") + 1
    assert _walk(grammar, weather.replace(": ", ":")).startswith(f"off at {at}:")  # the layout's blanks
    assert _walk(grammar, now.replace("{}", '{"x": 1}')).startswith("off at")  # `now` takes no arguments
    assert _walk(grammar, now[:-3]) == "unfinished"
    one = _tools_prepared(tools=[WEATHER, NOW], tool_choice="required", parallel_tool_calls=False)
    assert _walk(one.request.sampling.grammar, now) == "ok"
    assert _walk(one.request.sampling.grammar, now + "\n" + now).startswith("off at")
    named = _tools_prepared(
        tools=[WEATHER, NOW], tool_choice={"type": "function", "function": {"name": "now"}}
    )
    assert _walk(named.request.sampling.grammar, now) == "ok"
    assert _walk(named.request.sampling.grammar, weather).startswith(f"off at {weather.index('get')}:")


def test_earlier_calls_and_tool_answers_reach_the_template():
    body = p.parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "done"}]},
            ],
        }
    )
    messages = p.chat_messages(body)
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
        ],
    }
    assert messages[2] == {"role": "tool", "content": "done", "tool_call_id": "c1"}


def test_a_reply_with_calls_is_answered_with_tool_calls():
    call = ToolCall("now", "{}")
    body = p.choice(True, 0, None, "tool_calls", None, [call])
    assert body["message"] == {"role": "assistant", "content": None, "tool_calls": [call.openai()]}
    assert body["finish_reason"] == "tool_calls"
    assert "tool_calls" not in p.choice(True, 0, "hi", "stop")["message"]


def test_a_grammar_may_be_written_in_gbnf_as_llama_cpp_and_vllm_take_it():
    """``structured_outputs.grammar`` in GBNF (a ``root ::=`` rule) holds the reply as the same grammar in
    Lark does; text that is neither is a 400 naming the field before anything reaches the engine."""
    gbnf = 'root ::= "Mr. " name\nname ::= [A-Z] [a-z]+'
    lark = 'start: "Mr. " name\nname: /[A-Z]/ /[a-z]/+'
    for text in (gbnf, lark):
        body = p.parse_chat(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "structured_outputs": {"grammar": text},
            }
        )
        grammar = p.prepare(
            body, [1, 2], context=64, vocab_size=300, default_max_tokens=None
        ).request.sampling.grammar
        assert grammar is not None
        assert _walk(grammar, "Mr. Darcy") == "ok" and _walk(grammar, "Mr. ") == "unfinished"
        assert _walk(grammar, "Mrs. Bennet").startswith("off at 2:") and _walk(
            grammar, "Mr. darcy"
        ).startswith("off at 4:")
    with pytest.raises(p.ApiError) as info:
        p.parse_chat(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "structured_outputs": {"grammar": "root = x"},
            }
        )
    assert info.value.param == "structured_outputs.grammar" and "nor GBNF" in info.value.message


def test_streamed_calls_are_numbered_from_the_replys_first_even_when_one_piece_closes_two():
    """The ``index`` of a streamed ``tool_calls`` delta counts the reply's calls: two calls closed by one
    piece get consecutive indices, and a call in a later piece the next one."""
    from strata_runtime.chat import call_text
    from strata_runtime.server.openai_stream import _deltas
    from strata_runtime.server.replies import Choice, reply_parts

    c = Choice(0, _tools_prepared(tools=[WEATHER, NOW]))
    first = "Checking. " + call_text("now", {}) + "\n" + call_text("get_weather", {"city": "Bath"})
    deltas = _deltas(c, reply_parts(c, first, False))
    assert deltas[0] == {"content": "Checking."}
    assert [(d["tool_calls"][0]["index"], d["tool_calls"][0]["function"]["name"]) for d in deltas[1:]] == [
        (0, "now"),
        (1, "get_weather"),
    ]
    (later,) = _deltas(c, reply_parts(c, "\n" + call_text("now", {}), True))
    assert later["tool_calls"][0]["index"] == 2
