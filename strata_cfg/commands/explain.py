"""`strata explain [PROFILE] KEY`: a resolved key, where its value came from, which rules touched it."""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from ..plan.from_profile import resolve_path
from ..report.explain import explain_text
from ..schema.errors import ProfileError
from ._common import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, add_resolve_options, refused


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "args",
        nargs="+",
        metavar="[PROFILE] KEY",
        help="profile file (default: the demo) and a dotted key or table",
    )
    add_resolve_options(parser)


def _looks_like_a_profile(arg: str) -> bool:
    """A profile file rather than a dotted key: it names a file, or ends in ``.toml``."""
    return arg.endswith(".toml") or os.path.isfile(arg)


def run(args: argparse.Namespace) -> int:
    if len(args.args) > 2:
        print("strata explain: give [PROFILE] KEY", file=sys.stderr)
        return EXIT_USAGE
    if len(args.args) == 1 and _looks_like_a_profile(args.args[0]):
        print(
            f"strata explain: give a KEY after the profile (strata explain {args.args[0]} batch.mtp)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    path, key = (args.args[0], args.args[1]) if len(args.args) == 2 else (None, args.args[0])
    try:
        plan = resolve_path(path, args.sets, strict=args.strict).plan
    except ProfileError as exc:
        return refused(exc)
    text = explain_text(plan, key)
    if text is None:
        close = difflib.get_close_matches(key, list(plan.settings), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; keys: {', '.join(plan.settings)}"
        print(f"strata explain: no resolved key {key!r}{hint}", file=sys.stderr)
        return EXIT_REFUSED
    print(text, end="")
    return EXIT_OK
