"""`strata launch PROFILE`: resolve a profile, start its engine, wait until it serves, and keep it running.

Before anything starts it prints the plan summary and every decision that turned off something the profile
asked for, and refuses, in one sentence each, a refused plan, a profile without ``[serve]``, a missing model
directory, an unset API key variable and a busy port. ``--dry-run`` stops there. Otherwise the plan and
the engine's log go into a run directory (``runs/<profile>-<timestamp>/``), and the engine is supervised:
restarted when it exits on its own, stopped cleanly on Ctrl-C or SIGTERM. ``--detach`` leaves the
supervisor running in the background; `strata stop` ends it.

Exit codes: 0 after a clean stop (or a detached start), 1 when the launch was refused or the engine failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..launch.engine_process import engine_command, log_tail
from ..launch.health import taken_message, wait_ready
from ..launch.options import LIVENESS_MARGIN_S, LaunchOptions
from ..launch.preflight import base_url, preflight
from ..launch.run_dir import RUNS_ROOT, RunDir, new_run_dir
from ..launch.summary import client_snippet, notices, summary
from ..launch.supervisor import Supervisor, spawn_detached, stop_run
from ..schema.errors import ProfileError
from ..schema.plan import LaunchPlan
from ..schema.plan_file import PLAN_FILE, PlanFileError, write_plan
from ._arg_types import positive_seconds, seconds_or_off
from ._common import add_profile_argument, add_resolve_options, print_problems, resolve_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_argument(parser)
    add_resolve_options(parser)
    parser.add_argument(
        "--dry-run", action="store_true", help="resolve and check, print what would run, start nothing"
    )
    parser.add_argument(
        "--detach", action="store_true", help="keep running in the background (stop: strata stop)"
    )
    parser.add_argument(
        "--run-dir", type=Path, help=f"where {PLAN_FILE} and engine.log go (default {RUNS_ROOT}/...)"
    )
    defaults = LaunchOptions()
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=defaults.max_restarts,
        help=f"restarts in a row before giving up (default {defaults.max_restarts})",
    )
    parser.add_argument(
        "--grace",
        type=positive_seconds,
        default=defaults.grace_s,
        help=f"seconds the engine gets to drain on stop before SIGKILL (default {defaults.grace_s:g})",
    )
    parser.add_argument(
        "--start-timeout",
        type=positive_seconds,
        default=defaults.start_timeout_s,
        help=f"seconds loading may take (default {defaults.start_timeout_s:g})",
    )
    parser.add_argument(
        "--liveness-timeout",
        type=seconds_or_off,
        default=None,
        metavar="S",
        help="seconds a ready engine may go without answering /health before it is taken for hung and "
        f"restarted; 0: never (default: serve.step_timeout_s + {LIVENESS_MARGIN_S:g})",
    )
    parser.add_argument("--supervise", type=Path, metavar="RUN_DIR", help=argparse.SUPPRESS)


def _say(message: str) -> None:
    print(message, flush=True)


def _error(message: str) -> int:
    print(f"strata launch: {message}", file=sys.stderr, flush=True)
    return 1


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    """The supervisor's options from the flags (`LaunchOptions.argv` writes them back for ``--detach``)."""
    return LaunchOptions(
        max_restarts=args.max_restarts,
        grace_s=args.grace,
        start_timeout_s=args.start_timeout,
        liveness_s=args.liveness_timeout,
    )


def run(args: argparse.Namespace) -> int:
    options = launch_options(args)
    if args.supervise is not None:
        return _supervise_detached(RunDir(args.supervise), options)
    try:
        plan = resolve_args(args).plan
    except ProfileError as exc:
        print_problems(exc.problems)
        return _error("the plan was refused; nothing was started")
    except OSError as exc:
        return _error(f"cannot read {exc.filename}: {exc.strerror}")

    for line in summary(plan):
        _say(line)
    shown = notices(plan)
    if shown:
        _say("decisions to know about:")
        for line in shown:
            _say(line)
    refusals = preflight(plan)
    for refusal in refusals:
        _error(refusal)
    if refusals:
        return 1

    run_dir = RunDir(args.run_dir or new_run_dir(plan.profile))
    if args.dry_run:
        _say(f"dry run: would write {run_dir.plan} and run: {' '.join(engine_command(run_dir.plan))}")
        return 0
    write_plan(plan, run_dir.plan)
    _say(f"run directory: {run_dir.path}")
    if args.detach:
        return _detach(run_dir, plan, options)
    supervisor = Supervisor(run_dir, plan, options, say=_say)
    return supervisor.run(
        on_ready=lambda: _announce(plan, run_dir, detached=False, load_s=supervisor.ready_s)
    )


def _announce(plan: LaunchPlan, run_dir: RunDir, *, detached: bool, load_s: float | None) -> None:
    assert plan.serve is not None
    took = f", ready after {load_s:.1f} s" if load_s is not None else ""
    _say(f"engine ready: {base_url(plan.serve)}/v1 (model `{plan.serve.model_name}`{took})")
    for line in client_snippet(plan):
        _say(line)
    stop_how = f"strata stop {run_dir.path}" if detached else f"Ctrl-C (or strata stop {run_dir.path})"
    _say(f"log: {run_dir.engine_log} (strata logs -f {run_dir.path}); state: strata status; stop: {stop_how}")


def _detach(run_dir: RunDir, plan: LaunchPlan, options: LaunchOptions) -> int:
    assert plan.serve is not None
    started = time.monotonic()
    engine_id = run_dir.engine_id()  # made here, before the supervisor that starts engines with it
    proc = spawn_detached(run_dir, options)
    try:
        outcome = wait_ready(
            base_url(plan.serve),
            engine_id=engine_id,
            running=lambda: proc.poll() is None,
            stopping=lambda: False,
            options=options,
            say=_say,
        )
    except KeyboardInterrupt:
        outcome = "stopped"
    if outcome != "ready":
        stop_run(run_dir, options.grace_s + 5)
        if outcome == "taken":
            _error(taken_message(base_url(plan.serve), engine_id))
        _error("the engine failed to start; last lines of the launch log:")
        for line in log_tail(run_dir.launch_log, lines=25):
            print(f"  | {line}", file=sys.stderr)
        return 1
    _announce(plan, run_dir, detached=True, load_s=time.monotonic() - started)
    _say(f"supervisor pid {proc.pid} (in {run_dir.launch_pid}), its output in {run_dir.launch_log}")
    return 0


def _supervise_detached(run_dir: RunDir, options: LaunchOptions) -> int:
    """The background half of ``--detach``: supervise the plan already written into ``run_dir``."""
    try:
        plan = run_dir.load_plan()
    except PlanFileError as exc:
        return _error(str(exc))
    supervisor = Supervisor(run_dir, plan, options, say=_say)
    return supervisor.run(on_ready=lambda: _say(f"engine ready: {base_url(plan.serve)}/v1"))  # type: ignore[arg-type]
