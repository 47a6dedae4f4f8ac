"""`strata check PROFILE...`: validate and resolve every profile, reporting every problem of every file."""

from __future__ import annotations

import argparse
import json
from collections import Counter

from ..plan.from_profile import resolve_path
from ..report.problems import problems_text
from ..schema.errors import ProfileError
from ._common import EXIT_OK, EXIT_REFUSED, add_resolve_options

EPILOG = (
    "exit codes: 0 every profile resolves (notes and warnings allowed), 1 at least one profile was refused "
    "(with --strict also when a rule turned off or changed what a profile asked for), 2 usage error"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profiles", nargs="*", help="profile TOML files (default: the embedded demo profile)")
    add_resolve_options(parser)
    parser.add_argument("--json", action="store_true", help='print {"profiles": [{file, ok, errors, ...}]}')
    parser.epilog = EPILOG


def run(args: argparse.Namespace) -> int:
    results = []
    status = EXIT_OK
    for path in args.profiles or [None]:
        try:
            plan = resolve_path(path, args.sets, strict=args.strict).plan
        except ProfileError as exc:
            status = EXIT_REFUSED
            results.append({"file": path, "ok": False, "errors": [p.to_json() for p in exc.problems]})
            if not args.json:
                print(f"refused  {path or 'demo'}")
                for line in problems_text(exc.problems).splitlines():
                    print(f"  {line}")
            continue
        counts = Counter(d.severity for d in plan.decisions)
        asked = [d.rule for d in plan.decisions if d.requested]
        results.append(
            {"file": path, "ok": True, "errors": [], "decisions": dict(counts), "overrides_asked": asked}
        )
        if not args.json:
            summary = ", ".join(f"{n} {sev}" for sev, n in sorted(counts.items())) or "no decisions"
            extra = f"; overrides what it asked: {', '.join(asked)}" if asked else ""
            print(f"ok       {path or 'demo'}  ({summary}{extra})")
    if args.json:
        print(json.dumps({"profiles": results}, indent=2))
    return status
