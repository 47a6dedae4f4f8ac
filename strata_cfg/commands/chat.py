"""`strata chat (PROFILE | --model DIR | --url URL) ...`: resolve, then talk to the model in the terminal.

The profile is resolved here (with ``--set`` overrides), written as a plan, and handed to
``python -m strata_runtime chat``, which replaces this process: each line typed is a message, each reply
streams back, and the slot keeps the conversation's KV so a turn reads only what is new. With ``--url`` the
conversation goes to a launched engine's chat endpoint instead, and nothing is resolved.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..launch.engine_process import exec_argv, exec_runtime, runtime_argv
from ..schema.errors import ProfileError
from ..schema.sampling_options import add_chat_arguments, chat_problem, sampling_options
from ._common import EXIT_USAGE, add_resolve_options, refused
from .generate import plan_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "profile", nargs="?", default=None, help="profile TOML file (default: the demo profile)"
    )
    parser.add_argument("--model", type=Path, help="a model directory instead of a profile")
    parser.add_argument(
        "--url", help="a launched engine (http://HOST:PORT) to chat with over HTTP, instead of a profile"
    )
    parser.add_argument("--api-key-env", help="with --url: the environment variable holding its API key")
    add_resolve_options(parser)
    add_chat_arguments(parser)


def runtime_args(args: argparse.Namespace) -> list[str]:
    """The runtime command's own options, passed through."""
    out = ["--max-tokens", str(args.max_tokens)]
    for key, value in sampling_options(args).items():
        out += ["--" + key.replace("_", "-"), repr(value)]
    if args.system is not None:
        out += ["--system", args.system]
    if args.seed is not None:
        out += ["--seed", str(args.seed)]
    if args.thinking_budget is not None:
        out += ["--thinking-budget", str(args.thinking_budget)]
    flags = (("--json", args.json), ("--quiet", args.quiet), ("--no-think", args.no_think))
    return out + [flag for flag, on in flags if on]


def run(args: argparse.Namespace) -> int:
    if sum(x is not None for x in (args.profile, args.model, args.url)) > 1:
        print("strata chat: give a PROFILE, --model DIR or --url URL, one of them", file=sys.stderr)
        return EXIT_USAGE
    if args.api_key_env and args.url is None:
        print("strata chat: --api-key-env goes with --url", file=sys.stderr)
        return EXIT_USAGE
    problem = chat_problem(args)
    if problem:
        print(f"strata chat: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if args.url is not None:  # no plan: the engine is already running
        key = ["--api-key-env", args.api_key_env] if args.api_key_env else []
        exec_argv(runtime_argv("chat", "--url", args.url, *key, *runtime_args(args)))
    try:
        plan = plan_of(args)
    except ProfileError as exc:
        return refused(exc, as_json=args.json)
    exec_runtime("chat", plan, runtime_args(args))
