"""The OpenAI wire format, without a server: what each bad body is told, and what a good one becomes.

These are pure functions; the tests that the same errors reach a real client over HTTP, and that the engine
keeps serving afterwards, are in test_srv_openai.py.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata_runtime.server import metrics
from strata_runtime.server import protocol as p

BAD_COMPLETIONS = [
    # (body, status, param, words the message must contain)
    ({"prompt": "hi"}, 400, "model", ["`model`", "required"]),
    ({"model": "m"}, 400, "prompt", ["`prompt`", "required"]),
    ({"model": "m", "prompt": "hi", "max_tokens": -3}, 400, "max_tokens", ["`max_tokens`", "greater than"]),
    ({"model": "m", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", ["`max_tokens`"]),
    ({"model": "m", "prompt": "hi", "max_tokens": "12"}, 400, "max_tokens", ["`max_tokens`", "integer"]),
    ({"model": "m", "prompt": "hi", "max_tokens": True}, 400, "max_tokens", ["`max_tokens`", "integer"]),
    ({"model": "m", "prompt": "hi", "temperature": 7.5}, 400, "temperature", ["`temperature`", "less than"]),
    ({"model": "m", "prompt": "hi", "temperature": "hot"}, 400, "temperature", ["`temperature`", "number"]),
    ({"model": "m", "prompt": "hi", "top_p": 0}, 400, "top_p", ["`top_p`", "greater than"]),
    ({"model": "m", "prompt": "hi", "seed": -1}, 400, "seed", ["`seed`"]),
    ({"model": "m", "prompt": "hi", "stop": 5}, 400, "stop", ["`stop`", "list of up to 4 strings"]),
    ({"model": "m", "prompt": 42}, 400, "prompt", ["`prompt`", "token ids"]),
    ({"model": "m", "prompt": "hi", "n": 3}, 400, "n", ["`n` must be 1"]),
    ({"model": "m", "prompt": "hi", "echo": True}, 400, "echo", ["`echo`", "not supported"]),
    ({"model": "m", "prompt": "hi", "best_of": 2}, 400, "best_of", ["`best_of`", "not supported"]),
    ({"model": "m", "prompt": "hi", "stream": "yes"}, 400, "stream", ["`stream`", "boolean"]),
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
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        "tools",
        ["`tools`", "not supported"],
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
    assert p.prompt_ids(body, tokenizer=None, vocab_size=vocab) == ids  # type: ignore[arg-type]
    body = p.parse_completion({"model": "m", "prompt": [*ids, vocab]})
    with pytest.raises(p.ApiError, match=f"token id {vocab} is outside"):
        p.prompt_ids(body, tokenizer=None, vocab_size=vocab)  # type: ignore[arg-type]
    body = p.parse_completion({"model": "m", "prompt": ["a", "b"]})
    with pytest.raises(p.ApiError, match="one prompt per request"):
        p.prompt_ids(body, tokenizer=None, vocab_size=vocab)  # type: ignore[arg-type]


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
    assert r.prompt_ids == (3, 4)
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
    counters.requests["chat", "ok"] += 3
    counters.requests["completions", "client_error"] += 2
    windows, accepted = rng.randrange(1, 1000), rng.randrange(1, 500)
    stats = {
        "plan": {"mode": "serial"},
        "queue": 2,
        "slots": [
            {"slot": 0, "state": "decode"},
            {"slot": 1, "state": "free"},
            {"slot": 2, "state": "prefill"},
        ],
        "totals": {"windows": windows, "accepted": accepted, "ms": 1500.0},
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
    assert "# TYPE strata_windows_total counter" in text
