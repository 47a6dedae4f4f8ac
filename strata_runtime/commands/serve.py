"""`python -m strata_runtime serve --plan plan.json`: load the plan's engine and serve it over HTTP.

Exit codes: 0 after a clean stop (SIGTERM / SIGINT), 1 when the engine fails to load or fails while serving,
or the port cannot be bound, 2 for a bad plan file or a missing API key.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from strata_cfg.schema.plan import LaunchPlan
from strata_cfg.schema.plan_file import PlanFileError, read_plan

from ..api import EngineCore
from ..server.engine_loop import EngineFactory, LoadProgress

log = logging.getLogger("strata.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True, type=Path, help="the resolved launch plan (plan.json)")
    parser.add_argument("--host", help="override the plan's serve.host")
    parser.add_argument("--port", type=int, help="override the plan's serve.port")
    parser.add_argument(
        "--engine-id",
        help="the id /health reports, so that the launcher knows its own engine (default: a random one)",
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=10.0,
        help="on SIGTERM, how long in-flight requests may finish before they are cancelled (default 10)",
    )


def load_plan(path: Path) -> LaunchPlan:
    """Read a plan file, or exit 2 with one line saying what is wrong with it."""
    try:
        return read_plan(path)
    except PlanFileError as exc:
        sys.exit(_fatal(str(exc)))


def exposure_warning(plan: LaunchPlan, host: str, api_key: str | None) -> str | None:
    """The warning for binding ``host`` without an API key where others may reach it, or None.

    The resolver decided whether the plan's own host is a loopback address (``serve.loopback``); a host
    given with ``--host`` was not checked by it, so binding one without a key always warns.
    """
    assert plan.serve is not None
    if api_key is not None:
        return None
    if host != plan.serve.host:
        return (
            f"binding {host} (--host; the plan checked only {plan.serve.host}) without an API key: unless it "
            "is a loopback address, anyone who can reach this host can use the model"
        )
    if not plan.serve.loopback:
        return f"binding {host} without an API key: anyone who can reach this host can use the model"
    return None


def api_key(plan: LaunchPlan) -> str | None:
    """The key named by ``serve.api_key_env``, read once at start; a named but unset variable is an error."""
    assert plan.serve is not None
    name = plan.serve.api_key_env
    if name is None:
        return None
    key = os.environ.get(name, "")
    if not key:
        sys.exit(_fatal(f"serve.api_key_env names ${name}, but it is not set (or empty) in the environment"))
    return key


def _fatal(message: str) -> int:
    print(f"strata serve: {message}", file=sys.stderr)
    return 2


def _factory(plan: LaunchPlan) -> EngineFactory:
    def build(progress: LoadProgress) -> EngineCore:
        from strata_runtime.engine import Engine  # on the engine thread: it owns the devices

        engine = Engine(plan, progress=progress)
        if plan.serve is None or plan.serve.warm_up:
            engine.warm_up(progress.report)  # /health says "loading" until the first requests' graphs exist
        return engine

    return build


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    plan = load_plan(args.plan)
    if plan.serve is None:
        return _fatal(
            f"the plan of profile `{plan.profile}` has no [serve] table: it is not a serving profile"
        )
    from strata_runtime.server import ServeOptions, Server

    options = ServeOptions(
        host=args.host or plan.serve.host,
        port=plan.serve.port if args.port is None else args.port,
        model_name=plan.serve.model_name,
        api_key=api_key(plan),
        drain_s=args.drain_seconds,
        engine_id=args.engine_id,
    )
    warning = exposure_warning(plan, options.host, options.api_key)
    if warning:
        log.warning("%s", warning)
    server = Server(plan, _factory(plan), options)
    code = asyncio.run(server.serve())
    if server.engine is not None and server.engine.hung:
        # The engine thread is still blocked on its device: leave without the interpreter's exit handlers,
        # which may wait on that device too (a pool freeing its memory), so the supervisor sees the exit.
        logging.shutdown()
        os._exit(code)
    return code
