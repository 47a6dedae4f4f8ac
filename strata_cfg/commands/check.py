"""`strata check PROFILE...`: validate and resolve every profile, reporting every problem of every file.

A pattern the shell left unexpanded (``'profiles/**/*.toml'``) is expanded here, ``**`` included. A file that
another checked profile extends is a *base*: it is validated, and resolved through the profiles that extend
it, not on its own (a base such as ``profiles/base/qwen3-30b-a3b.toml`` names no machine).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections import Counter
from typing import Any

from ..plan.from_profile import resolve_loaded
from ..profile.load import LoadedProfile, load
from ..report.problems import problems_text
from ..schema.errors import ProfileError
from ._common import EXIT_OK, EXIT_REFUSED, add_resolve_options

EPILOG = (
    "exit codes: 0 every profile resolves (notes and warnings allowed), 1 at least one profile was refused "
    "(with --strict also when a rule turned off or changed what a profile asked for), 2 usage error"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "profiles",
        nargs="*",
        help="profile TOML files, or patterns such as 'profiles/**/*.toml' (default: the embedded demo)",
    )
    add_resolve_options(parser)
    parser.add_argument("--json", action="store_true", help='print {"profiles": [{file, ok, errors, ...}]}')
    parser.epilog = EPILOG


def expand(args: list[str]) -> list[str]:
    """The files the arguments name: a pattern that is not itself a file is expanded (``**`` too)."""
    files: list[str] = []
    for arg in args:
        if any(c in arg for c in "*?[") and not os.path.exists(arg):
            files += sorted(glob.glob(arg, recursive=True)) or [arg]  # no match: reported as missing
        else:
            files.append(arg)
    return list(dict.fromkeys(files))


def _bases(loaded: list[LoadedProfile]) -> Counter[str]:
    """How many of the other checked profiles extend each file (by real path)."""
    count: Counter[str] = Counter()
    for lp in loaded:
        for base in {os.path.realpath(f) for f in lp.files[:-1]}:
            count[base] += 1
    return count


def _refused(path: str | None, exc: ProfileError, *, quiet: bool) -> dict[str, Any]:
    if not quiet:
        print(f"refused  {path or 'demo'}")
        for line in problems_text(exc.problems).splitlines():
            print(f"  {line}")
    return {"file": path, "ok": False, "errors": [p.to_json() for p in exc.problems]}


def _resolved(path: str | None, lp: LoadedProfile, *, strict: bool, quiet: bool) -> dict[str, Any]:
    try:
        plan = resolve_loaded(lp, strict=strict).plan
    except ProfileError as exc:
        return _refused(path, exc, quiet=quiet)
    counts = Counter(d.severity for d in plan.decisions)
    asked = [d.rule for d in plan.decisions if d.requested]
    if not quiet:
        summary = ", ".join(f"{n} {sev}" for sev, n in sorted(counts.items())) or "no decisions"
        extra = f"; overrides what it asked: {', '.join(asked)}" if asked else ""
        print(f"ok       {path or 'demo'}  ({summary}{extra})")
    return {"file": path, "ok": True, "errors": [], "decisions": dict(counts), "overrides_asked": asked}


def _base(path: str, extended_by: int, *, quiet: bool) -> dict[str, Any]:
    if not quiet:
        print(f"ok       {path}  (base of {extended_by}: validated, resolved through them)")
    return {"file": path, "ok": True, "errors": [], "base_of": extended_by}


def run(args: argparse.Namespace) -> int:
    paths: list[str | None] = list(expand(args.profiles)) if args.profiles else [None]
    loaded: dict[str | None, LoadedProfile | ProfileError] = {}
    for path in paths:
        try:
            loaded[path] = load(path, args.sets)
        except ProfileError as exc:
            loaded[path] = exc
    base_of = _bases([lp for lp in loaded.values() if isinstance(lp, LoadedProfile)])
    results = []
    for path in paths:
        lp = loaded[path]
        extended_by = base_of[os.path.realpath(path)] if path is not None else 0
        if isinstance(lp, ProfileError):
            results.append(_refused(path, lp, quiet=args.json))
        elif path is not None and extended_by:
            results.append(_base(path, extended_by, quiet=args.json))
        else:
            results.append(_resolved(path, lp, strict=args.strict, quiet=args.json))
    if args.json:
        print(json.dumps({"profiles": results}, indent=2))
    return EXIT_OK if all(r["ok"] for r in results) else EXIT_REFUSED
