"""`strata loadtest URL --clients N --seconds T`: a bounded load test against a running engine.

N clients each send one completion request after another for T seconds (with ``--chat``, each holds one
conversation through the chat API, every request sending the chat so far); the command reports requests
served, requests refused at capacity (429, after which a client waits as ``Retry-After`` says), errors,
p50/p95 latency, the aggregate token rate and the share of prompt tokens the server did not read again,
and exits 1 when any request failed (a refusal is not a failure).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..bench.load_test import CHAT_TURNS, run_load
from ..schema.sampling_options import (
    add_json_arguments,
    add_sampling_arguments,
    json_schema_of,
    options_problem,
    sampling_options,
    shape_problem,
    structured_outputs,
)
from ._arg_types import positive_seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the engine's address, e.g. http://127.0.0.1:8000")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    parser.add_argument(
        "--seconds", type=positive_seconds, default=10.0, help="how long to keep sending (default 10)"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    parser.add_argument(
        "--prompt", default="Once upon a time", help="prompt text (made distinct per request)"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="each client holds one conversation through /v1/chat/completions: every request sends a "
        "system prompt all clients share, the messages before with their replies, and a new message (the "
        "prompt text); measures what the server's prefix reuse saves",
    )
    parser.add_argument(
        "--turns",
        type=int,
        default=CHAT_TURNS,
        help=f"with --chat: turns of each conversation before its client begins a new one, so that a chat "
        f"stays within the server's context (default {CHAT_TURNS})",
    )
    add_sampling_arguments(parser, seeded="its client and number")
    parser.add_argument("--stream", action="store_true", help="stream responses and measure the first token")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask the server to generate past end-of-text, so every reply is --max-tokens long (the "
        "ignore_eos extension strata, vLLM and llama.cpp's server take)",
    )
    add_json_arguments(parser)
    parser.add_argument(
        "--api-key-env", help="environment variable holding the API key, if the engine needs one"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    if args.clients < 1 or args.max_tokens < 1 or args.turns < 1:
        print("strata loadtest: --clients, --max-tokens and --turns must be positive", file=sys.stderr)
        return 2
    problem = options_problem(args) or shape_problem(args)
    if problem is None and args.json_schema is not None:
        problem = json_schema_of(args.json_schema)[1]
    if problem:
        print(f"strata loadtest: {problem}", file=sys.stderr)
        return 2
    key = None
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if not key:
            print(f"strata loadtest: ${args.api_key_env} is not set", file=sys.stderr)
            return 2
    try:
        result = run_load(
            args.url,
            clients=args.clients,
            seconds=args.seconds,
            max_tokens=args.max_tokens,
            prompt=args.prompt,
            sampling=sampling_options(args),
            stream=args.stream,
            api_key=key,
            ignore_eos=args.ignore_eos,
            chat=args.chat,
            turns=args.turns,
            shape=structured_outputs(args),
        )
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"strata loadtest: cannot reach the engine at {args.url}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print("\n".join(result.lines()))
    return 1 if result.errors else 0
