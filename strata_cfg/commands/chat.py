"""`strata chat (PROFILE | --model DIR) ...`: resolve, then talk to the model in the terminal.

The profile is resolved here (with ``--set`` overrides), written as a plan, and handed to
``python -m strata_runtime chat``, which replaces this process: each line typed is a message, each reply
streams back, and the slot keeps the conversation's KV so a turn reads only what is new.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..launch.engine_process import exec_runtime
from ..plan.from_profile import resolve_text
from ..schema.errors import ProfileError
from ..schema.sampling_options import add_penalty_arguments, options_problem, sampling_options
from ._common import EXIT_USAGE, add_resolve_options, refused, resolve_args
from .generate import model_profile_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "profile", nargs="?", default=None, help="profile TOML file (default: the demo profile)"
    )
    parser.add_argument("--model", type=Path, help="a model directory instead of a profile")
    add_resolve_options(parser)
    parser.add_argument("--system", help="a system message that starts the conversation")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens a reply may generate (512)")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 is greedy (default 0.7)")
    parser.add_argument("--top-p", type=float, default=0.8, help="top-p (default 0.8)")
    parser.add_argument("--top-k", type=int, default=20, help="top-k (default 20; 0: none)")
    add_penalty_arguments(parser)
    parser.add_argument("--seed", type=int, help="seed of the first reply, the next ones +1 each")
    parser.add_argument("--json", action="store_true", help="one JSON object per turn instead of the text")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, start-up log or turn lines")


def runtime_args(args: argparse.Namespace) -> list[str]:
    """The runtime command's own options, passed through."""
    out = ["--max-tokens", str(args.max_tokens)]
    for key, value in sampling_options(args).items():
        out += ["--" + key.replace("_", "-"), repr(value)]
    if args.system is not None:
        out += ["--system", args.system]
    if args.seed is not None:
        out += ["--seed", str(args.seed)]
    return out + [flag for flag, on in (("--json", args.json), ("--quiet", args.quiet)) if on]


def run(args: argparse.Namespace) -> int:
    if args.model is not None and args.profile is not None:
        print("strata chat: give a PROFILE or --model DIR, not both", file=sys.stderr)
        return EXIT_USAGE
    problem = options_problem(args)
    if args.max_tokens < 1:
        problem = f"--max-tokens must be at least 1, not {args.max_tokens}"
    elif args.seed is not None and not 0 <= args.seed < 2**63:
        problem = f"--seed must be in [0, 2^63), not {args.seed}"
    if problem:
        print(f"strata chat: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.model is not None:
            plan = resolve_text(model_profile_text(args.model), None, args.sets, strict=args.strict).plan
        else:
            plan = resolve_args(args).plan
    except ProfileError as exc:
        return refused(exc, as_json=args.json)
    exec_runtime("chat", plan, runtime_args(args))
