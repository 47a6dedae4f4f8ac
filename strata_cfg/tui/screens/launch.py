"""Launch from the TUI: the launcher's own checks, then a detached supervised engine, its health and log.

Everything here is `strata_cfg.launch`: the plan summary and notices, the preflight refusals, the run
directory, `spawn_detached` (the same background supervisor as ``strata launch --detach``), ``/health`` and
the log tail. Closing the page leaves the engine running; `s` stops it, as `strata stop` would. The app
polls the engine (`LaunchStarted` hands it over), so the page can close and open again on the same engine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.timer import Timer
from textual.widgets import Static

from ...launch.options import LaunchOptions
from ...launch.preflight import preflight
from ...launch.run_dir import RunDir, new_run_dir
from ...launch.summary import notices, summary
from ...launch.supervisor import spawn_detached
from ...plan.from_profile import resolve_path
from ...report.problems import problems_text
from ...schema.errors import ProfileError
from ...schema.plan import LaunchPlan
from ...schema.plan_file import write_plan
from ..engine import POLL_S, Engine, EngineState, health_text
from ..messages import LaunchStarted, LaunchStopped

RUNNING_KEYS = "[b]s[/b] stop the engine   [b]Esc[/b] close (it keeps running; Ctrl+L shows it again)"


class LaunchScreen(ModalScreen[None]):
    """The launch page of the profile at ``path``; given a running ``engine``, that engine's page again."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "start", "Start"),
        Binding("s", "stop", "Stop the engine"),
        Binding("escape", "close", "Close"),
    ]

    def __init__(
        self,
        path: Path,
        runs_root: Path,
        options: LaunchOptions,
        *,
        strict: bool = False,
        engine: Engine | None = None,
    ) -> None:
        super().__init__()
        self.path = path
        self.runs_root = runs_root
        self.options = options
        self.strict = strict
        self.engine = engine
        self.plan: LaunchPlan | None = engine.plan if engine else None
        self.timer: Timer | None = None
        self.refusals: list[str] = []

    @property
    def run_dir(self) -> RunDir | None:
        return self.engine.run if self.engine else None

    @property
    def state(self) -> EngineState | None:
        """The app's last look at the engine (it polls; this page only shows it)."""
        return self.engine.state if self.engine else None

    def compose(self) -> ComposeResult:
        with Vertical(classes="page"):
            scroll = VerticalScroll(
                Static(id="launch-summary"),
                Static(id="launch-health"),
                Static(id="launch-log"),
                classes="page-scroll",
            )
            engine = self.engine
            scroll.border_title = (
                f"engine {engine.plan.profile} ({engine.run.path.as_posix()})"
                if engine
                else f"launch {self.path.as_posix()}"
            )
            yield scroll
            yield Static(id="launch-keys", classes="dialog-keys")

    def on_mount(self) -> None:
        self.query_one(VerticalScroll).focus()
        if self.engine is not None:
            # An engine of this session (or an earlier one) is running: show it, do not check it again
            # (its own port would be "in use").
            self._show(Text("\n".join(summary(self.engine.plan)) + "\n"), keys=RUNNING_KEYS)
            return self._watch()
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
        return self.plan is not None and not self.refusals and self.engine is None

    def action_start(self) -> None:
        if not self.can_start:
            return
        assert self.plan is not None
        run = RunDir(new_run_dir(self.plan.profile, self.runs_root))
        write_plan(self.plan, run.plan)
        self.engine = Engine(run, self.plan, spawn_detached(run, self.options))
        self.post_message(LaunchStarted(self.engine))
        self.query_one("#launch-keys", Static).update(RUNNING_KEYS)
        self._watch()

    def _watch(self) -> None:
        self.show_state()
        self.timer = self.set_interval(POLL_S, self.show_state)

    def show_state(self) -> None:
        """Draw the engine's health and logs as the app last saw them."""
        if self.engine is None:
            return
        run, state = self.engine.run, self.engine.state
        head = Text(f"run directory {run.path}", style="dim")
        if state is None:
            self.query_one("#launch-health", Static).update(head)
            return
        head.append("\n")
        head.append_text(health_text(state, self.engine.url))
        self.query_one("#launch-health", Static).update(head)
        log = Text()
        if state.launch_log:
            log.append("\nlauncher\n", style="bold")
            log.append("\n".join(f"  | {line}" for line in state.launch_log) + "\n", style="dim")
        log.append(f"\nengine log ({run.engine_log})\n", style="bold")
        log.append("\n".join(f"  | {line}" for line in state.engine_log) or "  (empty)", style="dim")
        self.query_one("#launch-log", Static).update(log)

    async def action_stop(self) -> None:
        if self.engine is None:
            return
        self.query_one("#launch-keys", Static).update("stopping the engine...")
        await asyncio.to_thread(self.engine.stop, self.options.grace_s + 5)
        self.show_state()
        if self.timer is not None:
            self.timer.stop()
        self.query_one("#launch-keys", Static).update("[b]Esc[/b] close")
        self.post_message(LaunchStopped(self.engine.run.path))

    def action_close(self) -> None:
        if self.timer is not None:
            self.timer.stop()
        if self.engine is not None and self.engine.alive():
            self.app.notify(
                f"the engine keeps running (Ctrl+L shows it); stop it there or with: "
                f"strata stop {self.engine.run.path}",
                timeout=10,
            )
        self.dismiss(None)
