"""The engine a launch from the TUI started: where it runs, how it was last seen, and how to say so.

The app keeps one `Engine` per session, from the moment the launch page starts it (or Ctrl+L finds the open
profile's engine already running under the runs directory, from an earlier session). It polls it with
`Engine.look`, blocking, in a thread, and shows `indicator_text` beside the status line, so an engine stays
visible after its page is closed. Nothing here imports textual.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.text import Text

from ..launch.engine_process import log_tail
from ..launch.health import health
from ..launch.preflight import base_url
from ..launch.run_dir import RunDir, find_runs, live_supervisor, run_profile_name
from ..launch.supervisor import stop_run
from ..schema.plan import LaunchPlan

POLL_S = 0.5
"""How often the app looks at a running engine."""
TAIL_LINES = 12


@dataclass(frozen=True)
class EngineState:
    """One look at a launched engine."""

    health: tuple[int, dict[str, Any]] | None
    """What ``/health`` answered; None when nothing answers, or when another server holds the port (it
    reports another engine's id), which is not this engine starting."""
    supervisor_alive: bool
    launch_log: list[str]
    engine_log: list[str]

    @property
    def ready(self) -> bool:
        return self.health is not None and self.health[0] == 200


@dataclass
class Engine:
    """A launched engine: its run directory, the plan it runs (one with a ``[serve]`` table), the supervisor
    process when this session started it, and the last look at it."""

    run: RunDir
    plan: LaunchPlan
    proc: subprocess.Popen[bytes] | None = None
    state: EngineState | None = None

    @property
    def url(self) -> str:
        assert self.plan.serve is not None
        return base_url(self.plan.serve)

    def alive(self) -> bool:
        """Whether its supervisor still runs (and so the engine, or its next restart). The process this
        session started says so at once; its pid file comes only once it is under way."""
        if self.proc is not None:
            return self.proc.poll() is None  # also reaps it when it has exited
        return live_supervisor(self.run) is not None

    def look(self) -> EngineState:
        """Blocking: health, supervisor, and both logs' tails; kept as `state`."""
        answer = health(self.url, timeout=1.0)
        if answer is not None and answer[1].get("engine_id") not in (None, self.run.engine_id()):
            answer = None  # another server answers on the port: this engine is not up
        self.state = EngineState(
            health=answer,
            supervisor_alive=self.alive(),
            launch_log=log_tail(self.run.launch_log, lines=5),
            engine_log=log_tail(self.run.engine_log, lines=TAIL_LINES),
        )
        return self.state

    def stop(self, grace_s: float) -> EngineState:
        """Blocking: stop it as `strata stop` does, wait for the supervisor, and look once more."""
        stopped = stop_run(self.run, grace_s, lambda _msg: None)
        if self.proc is not None:
            if not stopped and self.proc.poll() is None:
                self.proc.terminate()  # so young that it has not written its pid file yet
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.look()


def find_running(profile: str, root: Path) -> Engine | None:
    """The most recent run of ``profile`` under ``root`` whose supervisor still runs, if any."""
    for run in find_runs(root):
        if run_profile_name(run) != profile or live_supervisor(run) is None:
            continue
        try:
            plan = run.load_plan()
        except (OSError, ValueError):
            continue
        if plan.serve is not None:
            return Engine(run, plan)
    return None


def phase(state: EngineState | None) -> str:
    """``ready``, ``stopped``, ``starting`` (not answering yet), or what ``/health`` says (``loading``)."""
    if state is None:
        return "starting"
    if state.ready:
        return "ready"
    if not state.supervisor_alive:
        return "stopped"
    if state.health is None:
        return "starting"
    return str(state.health[1].get("status", "?"))


def progress(state: EngineState | None) -> float | None:
    """How far loading has come (0 to 1), when ``/health`` says."""
    frac = state.health[1].get("fraction") if state is not None and state.health is not None else None
    return float(frac) if isinstance(frac, int | float) else None


PHASE_STYLE = {"ready": "bold #5fd75f", "stopped": "bold #ff5f5f"}
"""How each phase is shown; any other is on its way, in yellow."""


def health_text(state: EngineState, url: str) -> Text:
    """``ready at URL``, ``loading: ... (40%)``, ``starting: ...`` or ``stopped: ...`` (the launch page)."""
    now = phase(state)
    style = PHASE_STYLE.get(now, "#ffd75f")
    if now == "ready":
        return Text(f"ready at {url}/v1", style=style)
    if now == "stopped":
        return Text("stopped: the supervisor is not running (see the logs below)", style=style)
    if state.health is None:
        return Text("starting: the engine is not answering yet", style=style)
    frac = progress(state)
    line = f"{now}: {state.health[1].get('progress', '')}" + (f" ({frac:.0%})" if frac is not None else "")
    return Text(line, style=style)


def indicator_text(engine: Engine) -> Text:
    """``engine demo :8000 ready`` (or starting, loading 40%, stopped): the engine in a few cells."""
    assert engine.plan.serve is not None
    text = Text(f"engine {engine.plan.profile} :{engine.plan.serve.port} ", style="bold")
    now, frac = phase(engine.state), progress(engine.state)
    text.append(now + (f" {frac:.0%}" if frac is not None else ""), style=PHASE_STYLE.get(now, "#ffd75f"))
    return text
