"""`strata serve --plan plan.json`: run the engine's HTTP server in the foreground, unsupervised.

This is the engine process itself (``python -m strata_runtime serve``), for when something else (systemd, a
container runtime) supervises it. `strata launch PROFILE` resolves a profile, writes the plan and supervises
this same process.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..launch.engine_process import runtime_argv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plan", required=True, type=Path, help="a resolved plan (strata plan --json > plan.json)"
    )
    parser.add_argument("--host", help="override the plan's serve.host")
    parser.add_argument("--port", type=int, help="override the plan's serve.port")
    parser.add_argument(
        "--drain-seconds", type=float, help="on SIGTERM, how long in-flight requests may finish (default 10)"
    )


def run(args: argparse.Namespace) -> int:
    if not args.plan.is_file():
        print(f"strata serve: no plan file at {args.plan}", file=sys.stderr)
        return 2
    argv = runtime_argv("serve", plan_file=args.plan)
    for flag, value in (
        ("--host", args.host),
        ("--port", args.port),
        ("--drain-seconds", args.drain_seconds),
    ):
        if value is not None:
            argv += [flag, str(value)]
    # Replace this process, so that signals reach the server directly and its exit code is ours.
    os.execv(argv[0], argv)
