"""A launched engine as the terminal chat reaches it over HTTP (`chat --url`): a JSON request, the served
model's name, and a streamed reply's server-sent events. Standard library only (``http.client``), one
connection a request.

strata_cfg has its own client of the engine for the load test and the bench (``strata_cfg.bench``); the
runtime reads nothing of strata_cfg but the plan's schema, so the chat keeps this small one.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Iterator
from typing import Any


class Endpoint:
    """The engine at ``url`` (``http://HOST:PORT``, with or without ``/v1``), with its API key if it needs
    one."""

    def __init__(self, url: str, api_key: str | None, timeout: float = 600.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected an http:// URL, got {url!r}")
        self.host, self.port, self.timeout = parts.hostname, parts.port or 80, timeout
        self.prefix = parts.path.rstrip("/").removesuffix("/v1")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> http.client.HTTPResponse:
        """The response to one request on a new connection, its body not yet read."""
        self.close()
        self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        self._conn.request(
            method, self.prefix + path, None if body is None else json.dumps(body), self.headers
        )
        return self._conn.getresponse()

    def model(self) -> str:
        """The model id the engine serves (the first of ``/v1/models``)."""
        r = self.request("GET", "/v1/models")
        body = r.read()
        if r.status != 200:
            raise RuntimeError(f"GET /v1/models: HTTP {r.status}: {body[:200]!r}")
        return str(json.loads(body)["data"][0]["id"])

    def close(self) -> None:
        """Drop the connection (the server cancels a request whose client left)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def events(r: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON chunks of a server-sent event stream, up to its closing ``data: [DONE]``."""
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            return
        yield json.loads(payload)
