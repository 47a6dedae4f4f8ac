"""`strata tui [PROFILE | DIR]`: edit profiles and preview the resolved plan live, in a Textual app.

With no argument it opens ``profiles/`` in the working directory; with a directory, the profiles in it;
with a file, that profile (and the others beside it in the list). Textual is imported only when the app
runs, so the other commands never load it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._common import EXIT_OK, EXIT_USAGE

DEFAULT_DIR = Path("profiles")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target",
        nargs="?",
        type=Path,
        default=None,
        metavar="PROFILE | DIR",
        help=f"a profile file, or a directory of profiles (default: {DEFAULT_DIR}/)",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="resolve in strict mode: a rule turning off what the profile asked for refuses the plan",
    )
    parser.epilog = "Press F1 in the app for every key binding. Exit codes: 0 quit, 2 usage error."


def where(target: Path | None) -> tuple[Path, Path | None] | str:
    """(directory to list, profile to open first), or why there is nothing to open."""
    if target is None:
        if not DEFAULT_DIR.is_dir():
            return f"no {DEFAULT_DIR}/ directory here; give a PROFILE file or a DIR of profiles"
        return DEFAULT_DIR, None
    if target.is_dir():
        return target, None
    if target.is_file():
        return target.parent, target
    return f"no such profile or directory: {target}"


def run(args: argparse.Namespace) -> int:
    found = where(args.target)
    if isinstance(found, str):
        print(f"strata tui: {found}", file=sys.stderr)
        return EXIT_USAGE
    from ..tui.app import StrataApp

    root, first = found
    StrataApp(root, first, strict=args.strict).run()
    return EXIT_OK
