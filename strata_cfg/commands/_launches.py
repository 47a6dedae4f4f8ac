"""The arguments of the commands that act on launches (`stop`, `status`, `logs`): which launch, and where
launches keep their run directories."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..launch.run_dir import RUNS_ROOT


def add_launch_target(parser: argparse.ArgumentParser, default: str) -> None:
    """``target`` (a run directory, or a profile name or file; ``default`` says what none picks) and
    ``--runs-root``."""
    parser.add_argument(
        "target", nargs="?", help=f"a run directory, or a profile name or file (default: {default})"
    )
    parser.add_argument(
        "--runs-root", type=Path, default=RUNS_ROOT, help="where launches keep their run directories (runs/)"
    )
