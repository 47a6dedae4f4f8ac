"""`strata explain [PROFILE] KEY`: a resolved key, where its value came from, which rules touched it."""

from __future__ import annotations

import argparse
import difflib
import json
import sys

from ..plan.from_profile import resolve_path
from ..render import decision_lines
from ..schema.errors import ProfileError
from ..schema.plan import LaunchPlan
from ._common import EXIT_OK, EXIT_REFUSED, add_resolve_options, refused


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "args",
        nargs="+",
        metavar="[PROFILE] KEY",
        help="profile file (default: the demo) and a dotted key or table",
    )
    add_resolve_options(parser)


def explain_text(plan: LaunchPlan, key: str) -> str | None:
    """The explanation of ``key`` (or of every key under a table such as ``batch``); None if unknown."""
    keys = [k for k in plan.settings if k == key or k.startswith(key + ".")]
    if not keys:
        return None
    lines: list[str] = []
    for k in keys:
        s = plan.settings[k]
        lines.append(f"{k} = {json.dumps(s.value)}")
        lines.append(f"  source     {s.source}")
        if s.requested is not None:
            lines.append(f"  asked for  {json.dumps(s.requested)}")
        if s.rules:
            lines.append(f"  rules      {', '.join(s.rules)}")
        fired = [d for d in plan.decisions if d.key == k]
        if fired:
            lines.append("  decisions")
            lines += ["    " + line for line in decision_lines(fired)]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    if len(args.args) > 2:
        print("strata explain: give [PROFILE] KEY", file=sys.stderr)
        return 2
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
