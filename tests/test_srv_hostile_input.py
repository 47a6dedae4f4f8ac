"""A hostile client against the real demo engine's server, in process: text that is not Unicode, a body
nested 100,000 deep, a half-closed connection, an oversized header, a key in the query string. Each gets a
400 in OpenAI's error JSON naming the field, or a clean close; none makes the server log a traceback, and the
engine keeps serving. Also the fields that change the answer (nulls, logit_bias), the engine id in /health,
and the expert cache in /v1/status and /metrics, from a stats dict the test gives the engine.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from srv_helpers import DEMO, http, wait_for

from strata_cfg.plan.from_profile import resolve_profile
from strata_runtime.engine import Engine
from strata_runtime.server import ServeOptions, Server

ENGINE_ID = "hostile-test-engine"
EXPERTS = [
    {
        "device": "cpu:1",
        "layers": [2, 3],
        "experts": 8,
        "slots": 6,
        "cached": True,
        "expert_bytes": 4096,
        "host_bytes": 65536,
        "hits": 900,
        "misses": 100,
        "hit_rate": 0.9,
        "swaps": 7,
        "windows": 50,
        "miss_bytes": 100 * 4096,
        "swap_bytes": 7 * 4096,
    }
]
"""What the engine reports for its expert cache here (the demo model has none of its own)."""


class _EngineWithExperts(Engine):
    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "experts": EXPERTS}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    plan = resolve_profile(DEMO)
    options = ServeOptions("127.0.0.1", 0, "demo", None, engine_id=ENGINE_ID)
    server = Server(plan, lambda progress: _EngineWithExperts(plan, progress=progress), options)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=lambda: loop.run_until_complete(server.serve(stop)), daemon=True)
    thread.start()
    wait_for(lambda: server.engine is not None and server.engine.state == "ready", 60, "the engine")
    yield f"http://127.0.0.1:{server.port}"
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO)
    return caplog


def _no_traceback(logs: pytest.LogCaptureFixture) -> None:
    bad = [r for r in logs.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


def _raw(url: str, data: bytes, *, half_close: bool = False, timeout: float = 30.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def _post(path: str, body: bytes) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def _error(response: bytes) -> tuple[int, dict[str, Any]]:
    """(status, error object) of a raw HTTP response that must be OpenAI's error JSON."""
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), head
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return status, error


def _still_serving(url: str) -> None:
    body = json.dumps({"model": "demo", "prompt": "still there?", "max_tokens": 3, "temperature": 0}).encode()
    status, reply = http("POST", f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    assert status == 200, reply


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", rb'{"model": "demo", "prompt": "a\ud800b", "max_tokens": 2}', "prompt"),
        (
            "/v1/chat/completions",
            rb'{"model": "demo", "messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2}',
            "messages.0.content",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(url, logs, path, body, param):
    status, error = _error(_raw(url, _post(path, body)))
    assert (status, error["param"]) == (400, param)
    assert "not valid Unicode text" in error["message"]
    _no_traceback(logs)
    _still_serving(url)


def test_a_body_nested_100000_deep_is_a_400(url, logs):
    deep = b'{"model": "demo", "prompt": "x", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, error = _error(_raw(url, _post("/v1/completions", deep)))
    assert status == 400 and "nests arrays or objects more than" in error["message"]
    _no_traceback(logs)
    _still_serving(url)


@pytest.mark.parametrize("stream", [True, False])
def test_a_half_closed_request_is_a_clean_close(url, logs, stream):
    # The client sends its request and shuts its side: the server takes that as the client going away,
    # cancels the request and closes the connection, with no traceback.
    body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 200, "stream": stream}
    for _ in range(3):
        reply = _raw(url, _post("/v1/completions", json.dumps(body).encode()), half_close=True)
        assert reply == b"" or reply.startswith(b"HTTP/1.1 200"), reply[:200]
    wait_for(lambda: _in_flight(url) == 0, 30, "the cancelled requests to be let go")
    time.sleep(0.3)  # a traceback would be logged as the handler unwinds
    _no_traceback(logs)
    _still_serving(url)


def _in_flight(url: str) -> int:
    status, body = http("GET", f"{url}/v1/status")
    assert status == 200
    return int(json.loads(body)["requests_in_flight"])


def test_an_oversized_header_gets_the_json_error_shape(url, logs):
    secret = "k" * 20_000
    request = f"GET /v1/models HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {secret}\r\n\r\n".encode()
    response = _raw(url, request)
    status, error = _error(response)
    assert status == 400 and "header is longer than" in error["message"]
    assert b"kkkk" not in response  # the refusal does not echo the header back
    _no_traceback(logs)
    assert not any("kkkk" in r.getMessage() for r in logs.records)


def test_the_access_log_never_shows_a_query_string(url, logs):
    key = "sk-in-the-query-6f1c2a"
    status, _ = http("GET", f"{url}/v1/models?api_key={key}&x=1")
    assert status == 200

    def lines() -> list[str]:
        return [r.getMessage() for r in logs.records if "/v1/models" in r.getMessage()]

    wait_for(lambda: bool(lines()), 10, "the access log line")  # written just after the reply is sent
    assert all(key not in line for line in lines())
    assert any('"GET /v1/models?<redacted> HTTP/1.1" 200' in line for line in lines())
    assert not any(key in r.getMessage() for r in logs.records)


def test_health_names_the_engine(url):
    status, body = http("GET", f"{url}/health")
    assert status == 200 and json.loads(body) == {"status": "ok", "model": "demo", "engine_id": ENGINE_ID}


def test_null_fields_are_their_defaults_and_logit_bias_steers_the_reply(url):
    body = {
        "model": "demo",
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": None,
        "top_p": None,
        "stream": None,
        "stop": None,
        "seed": None,
        "logit_bias": {str(ord("Z")): 100},
    }
    status, reply = http(
        "POST", f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    assert status == 200, reply
    assert json.loads(reply)["choices"][0]["text"] == "Z" * 12  # sampled at temperature 1, but +100 wins


def test_status_and_metrics_show_the_expert_cache(url):
    _still_serving(url)  # a few generated tokens to divide by
    status = json.loads(http("GET", f"{url}/v1/status")[1])
    tokens = status["engine"]["totals"]["tokens"]
    assert tokens > 0
    [entry] = status["experts"]
    assert {k: entry[k] for k in EXPERTS[0]} == EXPERTS[0]
    moved = EXPERTS[0]["miss_bytes"] + EXPERTS[0]["swap_bytes"]
    assert entry["host_link_bytes"] == moved
    assert entry["host_link_bytes_per_token"] == moved / tokens  # the same snapshot's tokens
    text = http("GET", f"{url}/metrics")[1].decode()
    assert 'strata_expert_hits_total{device="cpu:1"} 900' in text
    assert 'strata_expert_misses_total{device="cpu:1"} 100' in text
    assert f'strata_expert_host_bytes_total{{device="cpu:1"}} {moved}' in text
    assert 'strata_expert_hit_ratio{device="cpu:1"} 0.9' in text


VALID = {
    "/v1/completions": {"model": "demo", "prompt": "Hello", "max_tokens": 3, "temperature": 0},
    "/v1/chat/completions": {
        "model": "demo",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
    },
    "/v1/messages": {"model": "demo", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/responses": {"model": "demo", "input": "Hi", "max_output_tokens": 3},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [65, 66]},
}
"""A valid body of each POST path, which `test_random_malformed_fields_never_fail_the_server` corrupts."""
FIELDS = [
    "n", "stop", "seed", "logprobs", "top_logprobs", "echo", "stream", "stream_options", "logit_bias",
    "presence_penalty", "frequency_penalty", "top_p", "top_k", "min_p", "response_format", "tools",
    "tool_choice", "suffix", "best_of", "max_completion_tokens", "temperature", "max_tokens", "prompt",
    "messages", "system", "input", "instructions", "background", "store", "metadata", "tokens", "reasoning",
    "thinking", "text", "ignore_eos", "priority", "cache_salt", "parallel_tool_calls", "stop_sequences",
    "include", "truncation",
]  # fmt: skip
HOSTILE: list[Any] = [
    None, -1, 0, 2**31, 10**30, -(10**30), 1.5, -0.5, 1e308, "", "\u0000", "a" * 5000, [], [None], [1, "a"],
    {}, {"a": 1}, {"type": None}, True, [[1, 2]], [{"role": "user"}], [{"role": "tool", "content": 3}],
    {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    [{"type": "function"}], {"type": "function", "function": {}}, "required", {"0": 1e300}, [-1], [10**9],
]  # fmt: skip
"""Values of the wrong type, range or shape for most fields."""


def test_random_malformed_fields_never_fail_the_server(url, logs):
    """Seeded: 400 bodies, each a valid one with one or two fields (or the first message's) set to a hostile
    value. Each gets an answer below 500; an error is the path's error JSON, OpenAI's naming the field in
    ``param``; nothing logs a traceback, and the engine serves after."""
    rng = random.Random(20261207)
    answered = collections.Counter()
    for _ in range(400):
        path = rng.choice(list(VALID))
        body = copy.deepcopy(VALID[path])
        for _ in range(rng.randint(1, 2)):
            value = copy.deepcopy(rng.choice(HOSTILE))
            if path == "/v1/chat/completions" and rng.random() < 0.3:
                body["messages"][0][rng.choice(["role", "content", "name", "tool_calls"])] = value
            else:
                body[rng.choice(FIELDS + list(body))] = value
        status, reply = http(
            "POST", f"{url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        answered[status // 100] += 1
        assert status < 500, (path, body, reply[:300])
        if status >= 400:
            error = json.loads(reply)["error"]
            if path != "/v1/messages":  # Anthropic's error JSON has no field of its own: the message names it
                assert error["param"], (path, body, error)
            assert error["message"], (path, body, error)
    assert answered[2] > 100 and answered[4] > 100, answered  # both kinds of answer were exercised
    _no_traceback(logs)
    _still_serving(url)


EXTREMES = [
    {"temperature": t, "top_p": p, "top_k": k}
    for t in (1e-300, 2.0)
    for p in (1e-300, 1.0)
    for k in (0, 1, 10**6)
] + [
    {"temperature": 1.0, "presence_penalty": 2.0, "frequency_penalty": -2.0},
    {"temperature": 1.0, "logit_bias": {"65": 100, "66": -100}, "top_p": 1e-30},
    {"temperature": 0.0, "logit_bias": {"65": -100}, "presence_penalty": -2.0, "logprobs": 20},
]
"""Sampling at the edges of what the schema allows."""


@pytest.mark.parametrize("sampling", EXTREMES)
def test_two_requests_at_the_edges_of_sampling_decode_together(url, logs, sampling):
    """Two requests at once (so their rows share windows), each with sampling at the edge of the schema's
    ranges: both answered in full, and the engine serves after. Top-p 1e-300 in a shared window failed the
    engine's step. End-of-text is ignored, so that a reply sampled hot never ends at its first token."""
    body = {"model": "demo", "prompt": "Hello", "max_tokens": 24, "ignore_eos": True, **sampling}

    def one() -> tuple[int, bytes]:
        return http(
            "POST", f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: one(), range(2)))
    for status, reply in answers:
        assert status == 200, reply
        assert json.loads(reply)["usage"]["completion_tokens"] == 24
    _no_traceback(logs)
    _still_serving(url)
