"""The endpoints of OpenAI's Responses API: ``POST /v1/responses``, served by the chat path, its reply written
back as output items, whole or as the API's numbered events, or run in the background (``background``) and
followed by its id; ``GET /v1/responses/{id}`` (a kept reply, or a background reply's events from a cursor),
``DELETE`` of it, ``POST /v1/responses/{id}/cancel`` and ``GET /v1/responses/{id}/input_items``. How a body
reads is in `responses`, how a reply is written in `responses_reply`, what is kept in `responses_store`, and
a background reply's events in `background`."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..chat import CallArguments, CallStart, ToolCall
from . import protocol as p
from . import responses, responses_reply, responses_store
from .background import Run
from .chat_path import ChatPath
from .conversations_api import page
from .engine_loop import Stream
from .replies import SSE_HEADERS, Choice, ended_early, reply_parts, whole_parts

log = logging.getLogger("strata.serve")

ENDED_EARLY = ("error", "cancelled")
"""How a reply the engine stopped ends."""
Write = Callable[[bytes], Awaitable[None]]
"""Where a reply's events go: a streamed response, or a background run's log."""


@dataclass(frozen=True)
class Reply:
    """A request on its way: its id, when it was made, the body as read, and the engine request."""

    id: str
    created: int
    asked: responses.Asked
    prepared: p.Prepared


async def create(server: ChatPath, request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``: the body read as a chat (`responses.to_chat`), served by the chat path, and
    answered as the Responses API's output items; the reply kept for a later ``previous_response_id``. With
    ``background``, the request is answered at once and the reply runs on (`_background`)."""
    asked = responses.to_chat(await server.read_json(request), server.kept, server.conversations)
    prepared = await _prepare(server, asked)
    reply = Reply(responses_reply.new_id("resp"), int(time.time()), asked, prepared)
    stream = server.submit(prepared)
    if asked.background:
        return await _background(server, request, stream, reply)
    try:
        if prepared.stream:
            return await _streamed(server, request, stream, reply)
        whole = await server.collect(stream, prepared, chat=True)
        parts = whole_parts(prepared, whole.text)
        status = "incomplete" if whole.end == "length" else "completed"
        spans = None
        if whole.logprobs is not None:  # the request asked (``include``): each message's tokens'
            spans = responses_reply.TokenSpans()
            spans.add(whole.logprobs["content"])
        output = responses_reply.output_items(parts, spans)
        use = _usage(reply, stream, whole.tokens, whole.reasoning_tokens)
        body = _object(server, reply, status, output, use)
        _keep(server, reply, body, parts)
        return web.json_response(body)
    finally:
        stream.close()


async def _prepare(server: ChatPath, asked: responses.Asked) -> p.Prepared:
    """The chat made the engine's request; with ``truncation: "auto"``, where the conversation does not fit
    the context, without as few of its oldest steps as make it fit (`responses.truncated`, found by
    bisection), and the context error where none do."""
    try:
        return (await server.prepare_chat(asked.chat))[1]
    except p.ApiError as exc:
        if not asked.truncate or exc.code != "context_length_exceeded":
            raise
        error = exc
    messages = asked.chat["messages"]
    low, high, best = 1, len(messages), None  # the fewest steps to drop lies in [low, high]
    while low <= high:
        dropped = (low + high) // 2
        kept = responses.truncated(messages, dropped)
        if kept is None:  # fewer steps than that to drop
            high = dropped - 1
            continue
        try:
            best = (await server.prepare_chat({**asked.chat, "messages": kept}))[1]
            high = dropped - 1
        except p.ApiError as exc:
            if exc.code != "context_length_exceeded":
                raise
            low = dropped + 1
    if best is None:
        raise error
    return best


async def stored(server: ChatPath, request: web.Request) -> web.StreamResponse:
    """``GET /v1/responses/{id}``: a kept reply as it stands (a background one's while it runs); with
    ``stream=true``, a background reply's events after number ``starting_after`` (all of them without it),
    and those to come as they are written."""
    response_id = request.match_info["response_id"]
    found = server.kept.get(response_id)
    if found is None:
        raise _not_kept(server, response_id)
    if request.query.get("stream", "false").lower() not in ("true", "1"):
        return web.json_response(found.now())
    run = found.run
    if run is None:
        raise p.ApiError(
            400,
            f"`stream`: response `{response_id}` was not made in the background, so its events were not "
            "kept; GET it without `stream` for the whole response",
            "stream",
        )
    if run.events is None:
        raise p.ApiError(
            400,
            f"`stream`: the events of response `{response_id}` are no longer kept (the server keeps "
            f"{server.kept.event_bytes >> 20} MiB of finished background replies' events, the oldest let go "
            "first); GET it without `stream` for the whole response",
            "stream",
        )
    after = request.query.get("starting_after", "-1")
    if not after.lstrip("-").isdigit() or int(after) < -1:
        raise p.ApiError(
            400,
            "`starting_after` must be the `sequence_number` of an event read (0 or more)",
            "starting_after",
        )
    return await _follow(request, run, int(after))


async def input_items(server: ChatPath, request: web.Request) -> web.Response:
    """``GET /v1/responses/{id}/input_items``: a page of a kept reply's ``input`` as items
    (`conversations_api.page`)."""
    response_id = request.match_info["response_id"]
    found = server.kept.get(response_id)
    if found is None:
        raise _not_kept(server, response_id)
    return web.json_response(page(found.input_items, request.query, f"response `{response_id}`"))


async def drop(server: ChatPath, request: web.Request) -> web.Response:
    """``DELETE /v1/responses/{id}``: let a kept reply go (a background one that runs is cancelled); no later
    ``previous_response_id`` finds it."""
    response_id = request.match_info["response_id"]
    found = server.kept.drop(response_id)
    if found is None:
        raise _not_kept(server, response_id)
    if found.run is not None:
        found.run.cancel()
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def cancel(server: ChatPath, request: web.Request) -> web.Response:
    """``POST /v1/responses/{id}/cancel``: stop a background reply and answer with it as it ended, its output
    so far kept; one that has already ended is answered as it is."""
    response_id = request.match_info["response_id"]
    found = server.kept.get(response_id)
    if found is None:
        raise _not_kept(server, response_id)
    run = found.run
    if run is None:
        raise p.ApiError(
            400,
            f"response `{response_id}` was not made in the background (`background: true`): it ran with its "
            "request, which cancels it by closing its connection",
            "response_id",
        )
    if not run.finished:
        run.cancel()
        await run.ended()
    return web.json_response(run.now())


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
    """The reply as the Responses API's events: ``response.created`` and ``response.in_progress``, then the
    reply's (`_write_reply`)."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    events = responses_reply.EventStream()
    start = _object(server, reply, "in_progress", [], None)
    await response.write(events.event("response.created", response=start))
    await response.write(events.event("response.in_progress", response=start))
    await _write_reply(server, stream, reply, events, response.write)
    await response.write_eof()
    return response


async def _background(
    server: ChatPath, request: web.Request, stream: Stream, reply: Reply
) -> web.StreamResponse:
    """A background reply: kept at once as ``queued``, its events (``response.created``,
    ``response.queued``, then the reply's) written to its `Run` by a task of its own, which a closed
    connection does not stop; answered with the queued response object, or, streamed, with the run's
    events as they come."""
    events = responses_reply.EventStream()
    queued = _object(server, reply, "queued", [], None)
    run = Run(stream, queued)
    server.kept.put(reply.id, responses_store.Kept(None, queued, run, reply.asked.items))
    run.write(events.event("response.created", response=queued))
    run.write(events.event("response.queued", response=queued))
    run.task = asyncio.ensure_future(_run(server, stream, reply, events, run))
    if reply.prepared.stream:
        return await _follow(request, run, -1)
    return web.json_response(queued)


async def _run(
    server: ChatPath, stream: Stream, reply: Reply, events: responses_reply.EventStream, run: Run
) -> None:
    """Write a background reply to its run, and end the run however the reply ends."""

    async def write(chunk: bytes) -> None:
        run.write(chunk)

    body: dict[str, Any] | None = None
    try:
        body = await _write_reply(server, stream, reply, events, write, run)
    except Exception:  # a fault of the server's own: the run still ends, as failed
        log.exception("background response %s failed", reply.id)
        error = {"code": "server_error", "message": "the server failed while writing this response"}
        body = _object(server, reply, "failed", events.items, None, error)
        _keep(server, reply, body, None, run)
        run.write(events.event("response.failed", response=body))
    finally:
        stream.close()
        run.end(body if body is not None else {**run.response, "status": "cancelled"})


async def _follow(request: web.Request, run: Run, after: int) -> web.StreamResponse:
    """A background run's events after number ``after``, and those to come; a closed connection stops only
    the following, not the run."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    async for chunk in run.follow(after):
        await response.write(chunk)
    await response.write_eof()
    return response


async def _write_reply(
    server: ChatPath,
    stream: Stream,
    reply: Reply,
    events: responses_reply.EventStream,
    write: Write,
    run: Run | None = None,
) -> dict[str, Any]:
    """The reply's events, each written as it comes: each output item (opened, its deltas, closed), then
    ``response.completed`` (or ``response.incomplete``, cut by ``max_output_tokens``); where it ended early,
    ``error`` and ``response.failed``, or, for a background reply the engine stopped, the items so far
    closed and ``response.cancelled``. A background reply first says ``response.in_progress`` and keeps its
    `run`'s response object up to date. The reply is kept (`_keep`) before its last event is written, and
    its response object returned."""
    c = Choice(0, reply.prepared, progress=True)
    tokens, parts = 0, list[tuple[str, str | ToolCall]]()
    spans = responses_reply.TokenSpans() if reply.prepared.request.sampling.logprobs is not None else None

    async def say(text: str, done: bool) -> None:
        """Write what a stretch of the reply says: its items' deltas, and items opened and closed."""
        for kind, part in reply_parts(c, text, done):
            if isinstance(part, CallStart):
                chunks = events.call_start(part)
            elif isinstance(part, CallArguments):
                chunks = events.call_arguments(part.text)
            elif isinstance(part, ToolCall):
                parts.append((kind, part))
                chunks = events.call(part)
            else:
                parts.append((kind, part))
                lps = spans.take(part) if spans is not None and kind == "content" else None
                chunks = events.text(kind, part, lps)
            for chunk in chunks:
                await write(chunk)

    async for piece in server.pieces(stream):
        if run is not None and run.response["status"] == "queued" and piece.finish not in ENDED_EARLY:
            run.response = _object(server, reply, "in_progress", [], None)
            await write(events.event("response.in_progress", response=run.response))
        if piece.finish == "cancelled" and run is not None:
            await say("", True)  # what was held, and a call cut short, said as they stand
            for chunk in events.close():
                await write(chunk)
            use = _usage(reply, stream, tokens, c.reasoning_tokens)
            body = _object(server, reply, "cancelled", events.items, use)
            _keep(server, reply, body, None, run)
            await write(events.event("response.cancelled", response=body))
            return body
        if piece.finish in ENDED_EARLY:
            error = {"code": "server_error", "message": ended_early(piece).message}
            await write(events.event("error", **error, param=None))
            body = _object(server, reply, "failed", events.items, None, error)
            _keep(server, reply, body, None, run)
            await write(events.event("response.failed", response=body))
            return body
        tokens += piece.tokens
        c.count(piece)
        if spans is not None:
            spans.add(server.chat_logprobs(reply.prepared, piece.logprobs))
        await say(piece.text, piece.finish is not None)
        if piece.finish is not None:
            for chunk in events.close():
                await write(chunk)
            status = "incomplete" if piece.finish == "length" else "completed"
            body = _object(
                server, reply, status, events.items, _usage(reply, stream, tokens, c.reasoning_tokens)
            )
            _keep(server, reply, body, parts, run)
            await write(events.event(f"response.{status}", response=body))
            server.observe(stream)
            return body
        if run is not None and len(events.items) != len(run.response["output"]):
            run.response = _object(server, reply, "in_progress", list(events.items), None)
    raise AssertionError("the engine's events ended without a finish")


def _usage(reply: Reply, stream: Stream, tokens: int, reasoning_tokens: int | None) -> dict[str, Any]:
    return responses_reply.usage(
        reply.prepared.prompt_tokens, tokens, stream.handle.cached_tokens, reasoning_tokens or 0
    )


def _object(
    server: ChatPath,
    reply: Reply,
    status: str,
    output: list[dict[str, Any]],
    use: dict[str, Any] | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The reply's response object as it stands."""
    model, echo = server.options.model_name, reply.asked.echo
    return responses_reply.response(reply.id, reply.created, model, echo, status, output, use, error)


def _keep(
    server: ChatPath,
    reply: Reply,
    body: dict[str, Any],
    parts: list[tuple[str, str | ToolCall]] | None,
    run: Run | None = None,
) -> None:
    """Keep an ended reply where the request asked (``store``): its response object, and the conversation it
    ends where it ended well (``parts``, its reply), for a later ``previous_response_id``. A background
    reply deleted while it ran stays deleted. A reply on a kept conversation (``conversation``) that ended
    well adds its input and output items to it."""
    if parts is not None and reply.asked.conversation is not None:
        added = reply.asked.items + copy.deepcopy(body["output"])
        server.conversations.add(reply.asked.conversation, added)
    if not reply.asked.store:
        return
    messages = None if parts is None else [*reply.asked.history, responses_reply.reply_message(parts)]
    kept = responses_store.Kept(messages, body, run, reply.asked.items)
    if run is None:
        server.kept.put(reply.id, kept)
    else:
        server.kept.update(reply.id, kept)
