"""The HTTP driver of `strata loadtest` and `strata bench --url` against a server that closes a kept-alive
connection after each reply without saying so (llama.cpp's server does after a streamed reply): the next
request goes again on a new connection instead of failing."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from strata_cfg.bench.http_driver import Client
from strata_cfg.bench.load_test import run_load


class _Closing(BaseHTTPRequestHandler):
    """HTTP/1.1 replies that announce keep-alive, after which the server closes the connection."""

    protocol_version = "HTTP/1.1"
    opened = 0
    requests = 0
    bodies: list[dict] = []

    def setup(self) -> None:
        super().setup()
        type(self).opened += 1

    def log_message(self, *a: object) -> None:
        pass

    def _reply(self, chunks: list[bytes], content_type: str) -> None:
        type(self).requests += 1
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Keep-Alive", "timeout=5, max=100")
        self.end_headers()
        for c in chunks:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(c), c))
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True  # and no "Connection: close" said so

    def do_GET(self) -> None:
        self._reply([json.dumps({"data": [{"id": "m"}]}).encode()], "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append({**body, "path": self.path})
        n = int(body["max_tokens"])
        chat = "messages" in body  # a chat reply's text is its message's content, streamed as deltas

        def choice(text: str, finish: str | None) -> dict:
            if chat:
                return {
                    "delta" if body.get("stream") else "message": {"content": text},
                    "finish_reason": finish,
                }
            return {"text": text, "finish_reason": finish}

        # a prompt token per message (one for a completion), all but the last reused
        sent = len(body.get("messages", [0]))
        prompt = {"prompt_tokens": sent, "prompt_tokens_details": {"cached_tokens": sent - 1}}
        if not body.get("stream"):
            whole = {"choices": [choice("a" * n, "length")], "usage": {"completion_tokens": n, **prompt}}
            self._reply([json.dumps(whole).encode()], "application/json")
            return
        chunks = [
            b"data: " + json.dumps({"choices": [choice("a", None)]}).encode() + b"\n\n" for _ in range(n - 1)
        ]
        last = {"choices": [choice("a", "length")]}
        usage = {"choices": [], "usage": {"completion_tokens": n, **prompt}}
        chunks += [b"data: " + json.dumps(x).encode() + b"\n\n" for x in (last, usage)]
        self._reply([*chunks, b"data: [DONE]\n\n"], "text/event-stream")


@pytest.fixture
def closing_server() -> Iterator[str]:
    _Closing.opened, _Closing.requests, _Closing.bodies = 0, 0, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Closing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_connection_the_server_closed_between_requests_is_opened_again(closing_server, stream) -> None:
    client = Client(closing_server, None, 10.0)
    samples = [client.complete({"max_tokens": 4, "stream": stream}) for _ in range(5)]
    client.close()
    assert [s.error for s in samples] == [None] * 5 and all(s.ok and s.tokens == 4 for s in samples)
    assert _Closing.requests == 5 and _Closing.opened == 5  # each on a connection of its own
    result = run_load(closing_server, clients=2, requests_per_client=6, max_tokens=3, stream=stream)
    assert len(result.errors) == 0 and len(result.served) == 12


@pytest.mark.parametrize("stream", [True, False])
def test_a_chat_load_test_sends_each_conversation_so_far_and_begins_anew_after_its_turns(
    closing_server, stream
) -> None:
    """`run_load(chat=True)`: each request goes to the chat API with the system prompt, the exchanges so
    far (each reply as the assistant's message) and a new message; after ``turns`` turns the client begins
    a new conversation. The prompt tokens and those reused come from each reply's usage."""
    from strata_cfg.bench.load_test import CHAT_SYSTEM

    result = run_load(
        closing_server, clients=1, requests_per_client=5, max_tokens=3, stream=stream, chat=True, turns=2
    )
    assert len(result.served) == 5 and not result.errors
    bodies = _Closing.bodies[:]
    assert {b["path"] for b in bodies} == {"/v1/chat/completions"}
    assert [len(b["messages"]) for b in bodies] == [2, 4, 2, 4, 2]
    assert all(b["messages"][0] == {"role": "system", "content": CHAT_SYSTEM} for b in bodies)
    second = bodies[1]["messages"]
    assert second[1:] == [
        {"role": "user", "content": "Once upon a time (0.0)"},
        {"role": "assistant", "content": "aaa"},
        {"role": "user", "content": "Once upon a time (0.1)"},
    ]
    assert bodies[2]["messages"][1] == {"role": "user", "content": "Once upon a time (0.2)"}
    j = result.to_json()
    assert (j["prompt_tokens"], j["cached_tokens"]) == (14, 9) and j["reused_pct"] == round(100 * 9 / 14, 2)


def test_a_server_that_refuses_a_fresh_connection_is_still_an_error() -> None:
    """Only a kept-alive connection is tried again: a server that is not there fails at once."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = Client(f"http://127.0.0.1:{port}", None, 5.0)
    sample = client.complete({"max_tokens": 2})
    assert not sample.ok and "ConnectionRefusedError" in str(sample.error)


def test_loadtest_asks_every_request_to_ignore_end_of_text(closing_server) -> None:
    run_load(closing_server, clients=2, requests_per_client=2, max_tokens=3)
    assert _Closing.bodies and not any("ignore_eos" in b for b in _Closing.bodies)
    _Closing.bodies.clear()
    run_load(closing_server, clients=2, requests_per_client=2, max_tokens=3, stream=True, ignore_eos=True)
    assert len(_Closing.bodies) == 4 and all(b["ignore_eos"] is True for b in _Closing.bodies)


class _AtCapacity(_Closing):
    """Every other completion is refused for capacity: 429 with ``Retry-After: 0``."""

    def do_POST(self) -> None:
        if type(self).requests % 2 == 0:
            type(self).requests += 1
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"error": {"message": "at capacity", "code": "rate_limit_exceeded"}}).encode()
            self.send_response(429)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Retry-After", "0")
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_POST()


def test_loadtest_counts_a_refusal_at_capacity_apart_from_the_errors() -> None:
    _AtCapacity.requests = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _AtCapacity)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = run_load(
            f"http://127.0.0.1:{server.server_address[1]}", clients=1, requests_per_client=6, max_tokens=3
        )
    finally:
        server.shutdown()
        server.server_close()
    assert len(result.rejected) == 3 and len(result.served) == 3 and not result.errors
    assert all(s.retry_after == 0.0 and "429" in str(s.error) for s in result.rejected)
    assert (
        result.to_json()["rejected"] == 3
        and "3 refused at capacity (HTTP 429), 0 errors" in result.lines()[0]
    )
