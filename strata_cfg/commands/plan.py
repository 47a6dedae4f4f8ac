"""`strata plan [PROFILE]`: what a profile resolves to, as text, JSON, or the Strata C++ engine's command
line (``--emit engine-args``, for people who run that engine; this package does not install it)."""

from __future__ import annotations

import argparse
import json

from ..report.engine_args import engine_args_text
from ..report.plan_text import plan_text
from ..schema.errors import ProfileError
from ._common import (
    EXIT_CODES_HELP,
    EXIT_OK,
    add_profile_argument,
    add_resolve_options,
    refused,
    resolve_args,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_argument(parser)
    add_resolve_options(parser)
    parser.add_argument(
        "--emit",
        choices=("text", "json", "engine-args"),
        default="text",
        help=(
            "text (default), the plan's JSON, or engine-args: the equivalent command line of the Strata C++ "
            "engine (strata-engine), for people who run that engine; this package does not install it, "
            "and `strata launch` runs python -m strata_runtime on the plan instead"
        ),
    )
    parser.add_argument("--json", dest="emit", action="store_const", const="json", help="same as --emit json")
    parser.epilog = EXIT_CODES_HELP


def run(args: argparse.Namespace) -> int:
    as_json = args.emit == "json"
    try:
        plan = resolve_args(args).plan
    except ProfileError as exc:
        return refused(exc, as_json=as_json)
    if as_json:
        print(json.dumps(plan.to_json(), indent=2))
    elif args.emit == "engine-args":
        print(engine_args_text(plan), end="")
    else:
        print(plan_text(plan), end="")
    return EXIT_OK
