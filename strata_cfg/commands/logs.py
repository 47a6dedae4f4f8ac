"""`strata logs [RUN_DIR | PROFILE] [-n N] [-f]`: the engine log of a launch.

The launch is the most recent one under ``runs/`` that still runs, else the most recent one; a profile (its
name or file) picks that profile's, a run directory itself. It prints the last ``-n`` lines of its
``engine.log`` (every start of the engine, appended, each marked by the launcher), and with ``-f`` goes on
printing what the engine writes until Ctrl-C, or until the launch stops.

Exit codes: 0 after printing (and after Ctrl-C with ``-f``); 1 when there is no such launch or no log yet;
2 for a usage error.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..launch.engine_process import log_tail
from ..launch.run_dir import RunDir, launches_of, live_supervisor
from ._launches import add_launch_target

FOLLOW_POLL_S = 0.25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_target(parser, "the latest launch")
    parser.add_argument(
        "-n", "--lines", type=_count, default=40, help="how many of the log's last lines (default 40; 0: all)"
    )
    parser.add_argument(
        "-f", "--follow", action="store_true", help="go on printing what the engine writes, until Ctrl-C"
    )


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of lines") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give 0 or more lines")
    return n


def chosen(target: str | None, root: Path) -> tuple[RunDir | None, str]:
    """The launch whose log to print: of those ``target`` names, the most recent that runs, else the most
    recent; or None and why."""
    runs, why = launches_of(target, root)
    if not runs:
        return None, why
    running = [r for r in runs if live_supervisor(r) is not None]
    return (running or runs)[0], ""


def run(args: argparse.Namespace) -> int:
    launch, why = chosen(args.target, args.runs_root)
    if launch is None:
        print(f"strata logs: {why}", file=sys.stderr)
        return 1
    path = launch.engine_log
    if not path.is_file():
        print(f"strata logs: {path} does not exist yet", file=sys.stderr)
        return 1
    for line in log_tail(path, 0, args.lines):
        print(line)
    if not args.follow:
        return 0
    sys.stdout.flush()
    offset = path.stat().st_size
    try:
        while True:
            size = path.stat().st_size
            if size < offset:  # the log was replaced: from its start
                offset = 0
            if size > offset:
                with path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read(size - offset)
                cut = chunk.rfind(b"\n") + 1  # whole lines only; the rest comes with the next read
                sys.stdout.write(chunk[:cut].decode(errors="replace"))
                sys.stdout.flush()
                offset += cut
            elif live_supervisor(launch) is None:
                return 0
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        return 0
