"""What happens to a connection outside the routes: the access log line, and the answer to a request that
aiohttp refuses before routing it.

* The access log leaves out the probes (``/health`` is polled while loading, ``/metrics`` is scraped) and
  every query string, which can carry a secret (a client that sends its API key as ``?api_key=``): the path
  is logged, and a query only as ``?<redacted>``.
* A request aiohttp cannot parse (a header line over its limit, a malformed request line) is answered in
  OpenAI's error JSON, like every other error, instead of aiohttp's plain text, and logged in one line
  instead of a traceback. The message does not echo the request's bytes, which may hold a key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web, web_log, web_protocol
from aiohttp.http_exceptions import LineTooLong

from .protocol import ApiError

log = logging.getLogger("strata.serve")

QUIET_PATHS = frozenset({"/health", "/metrics"})
"""Paths the access log leaves out."""


class AccessLog(web_log.AccessLogger):
    """One line per request: client, method, path (no query), status, bytes and seconds."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if request.path in QUIET_PATHS:
            return
        query = "?<redacted>" if request.query_string else ""
        major, minor = request.version
        self.logger.info(
            '%s "%s %s%s HTTP/%d.%d" %d %d %.6fs',
            request.remote,
            request.method,
            request.rel_url.raw_path,
            query,
            major,
            minor,
            response.status,
            response.body_length,
            time,
        )


def unparsed_message(exc: BaseException | None, status: int) -> str:
    """What a client is told about a request that could not be read as HTTP."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else "the limit of"
        return f"a request line or header is longer than {limit} bytes"
    return f"the request could not be read as HTTP ({type(exc).__name__ if exc else status})"


class _JsonErrorHandler(web_protocol.RequestHandler):
    """aiohttp's connection handler, answering its own 4xx refusals in OpenAI's error JSON."""

    __slots__ = ()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500 or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        text = unparsed_message(exc, status)
        log.warning("refused a request from %s before routing: %d, %s", request.remote, status, text)
        response = web.json_response(ApiError(status, text).body(), status=status)
        response.force_close()
        return response


class JsonErrorRunner(web.AppRunner):
    """An `AppRunner` whose connections answer aiohttp's own 4xx refusals in OpenAI's error JSON.

    aiohttp offers no setting for the class of its per-connection handler, so each handler the server makes
    is given `_JsonErrorHandler`'s class, which adds no state (no slots) and overrides only ``handle_error``.
    """

    @property
    def server(self) -> Any:
        made = super().server
        if made is None:
            return None
        return _json_errors(made)


def _json_errors(
    make: Callable[[], web_protocol.RequestHandler],
) -> Callable[[], web_protocol.RequestHandler]:
    def protocol() -> web_protocol.RequestHandler:
        handler = make()
        handler.__class__ = _JsonErrorHandler
        return handler

    return protocol
