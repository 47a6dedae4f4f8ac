"""Launch from the TUI: the launcher's own checks, then a detached supervised engine, its health and log.

Everything here is `strata_cfg.launch`: the plan summary and notices, the preflight refusals, the run
directory, `spawn_detached` (the same background supervisor as ``strata launch --detach``), ``/health`` and
the log tail. Closing the page leaves the engine running; `s` stops it, as `strata stop` would.
"""

from __future__ import annotations

import asyncio
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.timer import Timer
from textual.widgets import Static

from ...launch.engine_process import log_tail
from ...launch.health import health
from ...launch.options import LaunchOptions
from ...launch.preflight import base_url, preflight
from ...launch.run_dir import RunDir, live_supervisor, new_run_dir
from ...launch.summary import notices, summary
from ...launch.supervisor import spawn_detached, stop_run
from ...plan.from_profile import resolve_path
from ...report.problems import problems_text
from ...schema.errors import ProfileError
from ...schema.plan import LaunchPlan
from ...schema.plan_file import write_plan
from ..messages import LaunchStopped

POLL_S = 0.5
TAIL_LINES = 12


@dataclass(frozen=True)
class EngineState:
    """One look at a launched engine."""

    health: tuple[int, dict[str, Any]] | None
    supervisor_alive: bool
    launch_log: list[str]
    engine_log: list[str]


def health_text(state: EngineState, url: str) -> Text:
    """``ready at URL`` / ``loading: ... (40%)`` / ``not answering yet`` / ``stopped``."""
    if state.health is not None and state.health[0] == 200:
        return Text(f"ready at {url}/v1", style="bold #5fd75f")
    if not state.supervisor_alive:
        return Text("stopped: the supervisor is not running (see the logs below)", style="bold #ff5f5f")
    if state.health is None:
        return Text("starting: the engine is not answering yet", style="#ffd75f")
    body = state.health[1]
    line = f"{body.get('status', '?')}: {body.get('progress', '')}"
    frac = body.get("fraction")
    if isinstance(frac, int | float):
        line += f" ({frac:.0%})"
    return Text(line, style="#ffd75f")


def look(run: RunDir, url: str) -> EngineState:
    """Blocking: health, supervisor, and both logs' tails (run in a thread)."""
    return EngineState(
        health=health(url, timeout=1.0),
        supervisor_alive=live_supervisor(run) is not None,
        launch_log=log_tail(run.launch_log, lines=5),
        engine_log=log_tail(run.engine_log, lines=TAIL_LINES),
    )


class LaunchScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "start", "Start"),
        Binding("s", "stop", "Stop the engine"),
        Binding("escape", "close", "Close"),
    ]

    def __init__(self, path: Path, runs_root: Path, options: LaunchOptions, *, strict: bool = False) -> None:
        super().__init__()
        self.path = path
        self.runs_root = runs_root
        self.options = options
        self.strict = strict
        self.plan: LaunchPlan | None = None
        self.run_dir: RunDir | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.timer: Timer | None = None
        self.state: EngineState | None = None
        self.refusals: list[str] = []

    def compose(self) -> ComposeResult:
        with Vertical(classes="page"):
            scroll = VerticalScroll(
                Static(id="launch-summary"),
                Static(id="launch-health"),
                Static(id="launch-log"),
                classes="page-scroll",
            )
            scroll.border_title = f"launch {self.path.as_posix()}"
            yield scroll
            yield Static(id="launch-keys", classes="dialog-keys")

    def on_mount(self) -> None:
        self.query_one(VerticalScroll).focus()
        text = Text()
        try:
            self.plan = resolve_path(self.path, strict=self.strict).plan
        except ProfileError as exc:
            text.append("the plan is refused; nothing can start:\n", style="bold #ff5f5f")
            text.append(problems_text(exc.problems))
            return self._show(text, keys="[b]Esc[/b] close")
        text.append("\n".join(summary(self.plan)) + "\n")
        shown = notices(self.plan)
        if shown:
            text.append("decisions to know about:\n", style="bold")
            text.append("\n".join(shown) + "\n", style="#ff8700")
        self.refusals = preflight(self.plan)
        if self.refusals:
            text.append("\ncannot start:\n", style="bold #ff5f5f")
            text.append("\n".join(f"  {r}" for r in self.refusals) + "\n")
            return self._show(text, keys="[b]Esc[/b] close")
        self._show(text, keys="[b]Enter[/b] start the engine (in the background)   [b]Esc[/b] cancel")

    def _show(self, text: Text, keys: str) -> None:
        self.query_one("#launch-summary", Static).update(text)
        self.query_one("#launch-keys", Static).update(keys)

    @property
    def can_start(self) -> bool:
        return self.plan is not None and not self.refusals and self.run_dir is None

    def action_start(self) -> None:
        if not self.can_start:
            return
        assert self.plan is not None
        self.run_dir = RunDir(new_run_dir(self.plan.profile, self.runs_root))
        write_plan(self.plan, self.run_dir.plan)
        self.proc = spawn_detached(self.run_dir, self.options)
        self.query_one("#launch-keys", Static).update(
            "[b]s[/b] stop the engine   [b]Esc[/b] close (it keeps running)"
        )
        self.query_one("#launch-health", Static).update(
            Text(f"run directory {self.run_dir.path}", style="dim")
        )
        self.timer = self.set_interval(POLL_S, self.poll)

    async def poll(self) -> None:
        if self.run_dir is None or self.plan is None or self.plan.serve is None:
            return
        if self.proc is not None:
            self.proc.poll()  # reap the supervisor when it has exited
        url = base_url(self.plan.serve)
        self.state = await asyncio.to_thread(look, self.run_dir, url)
        head = Text(f"run directory {self.run_dir.path}\n", style="dim")
        head.append_text(health_text(self.state, url))
        self.query_one("#launch-health", Static).update(head)
        log = Text()
        if self.state.launch_log:
            log.append("\nlauncher\n", style="bold")
            log.append("\n".join(f"  | {line}" for line in self.state.launch_log) + "\n", style="dim")
        log.append(f"\nengine log ({self.run_dir.engine_log})\n", style="bold")
        log.append("\n".join(f"  | {line}" for line in self.state.engine_log) or "  (empty)", style="dim")
        self.query_one("#launch-log", Static).update(log)

    async def action_stop(self) -> None:
        if self.run_dir is None:
            return
        self.query_one("#launch-keys", Static).update("stopping the engine...")
        await asyncio.to_thread(stop_run, self.run_dir, self.options.grace_s + 5, lambda _msg: None)
        if self.proc is not None:
            await asyncio.to_thread(self.proc.wait)
        await self.poll()
        if self.timer is not None:
            self.timer.stop()
        self.query_one("#launch-keys", Static).update("[b]Esc[/b] close")
        self.post_message(LaunchStopped(self.run_dir.path))

    def action_close(self) -> None:
        if self.timer is not None:
            self.timer.stop()
        if self.run_dir is not None and live_supervisor(self.run_dir) is not None:
            self.app.notify(
                f"the engine keeps running; stop it with: strata stop {self.run_dir.path}", timeout=10
            )
        self.dismiss(None)
