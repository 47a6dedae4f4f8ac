"""The endpoints of Anthropic's Messages API: ``POST /v1/messages``, served by the chat path and answered in
Anthropic's shapes, whole or as its stream of events; and ``POST /v1/messages/count_tokens``. How a body
reads and how a reply is written are in `anthropic`."""

from __future__ import annotations

from aiohttp import web

from ..chat import CallArguments, CallStart, ToolCall
from . import anthropic
from . import protocol as p
from .chat_path import ChatPath
from .engine_loop import Stream
from .replies import SSE_HEADERS, Choice, ended_early, reply_parts, whole_parts
from .tools import tool_use


async def messages(server: ChatPath, request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages``: the body read as a chat (`anthropic.to_chat`), served by the chat path, and
    answered in Anthropic's shapes."""
    _, prepared = await server.prepare_chat(anthropic.to_chat(await server.read_json(request)))
    stream = server.submit(prepared)
    try:
        if prepared.stream:
            return await _streamed(server, request, stream, prepared)
        return await _whole(server, stream, prepared)
    finally:
        stream.close()


async def count_tokens(server: ChatPath, request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``: the prompt tokens a Messages body would read."""
    raw = anthropic.to_chat(await server.read_json(request), counting=True)
    body = p.parse_chat(raw)
    p.check_model(body.model, server.options.model_name)
    tools = tool_use(body.model_extra or {}, p.grammar_of(body))
    return web.json_response({"input_tokens": len(server.chat_prompt(body, tools))})


async def _whole(server: ChatPath, stream: Stream, prepared: p.Prepared) -> web.Response:
    whole = await server.collect(stream, prepared, chat=True)
    parts = whole_parts(prepared, whole.text)
    calls = any(isinstance(part, ToolCall) for _, part in parts)
    blocks = anthropic.content_blocks(parts)
    reason = anthropic.stop_reason(whole.end, calls, whole.stop)
    use = anthropic.usage(prepared.prompt_tokens, whole.tokens, stream.handle.cached_tokens)
    model = server.options.model_name
    return web.json_response(anthropic.message(anthropic.new_message_id(), model, blocks, reason, use))


async def _streamed(
    server: ChatPath, request: web.Request, stream: Stream, prepared: p.Prepared
) -> web.StreamResponse:
    """The reply as Anthropic's events: ``message_start`` (once the engine took the request, so its usage
    says what it read), blocks of reasoning, text and calls as they come, ``message_delta`` with how it
    ended, ``message_stop``; an ``error`` event where the request ended early."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    c, blocks = Choice(0, prepared, progress=True), anthropic.BlockStream()
    started, tokens = False, 0
    async for piece in server.pieces(stream):
        if piece.finish in ("error", "cancelled"):
            error = anthropic.error_body(ended_early(piece))["error"]
            await response.write(anthropic.event("error", error=error))
            break
        if not started:
            use = anthropic.usage(prepared.prompt_tokens, 0, stream.handle.cached_tokens)
            model = server.options.model_name
            start = anthropic.message(anthropic.new_message_id(), model, [], (None, None), use)
            await response.write(anthropic.event("message_start", message=start))
            started = True
        tokens += piece.tokens
        for kind, part in reply_parts(c, piece.text, piece.finish is not None):
            if isinstance(part, CallStart):
                events = blocks.call_start(part)
            elif isinstance(part, CallArguments):
                events = blocks.call_arguments(part.text)
            elif isinstance(part, ToolCall):
                events = blocks.call(part)
            else:
                events = blocks.text("thinking" if kind == "reasoning" else "text", part)
            for chunk in events:
                await response.write(chunk)
        if piece.finish is not None:
            for chunk in blocks.close():
                await response.write(chunk)
            calls = c.splitter is not None and c.splitter.calls > 0
            reason, sequence = anthropic.stop_reason(piece.finish, calls, piece.stop)
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            await response.write(
                anthropic.event("message_delta", delta=delta, usage={"output_tokens": tokens})
            )
            await response.write(anthropic.event("message_stop"))
            server.observe(stream)
    await response.write_eof()
    return response
