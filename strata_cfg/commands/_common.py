"""What every profile command shares: the PROFILE argument, ``--set``, ``--strict``, and problem output."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from ..plan.from_profile import Resolved, resolve_path
from ..profile.overrides import parse_set
from ..report.problems import problems_json, problems_text
from ..schema.errors import Problem, ProfileError

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_CODES_HELP = (
    "exit codes: 0 the plan resolves, 1 a profile was refused (every problem is printed), 2 usage error"
)


def _set_item(text: str) -> tuple[str, Any]:
    try:
        return parse_set(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_profile_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "profile", nargs="?", default=None, help="profile TOML file (default: the embedded demo profile)"
    )


def add_resolve_options(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE`` (repeatable) and ``--strict``."""
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        type=_set_item,
        metavar="KEY=VALUE",
        help="override one profile key, value in TOML (--set batch.slots=4 --set split.layers='[20]')",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="refuse the plan when a rule turned off or changed what you asked for",
    )


def resolve_args(args: argparse.Namespace) -> Resolved:
    """Load, gather facts and resolve the profile the arguments name. Raises `ProfileError`."""
    return resolve_path(args.profile, args.sets, strict=args.strict)


def print_problems(problems: list[Problem], *, as_json: bool = False, stream: TextIO | None = None) -> None:
    """Problems as text on stderr, or as the ``{"errors": [...]}`` JSON contract on stdout."""
    if as_json:
        print(json.dumps(problems_json(problems), indent=2), file=stream or sys.stdout)
    else:
        print(problems_text(problems), end="", file=stream or sys.stderr)


def refused(exc: ProfileError, *, as_json: bool = False) -> int:
    print_problems(exc.problems, as_json=as_json)
    return EXIT_REFUSED
