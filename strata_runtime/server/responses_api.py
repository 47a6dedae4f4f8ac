"""The endpoints of OpenAI's Responses API: ``POST /v1/responses``, served by the chat path, its reply written
back as output items, whole or as the API's numbered events, and kept for a later request; and ``GET
/v1/responses/{id}`` and ``DELETE`` of it. How a body reads and how a reply is written are in `responses`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..chat import ToolCall
from . import protocol as p
from . import responses
from .chat_path import ChatPath
from .engine_loop import Stream
from .replies import SSE_HEADERS, Choice, ended_early, reply_parts


@dataclass(frozen=True)
class Reply:
    """A request on its way: its id, when it was made, the body as read, and the engine request."""

    id: str
    created: int
    asked: responses.Asked
    prepared: p.Prepared


async def create(server: ChatPath, request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``: the body read as a chat (`responses.to_chat`), served by the chat path, and
    answered as the Responses API's output items; the reply kept for a later ``previous_response_id``."""
    asked = responses.to_chat(await server.read_json(request), server.kept)
    _, prepared = await server.prepare_chat(asked.chat)
    reply = Reply(responses.new_id("resp"), int(time.time()), asked, prepared)
    stream = server.submit(prepared)
    try:
        if prepared.stream:
            return await _streamed(server, request, stream, reply)
        whole = await server.collect(stream, prepared, chat=True)
        parts = reply_parts(Choice(0, prepared), whole.text, True)
        status = "incomplete" if whole.end == "length" else "completed"
        spans = None
        if whole.logprobs is not None:  # the request asked (``include``): each message's tokens'
            spans = responses.TokenSpans()
            spans.add(whole.logprobs["content"])
        output = responses.output_items(parts, spans)
        body = _finished(server, reply, status, output, parts, stream, whole.tokens, whole.reasoning_tokens)
        return web.json_response(body)
    finally:
        stream.close()


async def stored(server: ChatPath, request: web.Request) -> web.Response:
    """``GET /v1/responses/{id}``: a reply kept with ``store``."""
    response_id = request.match_info["response_id"]
    found = server.kept.get(response_id)
    if found is None:
        raise _not_kept(server, response_id)
    return web.json_response(found.response)


async def drop(server: ChatPath, request: web.Request) -> web.Response:
    """``DELETE /v1/responses/{id}``: let a kept reply go; no later ``previous_response_id`` finds it."""
    response_id = request.match_info["response_id"]
    if not server.kept.drop(response_id):
        raise _not_kept(server, response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


def _not_kept(server: ChatPath, response_id: str) -> p.ApiError:
    return p.ApiError(
        404,
        f"no stored response `{response_id}` (this server keeps the last {server.kept.most} replies made "
        "with `store`, in memory, until it restarts)",
        "response_id",
        code="response_not_found",
    )


async def _streamed(
    server: ChatPath, request: web.Request, stream: Stream, reply: Reply
) -> web.StreamResponse:
    """The reply as the Responses API's events: ``response.created`` and ``response.in_progress``, each
    output item as it comes (opened, its deltas, closed), then ``response.completed`` (or
    ``response.incomplete``, cut by ``max_output_tokens``); ``response.failed`` where it ended early."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    events, c = responses.EventStream(), Choice(0, reply.prepared)
    model, echo = server.options.model_name, reply.asked.echo
    start = responses.response(reply.id, reply.created, model, echo, "in_progress", [], None)
    await response.write(events.event("response.created", response=start))
    await response.write(events.event("response.in_progress", response=start))
    tokens, parts = 0, []
    spans = responses.TokenSpans() if reply.prepared.request.sampling.logprobs is not None else None
    async for piece in server.pieces(stream):
        if piece.finish in ("error", "cancelled"):
            error = {"code": "server_error", "message": ended_early(piece).message}
            await response.write(events.event("error", **error, param=None))
            failed = responses.response(
                reply.id, reply.created, model, echo, "failed", events.items, None, error
            )
            await response.write(events.event("response.failed", response=failed))
            break
        tokens += piece.tokens
        c.count(piece)
        if spans is not None:
            spans.add(server.chat_logprobs(reply.prepared, piece.logprobs))
        for kind, part in reply_parts(c, piece.text, piece.finish is not None):
            parts.append((kind, part))
            if isinstance(part, ToolCall):
                chunks = events.call(part)
            else:
                lps = spans.take(part) if spans is not None and kind == "content" else None
                chunks = events.text(kind, part, lps)
            for chunk in chunks:
                await response.write(chunk)
        if piece.finish is not None:
            for chunk in events.close():
                await response.write(chunk)
            status = "incomplete" if piece.finish == "length" else "completed"
            body = _finished(server, reply, status, events.items, parts, stream, tokens, c.reasoning_tokens)
            await response.write(events.event(f"response.{status}", response=body))
            server.observe(stream)
    await response.write_eof()
    return response


def _finished(
    server: ChatPath,
    reply: Reply,
    status: str,
    output: list[dict[str, Any]],
    parts: list[tuple[str, str | ToolCall]],
    stream: Stream,
    tokens: int,
    reasoning_tokens: int | None,
) -> dict[str, Any]:
    """A finished reply's response object, kept where the request asked (``store``)."""
    use = responses.usage(
        reply.prepared.prompt_tokens, tokens, stream.handle.cached_tokens, reasoning_tokens or 0
    )
    model, echo = server.options.model_name, reply.asked.echo
    body = responses.response(reply.id, reply.created, model, echo, status, output, use)
    if reply.asked.store:
        messages = [*reply.asked.history, responses.reply_message(parts)]
        server.kept.put(reply.id, responses.Kept(messages, body))
    return body
