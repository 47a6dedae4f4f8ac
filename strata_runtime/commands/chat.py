"""`python -m strata_runtime chat --plan plan.json`: a conversation with the model in the terminal.

Each line read from stdin is the user's next message; the reply streams to stdout as the engine accepts it,
and the whole conversation goes through the model's chat template every turn. With prefix reuse (the
plan's ``memory.prefix_reuse``) a turn reads only what is new since the last: the slot kept the history's KV.
A line ``/reset`` starts the conversation again, ``/quit`` (or the end of input) ends it. Ctrl-C stops a
reply (what was said stays in the history); at the prompt it ends the conversation.

Where the conversation outgrows the context, its oldest turns are left out (the system message stays),
and the turn's line says how many. ``--json`` prints one object per turn instead of the text, for scripts.

A model that reasons in think blocks (Qwen3) has its reasoning written to stderr (dimmed on a terminal) and
its answer to stdout; the history keeps the reasoning apart (``reasoning_content``), for the chat template
to show or leave out. ``--no-think`` turns the reasoning off through the template (``enable_thinking``), and
``--thinking-budget N`` closes a block after N tokens.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from strata_cfg.schema.plan_file import read_plan
from strata_cfg.schema.sampling_options import add_chat_arguments, chat_problem, sampling_options

from ..api import Reasoning, Request, RequestHandle, SamplingParams, Tokenizer
from ..chat import ThinkSplitter, think_ids, thinking_at_end

if TYPE_CHECKING:
    from ..engine import Engine

LEAST_ROOM = 16
"""Tokens a turn must be able to generate; older turns are left out of the prompt to make this room."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True, type=Path, help="a resolved plan (strata plan --json)")
    add_chat_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ..api import PlanMismatch
    from ..engine import Engine
    from ..weights.progress import stderr_progress

    problem = chat_problem(args)
    if problem:
        print(f"strata_runtime chat: {problem}", file=sys.stderr)
        return 2
    if not args.quiet and not args.json:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        plan = read_plan(args.plan)
        engine = Engine(plan, progress=None if args.quiet else stderr_progress)
    except (PlanMismatch, OSError, ValueError, RuntimeError) as exc:
        print(f"strata_runtime chat: {exc}", file=sys.stderr)
        return 1
    chat = Chat(engine, plan.memory.context, args)
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
        engine.close()
    return 0


class Chat:
    """One conversation: its messages, and each turn through the engine."""

    def __init__(self, engine: Engine, context: int, args: argparse.Namespace) -> None:
        self.engine, self.context, self.args = engine, context, args
        self.messages: list[dict[str, Any]] = []
        self.turns = 0
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.args.system}] if self.args.system else []

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
        said = stream(self.engine, handle, echo=not self.args.json, splitter=splitter)
        message: dict[str, Any] = {"role": "assistant", "content": said.answer}
        if said.reasoning is not None:
            message["reasoning_content"] = said.reasoning
        self.messages.append(message)
        tokens = handle.completion_tokens
        if self.args.json:
            out = {
                "reply": said.answer,
                "reasoning": said.reasoning,
                "finish_reason": said.finish,
                "prompt_tokens": len(ids),
                "cached_tokens": handle.cached_tokens,
                "completion_tokens": tokens,
                "dropped_messages": dropped,
                "seconds": round(said.seconds, 4),
            }
            print(json.dumps(out), flush=True)
            return
        print(flush=True)
        if not self.args.quiet:
            rate = tokens / said.seconds if said.seconds else 0.0
            line = (
                f"[{tokens} tokens, {rate:.1f} tok/s, first token {said.first * 1e3:.0f} ms, "
                f"{handle.cached_tokens} of {len(ids)} prompt tokens reused"
            )
            line += f", {dropped} oldest messages left out" if dropped else ""
            line += (
                ", stopped"
                if said.finish == "cancelled"
                else (", cut at --max-tokens" if said.finish == "length" else "")
            )
            print(line + "]", file=sys.stderr)


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


@dataclass
class Said:
    """A reply as `stream` ran it."""

    answer: str
    reasoning: str | None
    """The reply's think block (None where it has none, or the model does not reason)."""
    finish: str
    seconds: float
    first: float
    """Seconds to the first token."""


DIM, PLAIN = "\x1b[2m", "\x1b[0m"


def stream(engine: Engine, handle: RequestHandle, echo: bool, splitter: ThinkSplitter | None = None) -> Said:
    """Run ``handle``'s request to its end, writing its text to stdout as it comes where ``echo`` (the
    reasoning ``splitter`` reads apart to stderr, dimmed on a terminal); Ctrl-C stops it."""
    t0 = time.perf_counter()
    first = 0.0
    answer, reasoning, finish = "", None, ""
    dim = sys.stderr.isatty()
    while not finish:
        try:
            engine.step()
        except KeyboardInterrupt:
            handle.cancel()
            continue
        while not handle.events.empty():
            event = handle.events.get()
            if event.token_ids and not first:
                first = time.perf_counter() - t0
            finish = event.finished or finish
            pieces = [("content", event.text)] if splitter is None else splitter.feed(event.text)
            if splitter is not None and finish:
                pieces += splitter.close()
            for part, text in pieces:
                if part == "reasoning":
                    reasoning = (reasoning or "") + text
                    if echo:
                        sys.stderr.write(f"{DIM}{text}{PLAIN}" if dim else text)
                        sys.stderr.flush()
                    continue
                if echo and reasoning is not None and not answer:
                    sys.stderr.write("\n")
                answer += text
                if echo:
                    sys.stdout.write(text)
                    sys.stdout.flush()
    return Said(answer, reasoning, finish, time.perf_counter() - t0, first)
