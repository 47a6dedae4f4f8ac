"""The OpenAI-compatible HTTP server: routes, authentication, whole replies, and a clean SIGTERM (streamed
replies are `openai_stream`'s, a chat body's preparation `chat_request`'s).

The server binds its port first and answers ``/health`` with 503 while the engine loads on its own thread,
so a launcher can show progress. Every error a client can cause comes back as OpenAI's error JSON naming
the field; an unexpected exception is logged and answered with a 500 that carries no traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web

from strata_cfg.schema.plan import LaunchPlan

from ..api import EngineCore, TokenLogprob, token_name
from . import (
    anthropic,
    conversations,
    conversations_api,
    messages_api,
    responses,
    responses_api,
    responses_store,
)
from . import protocol as p
from .chat_request import chat_prompt, check_grammar, prepare_chat
from .connection import AccessLog, JsonErrorRunner
from .engine_loop import EngineFactory, EngineLoop, Stream
from .metrics import ServerCounters, expert_cache, render
from .notify import Notifier
from .openai_stream import finish_reason, stream_reply, usage
from .replies import Piece, Whole, read_reply, think_count
from .tools import ToolUse, tool_use

log = logging.getLogger("strata.serve")

MAX_BODY_BYTES = 32 << 20
"""Largest request body accepted: a long prompt, with room to spare."""
CLIENT_CLOSED = 499
"""The status the access log shows for a request whose client went away before its reply."""
RETRY_AFTER_S = 1
"""``Retry-After`` of a request refused for capacity (`serve.max_queued`): a decode window is milliseconds,
so a slot frees within a second at any but the longest replies; OpenAI's Python client waits as long as it
says before it retries a 429 by itself."""
LOADING_RETRY_AFTER_S = 5
"""``Retry-After`` of a request refused while the model loads (or warms up): loading takes seconds to
minutes, so a client that retries by itself (OpenAI's does, on a 503) waits this long between tries."""
PREFLIGHT_MAX_AGE_S = 600
"""How long a browser may reuse a preflight's answer."""
OPEN_PATHS = frozenset({"/health"})
"""Paths answered without the API key, so a supervisor or load balancer can probe readiness."""

NEEDS_ENGINE = frozenset({"/tokenizer_info"})
"""GET paths answered from the loaded engine (its tokenizer): 503 while it loads, as every POST is."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class ServeOptions:
    """Where one server listens, what it calls its model, and how it guards and stops."""

    host: str
    port: int
    model_name: str
    api_key: str | None
    drain_s: float = 10.0
    """How long SIGTERM waits for in-flight requests before cancelling them."""
    engine_id: str | None = None
    """Who this server is, in every ``/health`` answer: a launcher passes its own id and trusts a "ready"
    only with it, so another engine answering on the same port is never taken for its own. None: a fresh
    random id."""


class Server:
    """One HTTP server around one engine thread."""

    def __init__(self, plan: LaunchPlan, factory: EngineFactory, options: ServeOptions) -> None:
        self.plan = plan
        self.options = options
        self.context = plan.memory.context
        self.engine_id = options.engine_id or uuid.uuid4().hex
        self.vocab_size = plan.model.facts.vocab_size
        self.counters = ServerCounters()
        self.started = time.time()
        self.draining = False
        self._factory = factory
        self.engine: EngineLoop | None = None
        self.port: int | None = None
        """The port bound, once listening (``options.port`` may be 0: any free port)."""
        self.kept = responses_store.Store()
        """Replies of the Responses API kept for ``previous_response_id`` (`responses_api`)."""
        self.conversations = conversations.Conversations()
        """Conversations kept for the Conversations API and the Responses API's ``conversation``."""

    # ---- application ---------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._preflight, self._errors, self._auth, self._admission],
            client_max_size=MAX_BODY_BYTES,
        )
        app.on_response_prepare.append(self._allow_origin)
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model}", self.model),
                web.get("/v1/status", self.status),
                web.get("/metrics", self.metrics),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
                web.post(
                    "/v1/messages",
                    partial(self.counted, "messages", run=partial(messages_api.messages, self)),
                ),
                web.post("/v1/messages/count_tokens", partial(messages_api.count_tokens, self)),
                web.post(
                    "/v1/responses",
                    partial(self.counted, "responses", run=partial(responses_api.create, self)),
                ),
                web.get("/v1/responses/{response_id}", partial(responses_api.stored, self)),
                web.delete("/v1/responses/{response_id}", partial(responses_api.drop, self)),
                web.post("/v1/responses/{response_id}/cancel", partial(responses_api.cancel, self)),
                web.get("/v1/responses/{response_id}/input_items", partial(responses_api.input_items, self)),
                web.post("/v1/conversations", partial(conversations_api.create, self)),
                web.get("/v1/conversations/{conversation_id}", partial(conversations_api.get, self)),
                web.post("/v1/conversations/{conversation_id}", partial(conversations_api.update, self)),
                web.delete("/v1/conversations/{conversation_id}", partial(conversations_api.delete, self)),
                web.get(
                    "/v1/conversations/{conversation_id}/items", partial(conversations_api.list_items, self)
                ),
                web.post(
                    "/v1/conversations/{conversation_id}/items", partial(conversations_api.add_items, self)
                ),
                web.get(
                    "/v1/conversations/{conversation_id}/items/{item_id}",
                    partial(conversations_api.get_item, self),
                ),
                web.delete(
                    "/v1/conversations/{conversation_id}/items/{item_id}",
                    partial(conversations_api.delete_item, self),
                ),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                web.get("/tokenizer_info", self.tokenizer_info),
            ]
        )
        return app

    # ---- cross-origin requests (CORS), for pages of `serve.allowed_origins` -----------------------------

    def _origin_allowed(self, request: web.Request) -> str | None:
        """The ``Access-Control-Allow-Origin`` a request from a browser page gets: ``*`` where every origin
        may call, the page's origin where it is listed, else None (no CORS header: the browser keeps the
        answer from the page)."""
        origin = request.headers.get("Origin")
        allowed = self.plan.serve.allowed_origins if self.plan.serve is not None else ()
        if origin is None or not allowed:
            return None
        if "*" in allowed:
            return "*"
        return origin if origin in allowed else None

    @web.middleware
    async def _preflight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A browser's preflight (``OPTIONS`` with ``Access-Control-Request-Method``), answered before the API
        key is checked, since a browser sends none with it."""
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        allowed = self._origin_allowed(request)
        if allowed is None:
            origin = request.headers.get("Origin", "no origin")
            return _error_response(
                p.ApiError(403, f"{origin} may not call this server from a browser (serve.allowed_origins)")
            )
        asked = request.headers.get("Access-Control-Request-Headers", "Authorization, Content-Type")
        headers = {
            "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
            "Access-Control-Allow-Headers": asked,
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
        }
        return web.Response(status=204, headers=headers)

    async def _allow_origin(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every answer to a page of an allowed origin carries its CORS header (streamed ones too: this runs
        as the headers go out)."""
        allowed = self._origin_allowed(request)
        if allowed is not None:
            response.headers["Access-Control-Allow-Origin"] = allowed
            response.headers.add("Vary", "Origin")

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await self._errors_in_shape(request, handler)
        except p.ApiError as exc:
            if request.path.startswith("/v1/messages"):  # Anthropic's shape, naming the Messages API's fields
                body = anthropic.error_body(exc.renamed(anthropic.field_of))
                return web.json_response(body, status=exc.status, headers=exc.headers)
            if request.path.startswith("/v1/responses"):  # naming the Responses API's fields
                return _error_response(exc.renamed(responses.field_of))
            return _error_response(exc)

    async def _errors_in_shape(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every failure as an `ApiError` (which `_errors` writes in the shape of the path's API)."""
        try:
            return await handler(request)
        except p.ApiError:
            raise
        except web.HTTPException as exc:  # aiohttp's own 404 / 405 / 413, as an ApiError
            if exc.status < 400:
                raise
            message = {
                404: f"no route {request.method} {request.path}",
                405: f"{request.method} is not allowed on {request.path}",
                413: f"the request body is larger than {MAX_BODY_BYTES} bytes",
            }.get(exc.status, exc.reason)
            raise p.ApiError(exc.status, message) from None
        except asyncio.CancelledError:
            raise
        except ConnectionResetError:
            # The client closed its side (a half-close counts) before the reply was out; its request was
            # cancelled. Nothing can be sent: the 499 (nginx's "client closed request") is for the access log.
            log.info("%s %s: the client closed the connection before the reply", request.method, request.path)
            return web.Response(status=CLIENT_CLOSED)
        except Exception:
            log.exception("unexpected error serving %s %s", request.method, request.path)
            raise p.ApiError(
                500, "internal server error (logged by the server)", type_="server_error"
            ) from None

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.options.api_key
        if key is None or request.path in OPEN_PATHS:
            return await handler(request)
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if "x-api-key" in request.headers:  # Anthropic's clients send the key this way
            given = token = request.headers["x-api-key"]
        elif scheme.lower() != "bearer":
            token = ""
        if not token or not hmac.compare_digest(token.strip().encode(), key.encode()):
            what = "no API key given" if not given else "the API key is not valid"
            raise p.ApiError(
                401,
                f"{what}: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)",
                "Authorization",
                type_="authentication_error",
                code="invalid_api_key",
            )
        return await handler(request)

    @web.middleware
    async def _admission(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "POST" or request.path in NEEDS_ENGINE:
            engine = self.engine
            if self.draining:
                raise p.ApiError(503, "the server is shutting down", type_="server_error")
            if engine is None or engine.state == "loading":
                frac = engine.loading.fraction if engine else None
                done = f" ({engine.loading.progress} {frac:.0%})" if engine and frac is not None else ""
                raise p.ApiError(
                    503,
                    f"the model is still loading{done}; retry shortly",
                    type_="server_error",
                    headers={"Retry-After": str(LOADING_RETRY_AFTER_S)},
                )
            if engine.state != "ready":
                raise p.ApiError(503, f"the engine is not running: {engine.error}", type_="server_error")
        return await handler(request)

    # ---- read-only endpoints -------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        engine = self.engine
        body: dict[str, Any]
        status = 503
        if engine is None:
            body = {"status": "loading", "progress": "starting"}
        elif self.draining:
            body = {"status": "stopping"}
        elif engine.state == "ready":
            body, status = {"status": "ok", "model": self.options.model_name}, 200
        else:
            body = {
                "status": engine.state,
                "progress": engine.loading.progress,
                "fraction": engine.loading.fraction,
            }
            if engine.error:
                body["error"] = engine.error
        return web.json_response({**body, "engine_id": self.engine_id}, status=status)

    def _model_entry(self) -> dict[str, Any]:
        return {
            "id": self.options.model_name,
            "object": "model",
            "created": int(self.started),
            "owned_by": "strata",
            "max_model_len": self.context,
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_entry()]})

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{model}`` (OpenAI's retrieve): the served model, or 404 naming any other."""
        p.check_model(request.match_info["model"], self.options.model_name)
        return web.json_response(self._model_entry())

    async def status(self, request: web.Request) -> web.Response:
        engine = self.engine
        stats = engine.stats if engine else {}  # one snapshot: the engine thread replaces it, whole
        body = {
            "state": "stopping" if self.draining else (engine.state if engine else "loading"),
            "model": self.options.model_name,
            "uptime_s": round(time.time() - self.started, 3),
            "load_seconds": engine.load_seconds if engine else None,
            "requests_in_flight": engine.in_flight if engine else 0,
            "recoveries": list(engine.recovered) if engine else [],
            "responses": {**self.kept.counts(), "conversations": len(self.conversations)},
            "engine": stats,
            "experts": expert_cache(stats),
            "decisions": [d.model_dump(mode="json") for d in self.plan.decisions],
            "plan": self.plan.to_json(),
        }
        return web.json_response(body)

    async def metrics(self, request: web.Request) -> web.Response:
        engine = self.engine
        text = render(
            self.counters,
            engine.stats if engine else {},
            ready=bool(engine and engine.state == "ready" and not self.draining),
            in_flight=engine.in_flight if engine else 0,
            recoveries=engine.recovered if engine else (),
        )
        return web.Response(
            text=text, content_type="text/plain", charset="utf-8", headers={"X-Format": "0.0.4"}
        )

    # ---- generation ----------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.counted("completions", request, self._completion)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.counted("chat", request, self._chat)

    async def counted(
        self, endpoint: str, request: web.Request, run: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """``run``'s answer to ``request``, counted by ``endpoint`` and outcome (``/metrics``)."""
        outcome = "server_error"
        try:
            response = await run(request)
            outcome = "ok"
            return response
        except p.ApiError as exc:
            outcome = (
                "rejected" if exc.status == 429 else "client_error" if exc.status < 500 else "server_error"
            )
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            outcome = "cancelled"
            raise
        finally:
            self.counters.requests[endpoint, outcome] += 1

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = p.parse_completion(await _json_body(request))
        p.check_model(body.model, self.options.model_name)
        tokenizer = self._engine().tokenizer
        batch = [
            p.prepare(
                body,
                ids,
                context=self.context,
                vocab_size=self.vocab_size,
                default_max_tokens=p.DEFAULT_COMPLETION_MAX_TOKENS,
                echo=(tokenizer.decode(ids) if text is None else text) if body.echo else None,
            )
            for ids, text in p.prompts(body, tokenizer, self.vocab_size)
        ]
        await check_grammar(
            batch[0].request.sampling.grammar, p.grammar_field(body), tokenizer, self.vocab_size
        )
        return await self._run(request, [c for one in batch for c in p.choices(one, body.n)], chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body, prepared = await self.prepare_chat(await _json_body(request))
        return await self._run(request, p.choices(prepared, body.n), chat=True)

    async def prepare_chat(self, raw: Any) -> tuple[p.ChatBody, p.Prepared]:
        """A chat body checked and made the engine's request (`chat_request.prepare_chat`)."""
        return await prepare_chat(
            raw, self._engine().tokenizer, self.options.model_name, self.context, self.vocab_size
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        """A prompt's token ids (a chat's through the model's chat template), as the completion endpoints
        would read it, with the context they must fit in."""
        body = p.parse_tokenize(await _json_body(request))
        if body.model is not None:
            p.check_model(body.model, self.options.model_name)
        tokenizer = self._engine().tokenizer
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt)
        else:
            ids = chat_prompt(tokenizer, body, tool_use(body.model_extra or {}, None))
        return web.json_response({"count": len(ids), "max_model_len": self.context, "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = p.parse_detokenize(await _json_body(request), self.vocab_size)
        if body.model is not None:
            p.check_model(body.model, self.options.model_name)
        return web.json_response({"prompt": self._engine().tokenizer.decode(list(body.tokens))})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """What a client needs to tokenize for this model itself (as vLLM serves it): the end-of-text token's
        text, the chat layout as a Jinja template, and the context; ``/tokenize`` and ``/detokenize`` do the
        rest. lm-evaluation-harness reads it to evaluate a served model without a tokenizer of its own."""
        tokenizer = self._engine().tokenizer
        eos = token_name(tokenizer, tokenizer.eos_ids[0])[0] if tokenizer.eos_ids else None
        body = {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": eos,
            "bos_token": None,
            "pad_token": None,
            "chat_template": tokenizer.chat_template,
            "model_max_length": self.context,
        }
        return web.json_response(body)

    def _engine(self) -> EngineCore:
        assert self.engine is not None and self.engine.engine is not None
        return self.engine.engine

    # ---- what the other APIs' endpoints use: the chat path as a whole ----------------------------------

    async def read_json(self, request: web.Request) -> Any:
        """A request's JSON body; 415 or 400 where it is not JSON."""
        return await _json_body(request)

    def chat_prompt(self, body: p.ChatBody, tools: ToolUse | None) -> list[int]:
        """A chat body's prompt ids, as the chat path reads them."""
        return chat_prompt(self._engine().tokenizer, body, tools)

    def chat_logprobs(self, prepared: p.Prepared, entries: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
        """Generated tokens' log-probabilities as chat's ``logprobs.content`` entries (none where the
        request did not ask)."""
        lps = self.logprobs(prepared, list(entries), True, 0)
        return [] if lps is None else list(lps["content"])

    def submit(self, prepared: p.Prepared) -> Stream:
        """Admit one prepared request (`_admit`: a 429 at capacity), count its prompt and hand it to the
        engine; the caller closes the stream."""
        assert self.engine is not None
        self._admit(1)
        self.counters.prompt_tokens += prepared.prompt_tokens
        return self.engine.submit(prepared.request)

    async def _run(self, request: web.Request, batch: list[p.Prepared], *, chat: bool) -> web.StreamResponse:
        """Run a request's choices (its prompts times ``n``), each a request of its own in the engine, side by
        side; answer them whole or streamed, a choice each in order."""
        assert self.engine is not None
        self._admit(len(batch))
        streams: list[Stream] = []
        try:
            for prepared in batch:
                self.counters.prompt_tokens += prepared.prompt_tokens
                streams.append(self.engine.submit(prepared.request))
            if batch[0].stream:
                return await stream_reply(self, request, streams, batch, chat=chat)
            return await self._whole(streams, batch, chat=chat)
        finally:
            for stream in streams:
                stream.close()

    def _admit(self, choices: int) -> None:
        """Refuse, with 429 and ``Retry-After``, a request whose ``choices`` would bring more requests in
        flight than the batch slots plus ``serve.max_queued``, rather than queue it behind them."""
        assert self.engine is not None and self.plan.serve is not None
        waiting = self.plan.serve.max_queued
        if waiting is None:
            return
        slots, in_flight = max(self.plan.batch.slots, 1), self.engine.in_flight
        if choices > slots + waiting:  # never admitted, however long the client waits: not a 429
            raise p.ApiError(
                400,
                f"the request asks for {choices} choices (its prompts times `n`), more than this server "
                f"admits at once: {slots} batch slots and at most {waiting} waiting (serve.max_queued)",
                "n",
            )
        if in_flight + choices > slots + waiting:
            raise p.ApiError(
                429,
                f"the server is at capacity: {in_flight} requests in flight for {slots} batch slots and at "
                f"most {waiting} waiting (serve.max_queued); retry shortly",
                type_="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    def observe(self, stream: Stream) -> None:
        """A completed request's latency, time to its first token and time per token after it."""
        c = self.counters
        c.latency.observe(time.monotonic() - stream.submitted_at)
        first, last = stream.first_token_at, stream.last_token_at
        if first is None or last is None:
            return
        c.first_token.observe(first - stream.submitted_at)
        if stream.tokens > 1:
            c.per_token.observe((last - first) / (stream.tokens - 1))

    async def pieces(self, stream: Stream) -> AsyncIterator[Piece]:
        """The request's text as the engine sends it (stop strings already cut), ending with its finish."""
        async for event in stream.events():
            self._count_event(event.token_ids, event.accepted_proposals)
            n = len(event.token_ids)
            stream.note_tokens(n)
            if event.finished in ("error", "cancelled"):
                yield Piece("", event.finished, n, event.error)
                return
            yield Piece(
                event.text,
                event.finished,
                n,
                logprobs=event.logprobs,
                prompt_logprobs=event.prompt_logprobs,
                stop=event.stop,
                token_ids=tuple(event.token_ids),
            )

    async def _whole(self, streams: list[Stream], batch: list[p.Prepared], *, chat: bool) -> web.Response:
        """The whole reply: a choice per stream, in order, and the usage of them all."""
        tasks = [
            asyncio.ensure_future(self.collect(s, prepared, chat))
            for s, prepared in zip(streams, batch, strict=True)
        ]
        try:
            done = await asyncio.gather(*tasks)
        except BaseException:  # one choice failed (or the client left): the others are not waited for
            for task in tasks:
                task.cancel()
            raise
        use = usage(batch, streams, [w.tokens for w in done], [w.reasoning_tokens for w in done])
        model, rid = self.options.model_name, batch[0].request.request_id
        choices = []
        for i, (whole, prepared) in enumerate(zip(done, batch, strict=True)):
            reasoning, words, calls = read_reply(prepared, whole.text)
            end: p.OpenAIFinish = "tool_calls" if calls and whole.end == "stop" else whole.end
            body = p.choice(chat, i, words, end, whole.logprobs, calls)
            if prepared.thinking is not None:
                body["message"]["reasoning_content"] = reasoning
            choices.append(body)
        return web.json_response(p.response(chat, rid, model, choices, use))

    async def collect(self, stream: Stream, prepared: p.Prepared, chat: bool) -> Whole:
        """A whole reply: its text (after the echoed prompt, where asked), how it ended, the tokens it
        generated, its ``logprobs`` object and what stopped it."""
        texts: list[str] = []
        entries: list[TokenLogprob] = []
        n = 0
        finish: str | None = None
        stop: str | int | None = None
        thought = think_count(prepared)
        async for piece in self.pieces(stream):
            if thought is not None:
                thought.feed(piece.token_ids)
            if piece.finish == "error":
                raise p.ApiError(500, f"the engine failed this request: {piece.error}", type_="server_error")
            if piece.finish == "cancelled":
                raise p.ApiError(
                    503, "the request was cancelled: the server is shutting down", type_="server_error"
                )
            entries += piece.prompt_logprobs
            if prepared.generate:
                texts.append(piece.text)
                entries += piece.logprobs
                n += piece.tokens
            finish, stop = piece.finish, piece.stop
        self.observe(stream)
        lps = self.logprobs(prepared, entries, chat, 0, lead=prepared.echo is not None)
        end = finish_reason(finish) if prepared.generate else "length"
        reasoning = None if thought is None else thought.tokens
        return Whole((prepared.echo or "") + "".join(texts), end, n, lps, stop, reasoning)

    def logprobs(
        self, prepared: p.Prepared, entries: list[TokenLogprob], chat: bool, offset: int, lead: bool = False
    ) -> dict[str, Any] | None:
        """The reply's ``logprobs`` object for ``entries`` (None where the request did not ask); ``lead``:
        they begin with an echoed prompt's, after its first token."""
        if prepared.request.sampling.logprobs is None:
            return None
        tokenizer = self._engine().tokenizer
        if chat:
            return p.chat_logprobs(tokenizer, entries)
        first = prepared.request.prompt_ids[0] if lead else None
        return p.completion_logprobs(tokenizer, entries, offset, first)

    def _count_event(self, token_ids: tuple[int, ...], accepted: int) -> None:
        self.counters.completion_tokens += len(token_ids)
        self.counters.accepted_proposals += accepted

    # ---- lifecycle -----------------------------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event | None = None) -> int:
        """Bind, load the engine, serve until SIGTERM / SIGINT (or ``stop``, when given) or an engine
        failure; return the exit code."""
        loop = asyncio.get_running_loop()
        runner = JsonErrorRunner(
            self.app(),
            handler_cancellation=True,
            access_log=log,
            access_log_class=AccessLog,
            shutdown_timeout=2.0,
        )
        await runner.setup()
        site = web.TCPSite(runner, self.options.host, self.options.port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            log.error("cannot listen on %s:%d: %s", self.options.host, self.options.port, exc.strerror or exc)
            return 1
        self.port = int(runner.addresses[0][1])
        log.info(
            "listening on http://%s:%d (model `%s`)", self.options.host, self.port, self.options.model_name
        )

        if stop is None:
            stop = asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
        serve = self.plan.serve
        recoveries, timeout = (serve.recoveries, serve.step_timeout_s) if serve is not None else (0, 0.0)
        notifier = Notifier.from_env()
        notifier.send(f"STATUS=loading `{self.options.model_name}`", f"MAINPID={os.getpid()}")
        self.engine = EngineLoop(self._factory, loop, recoveries, timeout)
        self.engine.start()
        engine = self.engine
        address = f"http://{self.options.host}:{self.port}"
        notify = asyncio.ensure_future(
            notifier.run(
                lambda: engine.state == "ready", lambda: f"serving `{self.options.model_name}` on {address}"
            )
        )
        failed = asyncio.ensure_future(self._wait_failed())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        for task in (failed, stopped, notify):
            task.cancel()
        code = 1 if self.engine.state == "failed" else 0
        notifier.send("STOPPING=1", "STATUS=" + ("the engine failed" if code else "stopping"))
        if code == 0:
            log.info("stopping: no new requests; draining %d in flight", self.engine.in_flight)
        await self._drain()
        await runner.cleanup()
        await self.engine.stop(timeout=5.0)
        log.info("stopped")
        return code

    async def _wait_failed(self) -> None:
        assert self.engine is not None
        while self.engine.state != "failed":
            await asyncio.sleep(0.2)

    async def _drain(self) -> None:
        """Stop admitting; let in-flight requests finish within the bound, then cancel what is left."""
        assert self.engine is not None
        self.draining = True
        deadline = time.monotonic() + self.options.drain_s
        while self.engine.in_flight and time.monotonic() < deadline and self.engine.state == "ready":
            await asyncio.sleep(0.05)
        if self.engine.in_flight:
            log.info("cancelling %d requests still in flight", self.engine.in_flight)
            self.engine.cancel_all()
            cancel_deadline = time.monotonic() + 2.0
            while self.engine.in_flight and time.monotonic() < cancel_deadline:
                await asyncio.sleep(0.05)


def _error_response(exc: p.ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers)


async def _json_body(request: web.Request) -> Any:
    if request.content_type != "application/json":
        got = request.headers.get("Content-Type", "none")
        raise p.ApiError(415, f"`Content-Type` must be application/json (got {got})", "Content-Type")
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise p.ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # the decoder's own depth guard, far beyond what `check_structure` allows
        raise p.ApiError(
            400, f"the request body nests arrays or objects more than {p.MAX_DEPTH} deep"
        ) from None
