"""OpenAI's streamed replies (``stream: true`` on ``/v1/completions`` and ``/v1/chat/completions``): every
choice's server-sent chunks as the engine gives them, a chat's reasoning, text and calls as deltas, the
log-probabilities with the text they belong to, and the usage chunk; and the usage and finish reason the
whole replies share."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from aiohttp import web

from ..api import TokenLogprob
from ..chat import CallArguments, CallStart, Said, ToolCall
from . import protocol as p
from .chat_path import ServeNames
from .engine_loop import Stream
from .replies import SSE_HEADERS, Choice, Piece, ended_early, reply_parts


class Replying(Protocol):
    """What streaming a reply uses of the server (`app.Server`)."""

    @property
    def options(self) -> ServeNames: ...

    def logprobs(
        self, prepared: p.Prepared, entries: list[TokenLogprob], chat: bool, offset: int, lead: bool = False
    ) -> dict[str, Any] | None: ...

    def pieces(self, stream: Stream) -> AsyncIterator[Piece]: ...

    def observe(self, stream: Stream) -> None: ...


async def stream_reply(
    server: Replying, request: web.Request, streams: list[Stream], batch: list[p.Prepared], *, chat: bool
) -> web.StreamResponse:
    """Server-sent chunks of every choice as the engine gives them, each chunk naming its choice; a
    request that ends early ends the stream with an error event."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    rid, model, created = batch[0].request.request_id, server.options.model_name, int(time.time())
    states = [Choice(i, prepared, progress=chat) for i, prepared in enumerate(batch)]

    def chunk(
        c: Choice,
        text: str | None,
        finish: str | None,
        entries: tuple[TokenLogprob, ...] = (),
        lead: bool = False,
        delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A chunk of choice ``c``: its text (None: the chat's first chunk, naming the role) or, on chat,
        the ``delta`` given (reasoning or tool calls), with the log-probabilities of ``entries``."""
        lps = None if text is None else server.logprobs(c.prepared, list(entries), chat, c.offset, lead)
        if lps is not None and not chat:
            c.offset += sum(len(name) for name in lps["tokens"])
        end = finish_reason(finish) if finish else None
        if end == "stop" and c.splitter is not None and c.splitter.calls:
            end = "tool_calls"
        if chat:
            if delta is None:
                delta = (
                    {"role": "assistant", "content": ""}
                    if text is None
                    else ({"content": text} if text else {})
                )
            return p.chat_chunk(rid, model, created, delta, end, lps, c.index)
        return p.completion_chunk(rid, model, created, text or "", end, lps, c.index)

    if chat:
        for c in states:
            await _send(response, chunk(c, None, None))
    arrivals: asyncio.Queue[tuple[int, Piece | None]] = asyncio.Queue()

    async def follow(i: int, stream: Stream) -> None:
        async for piece in server.pieces(stream):
            await arrivals.put((i, piece))
        await arrivals.put((i, None))

    followers = [asyncio.create_task(follow(i, s)) for i, s in enumerate(streams)]
    try:
        running, failed = len(streams), False
        while running and not failed:
            i, piece = await arrivals.get()
            if piece is None:
                running -= 1
                continue
            failed = not await _stream_piece(response, states[i], piece, chunk)
    finally:
        for task in followers:
            task.cancel()
    if not failed and all(c.finished for c in states):
        for stream in streams:
            server.observe(stream)
        if batch[0].include_usage:
            kind = "chat.completion.chunk" if chat else "text_completion"
            generated = [c.generated for c in states]
            use = usage(batch, streams, generated, [c.reasoning_tokens for c in states])
            await _send(response, p.usage_chunk(rid, model, created, kind, use))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _stream_piece(
    response: web.StreamResponse, c: Choice, piece: Piece, chunk: Callable[..., dict[str, Any]]
) -> bool:
    """Send what one piece of choice ``c`` adds; False where it ended the request early (an error event
    went out)."""
    if piece.finish in ("error", "cancelled"):
        await _send(response, ended_early(piece).body())
        return False
    if c.echo is not None:
        # The echoed prompt goes first, with its log-probabilities, which the first piece brings.
        await _send(response, chunk(c, c.echo, None, piece.prompt_logprobs, True))
        c.echo = None
    if not c.prepared.generate:  # the prompt alone (`max_tokens: 0`): its first token is not sent
        c.finished = piece.finish is not None
        if c.finished:
            await _send(response, chunk(c, "", "length"))
        return True
    c.generated += piece.tokens
    c.count(piece)
    c.held += piece.logprobs
    if c.splitter is not None or c.thinker is not None:
        await _send_parts(response, c, piece, chunk)
    elif piece.text or piece.finish:
        await _send(response, chunk(c, piece.text, piece.finish, c.held))
        c.held = ()
    c.finished = piece.finish is not None
    return True


async def _send_parts(
    response: web.StreamResponse, c: Choice, piece: Piece, chunk: Callable[..., dict[str, Any]]
) -> None:
    """Send what a piece of a chat reply that is read into parts adds: its reasoning as ``reasoning_content``
    deltas, the text outside calls as ``content``, each call in ``tool_calls`` deltas as it comes (`_deltas`;
    a tail that may begin a tag is held back until it is known), and the finish, as ``tool_calls`` where the
    reply made calls and ended by itself. The pieces' log-probabilities go with the first chunk sent."""
    done = piece.finish is not None
    deltas = _deltas(c, reply_parts(c, piece.text, done))
    if done and not deltas:
        deltas.append({})
    for k, delta in enumerate(deltas):
        last = k == len(deltas) - 1
        await _send(response, chunk(c, "", piece.finish if last else None, c.held, delta=delta))
        c.held = ()


def _deltas(c: Choice, parts: list[tuple[str, Said]]) -> list[dict[str, Any]]:
    """The chat deltas of a stretch of choice ``c``'s reply (`replies.reply_parts`): neighbouring text of
    one kind in one delta; a call as it comes, numbered from the reply's first call (its ``id``, ``type``
    and ``name`` with its first arguments, then its arguments' deltas), or whole where it was read only
    when it ended."""
    deltas: list[dict[str, Any]] = []
    for kind, part in parts:
        if isinstance(part, CallStart):
            c.started.add(part.id)
            call = {"index": c.calls_sent, "id": part.id, "type": "function"}
            deltas.append({"tool_calls": [call | {"function": {"name": part.name, "arguments": ""}}]})
            c.calls_sent += 1
            continue
        if isinstance(part, CallArguments):
            last = deltas[-1]["tool_calls"][0] if deltas and "tool_calls" in deltas[-1] else None
            if last is not None and last["index"] == c.calls_sent - 1:
                last["function"]["arguments"] += part.text
            else:
                call = {"index": c.calls_sent - 1, "function": {"arguments": part.text}}
                deltas.append({"tool_calls": [call]})
            continue
        if isinstance(part, ToolCall):
            if part.id not in c.started:
                deltas.append({"tool_calls": [part.openai(c.calls_sent)]})
                c.calls_sent += 1
            continue
        key = "reasoning_content" if kind == "reasoning" else "content"
        if deltas and next(iter(deltas[-1])) == key:
            deltas[-1] = {key: deltas[-1][key] + part}
        else:
            deltas.append({key: part})
    return deltas


def usage(
    batch: list[p.Prepared], streams: list[Stream], generated: list[int], reasoning: list[int | None]
) -> dict[str, Any]:
    """A request's usage over its choices: each prompt counted once, every choice's tokens, those of their
    think blocks where the model reasons."""
    thought = [n for n in reasoning if n is not None]
    return p.usage(
        prompt_tokens(batch),
        sum(generated),
        cached_tokens(streams, batch),
        sum(thought) if thought else None,
    )


def prompt_tokens(batch: list[p.Prepared]) -> int:
    """The prompt tokens of a request's choices: each prompt counted once, however many choices it has."""
    return sum(prepared.prompt_tokens for prepared in batch if prepared.choice == 0)


def cached_tokens(streams: list[Stream], batch: list[p.Prepared]) -> int:
    """Of `prompt_tokens`, those a slot kept from an earlier request and the engine did not read again
    (``memory.prefix_reuse``)."""
    return sum(
        s.handle.cached_tokens for s, prepared in zip(streams, batch, strict=True) if prepared.choice == 0
    )


def finish_reason(reason: str | None) -> p.OpenAIFinish:
    return "length" if reason == "length" else "stop"


async def _send(response: web.StreamResponse, data: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")
