"""`strata stop [RUN_DIR | PROFILE]`: stop an engine started by `strata launch` (detached or not).

With no argument it stops the most recent run under ``runs/`` that is still running. A profile (its name or
its file) picks that profile's most recent running launch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..launch.run_dir import RUNS_ROOT, RunDir, find_runs, live_supervisor, run_profile_name
from ..launch.supervisor import stop_run
from ..schema.plan_file import PLAN_FILE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target", nargs="?", help="a run directory, or a profile name or file (default: latest)"
    )
    parser.add_argument(
        "--runs-root", type=Path, default=RUNS_ROOT, help="where launches keep their run directories (runs/)"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds to wait for a clean stop before killing (default 30)",
    )


def _profile_name(target: str) -> str:
    path = Path(target)
    return path.stem if path.suffix == ".toml" else target


def choose(target: str | None, root: Path) -> tuple[RunDir | None, str]:
    """The run to stop, or None with one sentence saying why there is none."""
    if target is not None and (Path(target) / PLAN_FILE).is_file():
        run = RunDir(Path(target))
        if live_supervisor(run) is None:
            return None, f"nothing is running in {run.path}"
        return run, ""
    running = [r for r in find_runs(root) if live_supervisor(r) is not None]
    if target is not None:
        name = _profile_name(target)
        running = [r for r in running if run_profile_name(r) == name or r.path.name.startswith(f"{name}-")]
        if not running:
            return None, f"no running launch of profile `{name}` under {root}/"
    if not running:
        return None, f"no running launch under {root}/"
    return running[0], ""


def run(args: argparse.Namespace) -> int:
    target, why = choose(args.target, args.runs_root)
    if target is None:
        print(f"strata stop: {why}", file=sys.stderr)
        return 1
    print(f"stopping {target.path} ...")
    stop_run(target, args.grace)
    print(f"stopped {target.path}")
    return 0
