"""Is the engine ready? Its ``/health`` answer, and waiting for it to become ready while showing the
loading progress.

Every engine a launcher starts is given the run's engine id and reports it in ``/health``; an answer with
any other id (or none) comes from some other server on the same port, which is never taken for this
launch's engine. When two launches race for one port, the loser's engine cannot listen and exits; its
launcher then says that the port is taken (outcome ``taken``) instead of "ready".
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Literal

from .options import LaunchOptions

Say = Callable[[str], None]
ReadyOutcome = Literal["ready", "died", "timeout", "stopped", "taken"]


def health(url: str, timeout: float = 2.0) -> tuple[int, dict[str, Any]] | None:
    """(status, JSON body) of ``url/health``, or None when nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status, _object(json.loads(r.read() or b"{}"))
    except urllib.error.HTTPError as exc:
        try:
            body = _object(json.loads(exc.read() or b"{}"))
        except ValueError:
            body = {}
        return exc.code, body
    except (OSError, ValueError):
        return None


def _object(body: Any) -> dict[str, Any]:
    return body if isinstance(body, dict) else {}


def taken_message(url: str, engine_id: str) -> str:
    """Why a launch stops when another server holds its port."""
    return (
        f"another server already answers on {url} (not this launch's engine {engine_id}), so this "
        "launch's engine could not listen there; choose another serve.port or stop the other one"
    )


def wait_ready(
    url: str,
    *,
    engine_id: str,
    running: Callable[[], bool],
    stopping: Callable[[], bool],
    options: LaunchOptions,
    say: Say,
) -> ReadyOutcome:
    """Poll ``url/health`` until the engine ``engine_id`` answers 200, showing its loading progress; stop
    early when the process dies (``taken`` when another server was answering on the port meanwhile)."""
    deadline = time.monotonic() + options.start_timeout_s
    shown = ""
    foreign = False
    """The last answer came from another server."""
    while True:
        if stopping():
            return "stopped"
        if not running():
            return "taken" if foreign else "died"
        answer = health(url, timeout=1.0)
        if answer is not None and answer[1].get("engine_id") != engine_id:
            if not foreign:
                other = answer[1].get("engine_id")
                who = f"engine {other}" if other else "no strata engine id"
                say(f"  another server answers {url}/health ({who}); waiting for this launch's engine")
            foreign = True
        elif answer is not None:
            foreign = False
            if answer[0] == 200:
                return "ready"
            body = answer[1]
            frac = body.get("fraction")
            progress = f"{body.get('status', '?')}: {body.get('progress', '')}"
            if isinstance(frac, int | float):
                progress += f" ({frac:.0%})"
            if progress != shown:
                say(f"  {progress}")
                shown = progress
        else:
            foreign = False
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(options.poll_s)
