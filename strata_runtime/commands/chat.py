"""`python -m strata_runtime chat (--plan plan.json | --url URL)`: a conversation with the model in the
terminal, run here from a plan, or with a launched engine over HTTP (its chat endpoint).

Each line read from stdin is the user's next message; the reply streams to stdout as it comes, and the whole
conversation goes through the model's chat template every turn. With prefix reuse (the plan's
``memory.prefix_reuse``) a turn reads only what is new since the last: the slot kept the history's KV. A
line ``/reset`` starts the conversation again, ``/quit`` (or the end of input) ends it. Ctrl-C stops a reply
(what was said stays in the history); at the prompt it ends the conversation.

Where the conversation outgrows the context, its oldest turns are left out (the system message stays),
and the turn's line says how many. ``--json`` prints one object per turn instead of the text, for scripts.

A model that reasons in think blocks (Qwen3) has its reasoning written to stderr (dimmed on a terminal) and
its answer to stdout; the history keeps the reasoning apart (``reasoning_content``), for the chat template
to show or leave out. ``--no-think`` turns the reasoning off through the template (``enable_thinking``), and
``--thinking-budget N`` closes a block after N tokens.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from strata_cfg.schema.plan_file import read_plan
from strata_cfg.schema.sampling_options import add_chat_arguments, chat_problem, sampling_options

from ..api import Reasoning, Request, RequestHandle, SamplingParams, Tokenizer
from ..thinking import ThinkSplitter, think_ids, thinking_at_end
from .http_client import Endpoint, events

if TYPE_CHECKING:
    from ..engine import Engine

LEAST_ROOM = 16
"""Tokens a turn must be able to generate; older turns are left out of the prompt to make this room."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--plan", type=Path, help="a resolved plan (strata plan --json): the engine runs here")
    where.add_argument("--url", help="a launched engine (http://HOST:PORT): chat with it over HTTP")
    parser.add_argument("--api-key-env", help="with --url: the environment variable holding its API key")
    add_chat_arguments(parser)


class Conversation(Protocol):
    def reset(self) -> None: ...

    def turn(self, text: str) -> None: ...

    def close(self) -> None: ...


def run(args: argparse.Namespace) -> int:
    problem = chat_problem(args)
    if problem is None and args.api_key_env and not os.environ.get(args.api_key_env):
        problem = f"${args.api_key_env} is not set"
    if problem:
        print(f"strata_runtime chat: {problem}", file=sys.stderr)
        return 2
    if not args.quiet and not args.json:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        chat = _over_http(args) if args.url else _here(args)
    except (OSError, ValueError, RuntimeError, http.client.HTTPException) as exc:
        print(f"strata_runtime chat: {exc}", file=sys.stderr)
        return 1
    interactive = sys.stdin.isatty()
    if interactive and not args.quiet:
        print("Type a message; /reset starts again, /quit ends.", file=sys.stderr)
    try:
        while True:
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line or line.strip() in ("/quit", "/exit"):
                break
            if line.strip() == "/reset":
                chat.reset()
                if not args.json:
                    print("(a new conversation)", file=sys.stderr)
            elif line.strip():
                chat.turn(line.rstrip("\n"))
    except KeyboardInterrupt:
        print(file=sys.stderr)
    finally:
        chat.close()
    return 0


def _here(args: argparse.Namespace) -> Chat:
    from ..engine import Engine
    from ..weights.progress import stderr_progress

    plan = read_plan(args.plan)
    return Chat(Engine(plan, progress=None if args.quiet else stderr_progress), plan.memory.context, args)


def _over_http(args: argparse.Namespace) -> HttpChat:
    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    endpoint = Endpoint(args.url, key)
    return HttpChat(endpoint, endpoint.model(), args)


@dataclass
class Said:
    """A reply as it streamed: its answer and reasoning, written out as they come (`say`), how it ended."""

    echo: bool
    answer: str = ""
    reasoning: str | None = None
    """The reply's think block (None where it has none, or the model does not reason)."""
    finish: str = ""
    started: float = field(default_factory=time.perf_counter)
    first: float = 0.0
    """Seconds to the first token."""
    seconds: float = 0.0

    def say(self, part: str, text: str) -> None:
        """More of the reply: ``reasoning`` to stderr (dimmed on a terminal), the answer to stdout."""
        if not text:
            return
        if not self.first:
            self.first = time.perf_counter() - self.started
        if part == "reasoning":
            self.reasoning = (self.reasoning or "") + text
            if self.echo:
                sys.stderr.write(f"{DIM}{text}{PLAIN}" if sys.stderr.isatty() else text)
                sys.stderr.flush()
            return
        if self.echo and self.reasoning is not None and not self.answer:
            sys.stderr.write("\n")
        self.answer += text
        if self.echo:
            sys.stdout.write(text)
            sys.stdout.flush()

    def done(self, finish: str) -> None:
        self.finish, self.seconds = finish, time.perf_counter() - self.started

    def message(self) -> dict[str, Any]:
        """The reply as the history keeps it."""
        message: dict[str, Any] = {"role": "assistant", "content": self.answer}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        return message


DIM, PLAIN = "\x1b[2m", "\x1b[0m"


def report(args: argparse.Namespace, said: Said, tokens: int, prompt: int, cached: int, dropped: int) -> None:
    """A turn's one JSON object (``--json``), or the line after its text: tokens, rate, time to the first
    token, the prompt tokens reused, the messages left out and how it ended."""
    if args.json:
        out = {
            "reply": said.answer,
            "reasoning": said.reasoning,
            "finish_reason": said.finish,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "completion_tokens": tokens,
            "dropped_messages": dropped,
            "seconds": round(said.seconds, 4),
        }
        print(json.dumps(out), flush=True)
        return
    print(flush=True)
    if args.quiet:
        return
    rate = tokens / said.seconds if said.seconds else 0.0
    line = (
        f"[{tokens} tokens, {rate:.1f} tok/s, first token {said.first * 1e3:.0f} ms, "
        f"{cached} of {prompt} prompt tokens reused"
    )
    line += f", {dropped} oldest messages left out" if dropped else ""
    ending = {"cancelled": ", stopped", "length": ", cut at --max-tokens"}
    print(line + ending.get(said.finish, "") + "]", file=sys.stderr)


def _history(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [{"role": "system", "content": args.system}] if args.system else []


class Chat:
    """One conversation: its messages, and each turn through the engine."""

    def __init__(self, engine: Engine, context: int, args: argparse.Namespace) -> None:
        self.engine, self.context, self.args = engine, context, args
        self.messages = _history(args)
        self.turns = 0

    def reset(self) -> None:
        self.messages = _history(self.args)

    def close(self) -> None:
        self.engine.close()

    def turn(self, text: str) -> None:
        """The user says ``text``; the reply streams out and joins the history."""
        self.messages.append({"role": "user", "content": text})
        tok: Tokenizer = self.engine.tokenizer
        kwargs = {"enable_thinking": False} if self.args.no_think else None
        fitted = fit(tok, self.messages, self.context, min(self.args.max_tokens, LEAST_ROOM), kwargs)
        if fitted is None:
            self.messages.pop()
            why = f"the message alone does not leave {LEAST_ROOM} tokens of the {self.context}-token context"
            print(f"(not sent: {why})", file=sys.stderr)
            return
        ids, dropped = fitted
        head = 1 if self.args.system else 0
        del self.messages[head : head + dropped]  # for good: later turns then begin as this one does
        seed = None if self.args.seed is None else (self.args.seed + self.turns) % 2**63
        tags = think_ids(tok)
        ends = thinking_at_end(tok, ids) if tags is not None else None
        reasoning = None
        if tags is not None and ends != "closed" and self.args.thinking_budget is not None:
            reasoning = Reasoning(*tags, opened=ends == "open", budget=self.args.thinking_budget)
        sampling = SamplingParams(**sampling_options(self.args), seed=seed, reasoning=reasoning)
        room = min(self.args.max_tokens, self.context - len(ids))
        handle = self.engine.submit(Request(tuple(ids), room, sampling))
        self.turns += 1
        splitter = ThinkSplitter(ends == "open") if tags is not None else None
        said = stream(self.engine, handle, Said(not self.args.json), splitter)
        self.messages.append(said.message())
        report(self.args, said, handle.completion_tokens, len(ids), handle.cached_tokens, dropped)


class HttpChat:
    """One conversation with a launched engine over HTTP: each turn the whole history to its chat endpoint,
    streamed back. Where the engine says the history outgrows its context, the oldest turn is left out and
    the turn is sent again."""

    def __init__(self, endpoint: Endpoint, model: str, args: argparse.Namespace) -> None:
        self.endpoint, self.model, self.args = endpoint, model, args
        self.messages = _history(args)
        self.turns = 0

    def reset(self) -> None:
        self.messages = _history(self.args)

    def close(self) -> None:
        self.endpoint.close()

    def _body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages,
            "max_tokens": self.args.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **sampling_options(self.args),
        }
        if self.args.seed is not None:
            body["seed"] = (self.args.seed + self.turns) % 2**63
        if self.args.no_think:
            body["chat_template_kwargs"] = {"enable_thinking": False}
        if self.args.thinking_budget is not None:
            body["thinking_token_budget"] = self.args.thinking_budget
        return body

    def turn(self, text: str) -> None:
        """The user says ``text``; the reply streams out and joins the history."""
        self.messages.append({"role": "user", "content": text})
        head, dropped = (1 if self.args.system else 0), 0
        while True:
            r = self.endpoint.request("POST", "/v1/chat/completions", self._body())
            if r.status == 200:
                break
            error = (json.loads(r.read() or b"{}").get("error") or {}) if r.status < 500 else {}
            later = [i for i, m in enumerate(self.messages) if m["role"] == "user" and i > head]
            if error.get("code") == "context_length_exceeded" and later:
                dropped += later[0] - head
                del self.messages[head : later[0]]  # the oldest turn, for good
                continue
            self.messages.pop()
            why = error.get("message") or f"HTTP {r.status}"
            print(f"(not sent: {why})", file=sys.stderr)
            return
        self.turns += 1
        said, use = Said(not self.args.json), dict[str, Any]()
        try:
            for chunk in events(r):
                if "error" in chunk:
                    said.done("error")
                    print(f"\n(the engine ended the reply: {chunk['error'].get('message')})", file=sys.stderr)
                    break
                use = chunk.get("usage") or use
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta") or {}
                    said.say("reasoning", delta.get("reasoning_content") or "")
                    said.say("content", delta.get("content") or "")
                    if choice.get("finish_reason"):
                        said.done(choice["finish_reason"])
        except KeyboardInterrupt:
            self.endpoint.close()  # the server cancels a request whose client left
            said.done("cancelled")
        self.messages.append(said.message())
        cached = (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        report(self.args, said, use.get("completion_tokens", 0), use.get("prompt_tokens", 0), cached, dropped)


def fit(
    tok: Tokenizer,
    messages: list[dict[str, Any]],
    context: int,
    room: int,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], int] | None:
    """The prompt ids of ``messages`` with the oldest turns after a system message left out until the
    prompt leaves ``room`` tokens of the context, and how many messages were left out; None where even the
    last message alone does not. A turn is a user's message and the replies to it, left out together, so
    the prompt still begins with a user's message."""
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    rest = messages[len(head) :]
    for dropped in (i for i, m in enumerate(rest) if m["role"] == "user"):
        ids = tok.apply_chat_template(head + rest[dropped:], None, template_kwargs)
        if len(ids) + room <= context:
            return ids, dropped
    return None


def stream(engine: Engine, handle: RequestHandle, said: Said, splitter: ThinkSplitter | None = None) -> Said:
    """Run ``handle``'s request to its end, its text said as it comes (the reasoning ``splitter`` reads
    apart); Ctrl-C stops it."""
    while not said.finish:
        try:
            engine.step()
        except KeyboardInterrupt:
            handle.cancel()
            continue
        while not handle.events.empty():
            event = handle.events.get()
            pieces = [("content", event.text)] if splitter is None else splitter.feed(event.text)
            if splitter is not None and event.finished:
                pieces += splitter.close()
            for part, text in pieces:
                said.say(part, text)
            if event.finished:
                said.done(event.finished)
    return said
