"""The HTTP driver: one keep-alive client of a running engine, as its users are, that checks every reply.

A 200 with no text, a missing usage count or a stream that does not end in ``[DONE]`` is an error, not a
success. Standard library only (``http.client``), so `strata loadtest` and ``strata bench --url`` work
wherever strata_cfg is installed, without the engine.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass
class Sample:
    """One request as the client saw it."""

    ok: bool
    seconds: float
    tokens: int = 0
    first_token_s: float | None = None
    error: str | None = None
    retry_after: float | None = None
    """Set when the server refused the request for capacity (HTTP 429): the seconds its ``Retry-After``
    asked the client to wait (1 when it named none)."""
    text: str = ""
    """The reply's text (a completion's, or a chat reply's content)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens the server did not read again (``usage.prompt_tokens_details.cached_tokens``; 0 where
    it does not say)."""


class Client:
    """One keep-alive connection to the engine."""

    def __init__(self, url: str, api_key: str | None, timeout: float) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected an http:// URL, got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/").removesuffix("/v1")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        self.conn: http.client.HTTPConnection | None = None
        self.reused = False  # whether the open connection has carried a request already (kept alive since)

    def _connection(self) -> http.client.HTTPConnection:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            self.reused = False
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def _send(self, method: str, path: str, body: str | None) -> http.client.HTTPResponse:
        """The response to one request, its body not yet read. A kept-alive connection the server closed
        since the last reply fails before any reply (llama.cpp's server closes one after each streamed
        reply though it announced keep-alive); the server never saw the request, so it goes again once,
        on a new connection, as HTTP clients do."""
        stale = self.conn is not None and self.reused
        try:
            conn = self._connection()
            conn.request(method, self.prefix + path, body, self.headers)
            r = conn.getresponse()
        except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError):
            if not stale:
                raise
            self.close()
            conn = self._connection()
            conn.request(method, self.prefix + path, body, self.headers)
            r = conn.getresponse()
        self.reused = True
        return r

    def get(self, path: str) -> tuple[int, bytes]:
        """The status and body of ``GET path``."""
        r = self._send("GET", path, None)
        return r.status, r.read()

    def get_json(self, path: str) -> Any:
        status, body = self.get(path)
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status}: {body[:200]!r}")
        return json.loads(body)

    def post_completion(self, body: dict[str, Any]) -> http.client.HTTPResponse:
        """Send ``body`` to ``/v1/completions`` and return the response, its body not yet read."""
        return self._send("POST", "/v1/completions", json.dumps(body))

    def complete(self, body: dict[str, Any]) -> Sample:
        """One completion (a chat completion where ``body`` has ``messages``), timed and checked whole
        (streamed when ``body`` asks for it)."""
        start = time.perf_counter()
        try:
            if "messages" in body:
                r = self._send("POST", "/v1/chat/completions", json.dumps(body))
            else:
                r = self.post_completion(body)
            if r.status != 200:
                retry = _retry_after(r.getheader("Retry-After")) if r.status == 429 else None
                error = f"HTTP {r.status}: {r.read()[:200]!r}"
                return Sample(False, time.perf_counter() - start, error=error, retry_after=retry)
            if body.get("stream"):
                return self._read_stream(r, start)
            data = json.loads(r.read())
            return _check_whole(data, time.perf_counter() - start)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.close()
            return Sample(False, time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}")

    def _read_stream(self, r: http.client.HTTPResponse, start: float) -> Sample:
        first: float | None = None
        finish = None
        text = ""
        usage: dict[str, Any] | None = None
        done = False
        for chunk in sse_chunks(r):
            if chunk is None:
                done = True
                break
            if "error" in chunk:
                self.close()
                return Sample(False, time.perf_counter() - start, error=str(chunk["error"].get("message")))
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - start
                text += piece
                finish = choice.get("finish_reason") or finish
        r.read()  # the end of the chunked body, so the connection can carry the next request
        seconds = time.perf_counter() - start
        if not done or finish not in ("stop", "length") or usage is None:
            return Sample(False, seconds, error=f"incomplete stream (done={done}, finish={finish})")
        sample = Sample(True, seconds, tokens=int(usage["completion_tokens"]), first_token_s=first, text=text)
        return _with_prompt_usage(sample, usage)


def _retry_after(value: str | None) -> float:
    """The seconds of a ``Retry-After`` header (a number of seconds; its HTTP-date form, or none: 1)."""
    try:
        return max(0.0, float(value)) if value is not None else 1.0
    except ValueError:
        return 1.0


def sse_chunks(r: http.client.HTTPResponse) -> Iterator[dict[str, Any] | None]:
    """The JSON chunks of a server-sent event stream, then None for its closing ``data: [DONE]``."""
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            yield None
            return
        yield json.loads(payload)


def _check_whole(data: dict[str, Any], seconds: float) -> Sample:
    try:
        choice = data["choices"][0]
        tokens = int(data["usage"]["completion_tokens"])
        text = choice["text"] if "text" in choice else choice["message"]["content"]
    except (KeyError, IndexError, TypeError, ValueError):
        return Sample(False, seconds, error=f"malformed response: {str(data)[:200]}")
    if choice.get("finish_reason") not in ("stop", "length") or tokens < 1:
        return Sample(False, seconds, error=f"incomplete response: {str(data)[:200]}")
    return _with_prompt_usage(Sample(True, seconds, tokens=tokens, text=text or ""), data["usage"])


def _with_prompt_usage(sample: Sample, usage: dict[str, Any]) -> Sample:
    """``sample`` with the prompt tokens and those reused that ``usage`` reports (0 where it does not)."""
    details = usage.get("prompt_tokens_details") or {}
    return dataclasses.replace(
        sample,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
    )


def engine_status(url: str, api_key: str | None = None, timeout: float = 30.0) -> dict[str, Any] | None:
    """A strata engine's ``/v1/status`` (its plan and window counts), or None where the server at ``url``
    has none: another OpenAI-compatible server. A refused key is an error, not another server."""
    client = Client(url, api_key, timeout)
    try:
        status, body = client.get("/v1/status")
    finally:
        client.close()
    if status in (401, 403):
        raise RuntimeError(f"GET /v1/status: HTTP {status}: the server refused the API key ({body[:200]!r})")
    if status != 200:
        return None
    out: dict[str, Any] = json.loads(body)
    return out if isinstance(out.get("plan"), dict) and isinstance(out.get("engine"), dict) else None


def served_model(url: str, api_key: str | None = None, timeout: float = 10.0) -> str:
    """The model id the engine serves (the first of ``/v1/models``)."""
    client = Client(url, api_key, timeout)
    try:
        return str(client.get_json("/v1/models")["data"][0]["id"])
    finally:
        client.close()
