"""Is the engine ready? Its ``/health`` answer, and waiting for it to become ready while showing the
loading progress."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Literal

from .options import LaunchOptions

Say = Callable[[str], None]
ReadyOutcome = Literal["ready", "died", "timeout", "stopped"]


def health(url: str, timeout: float = 2.0) -> tuple[int, dict[str, Any]] | None:
    """(status, JSON body) of ``url/health``, or None when nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read() or b"{}")
        except ValueError:
            body = {}
        return exc.code, body
    except (OSError, ValueError):
        return None


def wait_ready(
    url: str, *, running: Callable[[], bool], stopping: Callable[[], bool], options: LaunchOptions, say: Say
) -> ReadyOutcome:
    """Poll ``url/health`` until 200, showing the loading progress; stop early when the process dies."""
    deadline = time.monotonic() + options.start_timeout_s
    shown = ""
    while True:
        if stopping():
            return "stopped"
        if not running():
            return "died"
        answer = health(url, timeout=1.0)
        if answer is not None and answer[0] == 200:
            return "ready"
        if answer is not None:
            body = answer[1]
            frac = body.get("fraction")
            progress = f"{body.get('status', '?')}: {body.get('progress', '')}"
            if isinstance(frac, int | float):
                progress += f" ({frac:.0%})"
            if progress != shown:
                say(f"  {progress}")
                shown = progress
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(options.poll_s)
