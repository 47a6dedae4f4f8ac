"""`strata diff A [B] [--set k=v ...]`: what changes in the plan between two profiles, or with overrides.

With one profile, A is resolved as written and again with the ``--set`` overrides; with two, both are
resolved (the overrides apply to both). Decisions that appear or disappear are listed after the values.
"""

from __future__ import annotations

import argparse
import json

from ..plan.from_profile import resolve_path
from ..report.diff import changes_text, plan_changes
from ..schema.errors import ProfileError
from ._common import EXIT_OK, add_resolve_options, refused


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", help="profile file")
    parser.add_argument(
        "b", nargs="?", help="second profile file (default: A again, with the --set overrides)"
    )
    add_resolve_options(parser)
    parser.add_argument(
        "--json", action="store_true", help="print {changed, decisions_added, decisions_removed}"
    )
    parser.epilog = (
        "exit codes: 0 compared (whether or not anything changed), 1 a profile was refused, 2 usage"
    )


def run(args: argparse.Namespace) -> int:
    try:
        if args.b is None:
            a = resolve_path(args.a, (), strict=args.strict).plan
            b = resolve_path(args.a, args.sets, strict=args.strict).plan
            b_name = f"{args.a} " + " ".join(f"--set {k}={json.dumps(v)}" for k, v in args.sets)
        else:
            a = resolve_path(args.a, args.sets, strict=args.strict).plan
            b = resolve_path(args.b, args.sets, strict=args.strict).plan
            b_name = args.b
    except ProfileError as exc:
        return refused(exc, as_json=args.json)
    changes = plan_changes(a, b)
    if args.json:
        print(json.dumps(changes, indent=2))
    else:
        print(changes_text(changes, args.a, b_name.strip()), end="")
    return EXIT_OK
