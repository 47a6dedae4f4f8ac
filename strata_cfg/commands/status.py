"""`strata status [RUN_DIR | PROFILE]`: what the engines `strata launch` started are doing.

For each launch under ``runs/`` whose supervisor runs (``--all``: the stopped ones too, most recent first),
or the one named: its address and state as its engine answers ``/health`` (only an answer with the run's
engine id counts: another server on the port is said to be one), the supervisor's and the engine's pids, how
many times the engine was started, and from ``/v1/status`` its uptime, busy slots, queue, tokens generated
and recoveries. Where the serving profile asks for an API key, the key is read from the variable it names;
without it the status part is left out and the line says so.

Exit codes: 0 when every launch listed that runs is ready; 1 when there is none to list, or one is not ready
(loading, failed, not answering, another server); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ..launch.health import health
from ..launch.preflight import base_url
from ..launch.run_dir import (
    ENGINE_START_MARK,
    RunDir,
    launches_of,
    live_supervisor,
    pid_alive,
    profile_name,
    read_pid,
)
from ..schema.plan_file import PLAN_FILE, PlanFileError
from ._launches import add_launch_target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_target(parser, "every running launch")
    parser.add_argument("--all", action="store_true", help="list stopped launches too")
    parser.add_argument("--json", action="store_true", help='print {"launches": [{run_dir, state, ...}]}')


def chosen(target: str | None, root: Path, everything: bool) -> tuple[list[RunDir], str]:
    """The runs to report, most recent first, or none and one sentence saying why."""
    runs, why = launches_of(target, root)
    if not runs or everything or (target is not None and (Path(target) / PLAN_FILE).is_file()):
        return runs, why
    runs = [r for r in runs if live_supervisor(r) is not None]
    which = f"of profile `{profile_name(target)}` " if target is not None else ""
    return runs, "" if runs else f"no launch {which}under {root}/ is running (--all lists the stopped ones)"


def engine_starts(run: RunDir) -> int:
    """How many times the supervisor started the run's engine (the marks in its log, read a line at a
    time: a long-running engine's log is not held whole)."""
    try:
        with run.engine_log.open("rb") as f:
            return sum(line.startswith(ENGINE_START_MARK) for line in f)
    except OSError:
        return 0


def report(run: RunDir) -> dict[str, Any]:
    """One launch: where it serves and what state it is in; ``status`` from ``/v1/status`` where its
    engine answers ready and, for a profile with an API key, the key's variable is set here."""
    out: dict[str, Any] = {"run_dir": str(run.path)}
    try:
        plan = run.load_plan()
    except PlanFileError as exc:
        return out | {"state": "unreadable", "error": str(exc)}
    out["profile"] = plan.profile
    if plan.serve is None:
        return out | {"state": "unreadable", "error": f"{run.plan} has no [serve] table"}
    url = base_url(plan.serve)
    launcher = live_supervisor(run)
    engine = read_pid(run.engine_pid)
    out |= {
        "url": f"{url}/v1",
        "model": plan.serve.model_name,
        "launcher_pid": launcher,
        "engine_pid": engine if engine is not None and pid_alive(engine) else None,
        "engine_starts": engine_starts(run),
    }
    if launcher is None:
        return out | {"state": "stopped"}
    answer = health(url)
    if answer is None:
        return out | {"state": "not answering"}
    code, body = answer
    try:
        mine = run.engine_id_file.read_text().strip()
    except OSError:
        mine = ""
    if body.get("engine_id") != mine:
        return out | {"state": "another server", "error": f"another server answers {url}/health"}
    out["state"] = "ready" if code == 200 else str(body.get("status", f"HTTP {code}"))
    if body.get("error"):
        out["error"] = body["error"]
    if code != 200:
        return out
    key_env = plan.serve.api_key_env
    key = os.environ.get(key_env) if key_env else None
    if key_env and not key:
        return out | {"status": None, "note": f"set {key_env} to read its /v1/status"}
    try:
        out["status"] = _status(url, key)
    except urllib.error.HTTPError as exc:
        why = (
            f"the key in {key_env} was refused" if exc.code in (401, 403) and key_env else f"HTTP {exc.code}"
        )
        out |= {"status": None, "note": f"its /v1/status did not answer: {why}"}
    except (OSError, ValueError) as exc:
        out |= {"status": None, "note": f"its /v1/status did not answer: {exc}"}
    return out


def _status(url: str, key: str | None) -> dict[str, Any]:
    """The parts of ``/v1/status`` this command shows (raises what `urllib.request.urlopen` or the JSON
    parser raise where it does not answer with them)."""
    request = urllib.request.Request(f"{url}/v1/status")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=5.0) as r:
        body = json.loads(r.read())
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    engine = body.get("engine") or {}
    slots = engine.get("slots") or []
    totals = engine.get("totals") or {}
    return {
        "uptime_s": body.get("uptime_s"),
        "load_seconds": body.get("load_seconds"),
        "slots": len(slots),
        "slots_busy": sum(1 for s in slots if s.get("state") != "free"),
        "queued": engine.get("queue", 0),
        "requests_in_flight": body.get("requests_in_flight", 0),
        "tokens": totals.get("tokens", 0),
        "windows": totals.get("windows", 0),
        "recoveries": len(body.get("recoveries") or []),
    }


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def lines(r: dict[str, Any]) -> list[str]:
    """One launch as the command prints it."""
    head = f"{r.get('profile') or '?'}: {r['state']}"
    if "url" in r:
        where = f"{r['url']}, model `{r['model']}`"
        head += f" (it served {where})" if r["state"] == "stopped" else f" at {where}"
    out = [head]
    if "url" in r:
        starts = r["engine_starts"]
        pids = f"launcher pid {r['launcher_pid']}" if r["launcher_pid"] else "no launcher"
        pids += f", engine pid {r['engine_pid']}" if r["engine_pid"] else ", no engine process"
        pids += f"; engine started {starts} time{'s' if starts != 1 else ''}" if starts else ""
        out.append(f"  {pids}")
    st = r.get("status")
    if st:
        up = f"up {_duration(st['uptime_s'])}" if st.get("uptime_s") is not None else "up"
        if st.get("load_seconds") is not None:
            up += f" (loaded in {st['load_seconds']:.1f} s)"
        out.append(
            f"  {up}; slots {st['slots_busy']} of {st['slots']} busy, {st['queued']} queued; "
            f"{st['tokens']:,} tokens generated in {st['windows']:,} windows; "
            f"{st['recoveries']} recover{'y' if st['recoveries'] == 1 else 'ies'} from a failed step"
        )
    for key in ("note", "error"):
        if r.get(key):
            out.append(f"  {r[key]}")
    out.append(f"  run directory {r['run_dir']}")
    return out


def run(args: argparse.Namespace) -> int:
    runs, why = chosen(args.target, args.runs_root, args.all)
    if not runs:
        if args.json:
            print(json.dumps({"launches": [], "why": why}, indent=2))
        else:
            print(f"strata status: {why}", file=sys.stderr)
        return 1
    reports = [report(r) for r in runs]
    if args.json:
        print(json.dumps({"launches": reports}, indent=2))
    else:
        print("\n".join(line for r in reports for line in lines(r)))
    running = [r for r in reports if r["state"] != "stopped"]
    return 0 if running and all(r["state"] == "ready" for r in running) else 1
