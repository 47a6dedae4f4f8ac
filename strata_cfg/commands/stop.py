"""`strata stop [RUN_DIR | PROFILE]`: stop an engine started by `strata launch` (detached or not).

With no argument it stops the most recent run under ``runs/`` that is still running. A profile (its name or
its file) picks that profile's most recent running launch.

Exit codes: 0 when the run is stopped, also when it was already stopped (a second `strata stop` says so and
succeeds); 1 when there is no such run at all; 2 for a usage error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..launch.run_dir import RunDir, launches_of, live_supervisor, profile_name
from ..launch.supervisor import stop_run
from ..schema.plan_file import PLAN_FILE
from ._arg_types import positive_seconds
from ._launches import add_launch_target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_target(parser, "latest")
    parser.add_argument(
        "--grace",
        type=positive_seconds,
        default=30.0,
        help="seconds to wait for a clean stop before killing (default 30)",
    )


def choose(target: str | None, root: Path) -> tuple[RunDir | None, str, bool]:
    """The run to stop; or None, one sentence saying why there is none, and whether that is because the
    runs asked for are already stopped (not an error) rather than missing."""
    runs, why = launches_of(target, root)
    if not runs:
        return None, why, False
    running = [r for r in runs if live_supervisor(r) is not None]
    if running:
        return running[0], "", False
    if target is not None and (Path(target) / PLAN_FILE).is_file():
        return None, f"{runs[0].path} is already stopped", True
    which = f"of profile `{profile_name(target)}` " if target is not None else ""
    return None, f"every launch {which}under {root}/ is already stopped", True


def run(args: argparse.Namespace) -> int:
    target, why, stopped = choose(args.target, args.runs_root)
    if target is None:
        if stopped:
            print(f"strata stop: nothing to do: {why}")
            return 0
        print(f"strata stop: {why}", file=sys.stderr)
        return 1
    print(f"stopping {target.path} ...")
    if not stop_run(target, args.grace):  # it stopped on its own in the meantime
        print(f"strata stop: nothing to do: {target.path} is already stopped")
        return 0
    print(f"stopped {target.path}")
    return 0
