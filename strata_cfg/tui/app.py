"""`strata tui`: edit a profile and watch what it resolves to, pane by pane.

Three panes: the profile list, the TOML editor and the plan view, with a status line and the key bindings
under them. Every edit re-resolves the editor's text (after a short pause in typing) through the same
functions as the CLI, `load_profile_text` then `resolve_loaded`, and the plan view, the editor's problem
marks and the status line follow. Every action has a key, and Tab moves the focus, so it works without a
mouse over SSH, at 80x24 too (below 140 columns the list hides once a profile is open; Ctrl+O shows it).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.timer import Timer
from textual.widgets import Footer, TextArea

from ..facts.machine import probe_nvidia_smi
from ..launch.options import LaunchOptions
from ..launch.run_dir import RUNS_ROOT
from ..plan.from_profile import Resolved, resolve_loaded
from ..profile.load import load_profile_text
from ..report.explain import explain_text
from ..report.problems import problems_text
from ..schema.errors import Problem, ProfileError
from ..schema.plan import LaunchPlan
from .document import ProfileFile, SaveFailed, SaveRefused, key_at, problems_by_row
from .messages import LaunchStopped, ProfileChosen
from .screens.dialogs import ConfirmScreen, PageScreen
from .screens.diff import DiffScreen, diff_page
from .screens.help import HelpScreen
from .screens.launch import LaunchScreen
from .screens.new_profile import NewProfileScreen
from .widgets.editor import ProfileEditor
from .widgets.plan_view import PlanView
from .widgets.profile_list import ProfileList
from .widgets.status_bar import StatusBar, status_text

DEBOUNCE_S = 0.25
"""Pause in typing after which the editor's text is resolved again."""
WIDE = 140
"""From this many columns the profile list stays beside the editor."""


@dataclass(frozen=True)
class Outcome:
    """The last resolution of the editor's text."""

    resolved: Resolved | None
    problems: tuple[Problem, ...] = ()


class ProbeOnce:
    """The machine probe, run at most once per session: a profile with ``machine.probe = true`` is resolved
    on every edit, and nvidia-smi can take seconds. Its failure is remembered too."""

    def __init__(self, probe: Callable[[], str]) -> None:
        self.probe = probe
        self.calls = 0
        self._answer: str | None = None
        self._error: Exception | None = None

    def __call__(self) -> str:
        if self._answer is None and self._error is None:
            self.calls += 1
            try:
                self._answer = self.probe()
            except (OSError, subprocess.SubprocessError) as exc:
                self._error = exc
        if self._error is not None:
            raise self._error
        assert self._answer is not None
        return self._answer


def resolve_editor_text(text: str, path: Path, probe: Callable[[], str], strict: bool) -> Outcome:
    """The CLI's path from text to plan, with the problems kept instead of raised."""
    try:
        loaded = load_profile_text(text, path.as_posix())
        return Outcome(resolve_loaded(loaded, strict=strict, probe=probe))
    except ProfileError as exc:
        return Outcome(None, tuple(exc.problems))


class StrataApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "strata tui"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+o", "profiles", "Profiles", tooltip="show or hide the profile list, and focus it"),
        Binding(
            "ctrl+s",
            "save",
            "Save",
            tooltip="save atomically, keeping <file>.bak; refused if changed on disk",
        ),
        Binding(
            "ctrl+t,f2",
            "explain",
            "Explain",
            tooltip="explain the key under the cursor: value, source, rules",
        ),
        Binding(
            "ctrl+r,f3", "diff", "Diff", tooltip="diff the editor against the file on disk, text and plan"
        ),
        Binding("ctrl+n,f4", "new", "New", tooltip="new profile from a probe of this machine's GPUs"),
        Binding(
            "ctrl+l,f5", "launch", "Launch", tooltip="launch the saved profile; shows health and the log"
        ),
        Binding("f1", "help", "Help", tooltip="this help"),
        Binding(
            "ctrl+q", "quit", "Quit", tooltip="quit (asks first when there are unsaved edits)", priority=True
        ),
    ]

    def __init__(
        self,
        root: Path,
        first: Path | None = None,
        *,
        strict: bool = False,
        probe: Callable[[], str] = probe_nvidia_smi,
        runs_root: Path = RUNS_ROOT,
        launch_options: LaunchOptions | None = None,
        debounce_s: float = DEBOUNCE_S,
    ) -> None:
        super().__init__()
        self.root = root
        self.first = first
        self.strict = strict
        self.probe = probe
        """Runs afresh for a new profile; resolving uses `machine_probe`, which runs it once."""
        self.machine_probe = ProbeOnce(probe)
        self.runs_root = runs_root
        self.launch_options = launch_options or LaunchOptions()
        self.debounce_s = debounce_s
        self.file: ProfileFile | None = None
        self.outcome = Outcome(None)
        self.last_good: Resolved | None = None
        self._pending: Timer | None = None

    # ---- layout ---------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with Horizontal(id="panes"):
            yield ProfileList(self.root, id="profiles")
            yield ProfileEditor(id="editor")
            yield PlanView(id="plan")
        yield StatusBar(id="status")
        yield Footer()

    @property
    def editor(self) -> ProfileEditor:
        return self.query_one(ProfileEditor)

    @property
    def plan_view(self) -> PlanView:
        return self.query_one(PlanView)

    @property
    def profile_list(self) -> ProfileList:
        return self.query_one(ProfileList)

    def on_mount(self) -> None:
        first = self.first or next(iter(self.profile_list.paths), None)
        if first is not None:
            self.open(ProfileFile.open(first))
        else:
            self.show_status()
        self._list_shown(first is None or self.size.width >= WIDE)
        (self.editor if first is not None else self.profile_list).focus()

    def _list_shown(self, shown: bool) -> None:
        self.profile_list.display = shown

    # ---- the open profile ---------------------------------------------------------------------

    @property
    def modified(self) -> bool:
        return self.file is not None and self.file.is_modified(self.editor.text)

    def open(self, file: ProfileFile, text: str | None = None) -> None:
        """Put ``file`` in the editor (with ``text`` instead of what is on disk, for a new profile)."""
        self.file = file
        self.editor.load_text(file.saved_text if text is None else text)
        self.editor.border_title = file.path.as_posix()
        self.profile_list.mark_open(file.path)
        self.resolve_now()

    def on_profile_chosen(self, message: ProfileChosen) -> None:
        def switch(yes: bool | None = True) -> None:
            if yes:
                self.open(ProfileFile.open(message.path))
                if self.size.width < WIDE:
                    self._list_shown(False)
                self.editor.focus()

        if self.file is not None and message.path == self.file.path:
            return switch()
        if self.modified:
            assert self.file is not None
            self.push_screen(ConfirmScreen(f"Drop the unsaved edits to {self.file.path.as_posix()}?"), switch)
        else:
            switch()

    # ---- resolving as the user types ----------------------------------------------------------

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        if self._pending is not None:
            self._pending.stop()
        self._pending = self.set_timer(self.debounce_s, self.resolve_now)
        self.show_status()

    @property
    def resolve_pending(self) -> bool:
        """Whether an edit is waiting for its resolution (tests wait on this)."""
        return self._pending is not None

    def resolve_now(self) -> None:
        self._pending = None
        if self.file is None:
            return
        self.outcome = resolve_editor_text(self.editor.text, self.file.path, self.machine_probe, self.strict)
        if self.outcome.resolved is not None:
            self.last_good = self.outcome.resolved
        path = self.file.path.as_posix()
        shown = self.outcome.resolved or self.last_good
        self.plan_view.show(shown.plan if shown else None, self.outcome.problems, path)
        self.editor.show_problems(problems_by_row(self.outcome.problems, path))
        self.show_status()

    def show_status(self) -> None:
        plan = self.outcome.resolved.plan if self.outcome.resolved else None
        path = self.file.path if self.file else None
        text = status_text(path, self.modified, plan, len(self.outcome.problems), self.editor.highlighting)
        self.query_one(StatusBar).update(text)

    # ---- actions --------------------------------------------------------------------------------

    def action_profiles(self) -> None:
        shown = not self.profile_list.display or not self.profile_list.has_focus
        self._list_shown(shown)
        (self.profile_list if shown else self.editor).focus()

    def action_save(self) -> None:
        if self.file is None:
            return
        try:
            backup = self.file.save(self.editor.text)
        except (SaveRefused, SaveFailed) as exc:
            self.notify(str(exc), title="not saved", severity="error", timeout=10)
            return
        kept = f"; the previous version is in {backup.name}" if backup else ""
        self.notify(f"saved {self.file.path.as_posix()}{kept}", title="saved")
        if self.file.path not in self.profile_list.paths:
            self.profile_list.reload()
            self.profile_list.mark_open(self.file.path)
        self.show_status()

    def action_explain(self) -> None:
        if self.file is None:
            return
        row = self.editor.cursor_location[0]
        key = key_at(self.editor.text, row)
        if key is None:
            self.notify("no key on this line or above it", severity="warning")
            return
        self.push_screen(PageScreen(f"explain {key}", self.explanation(key, row)))

    def explanation(self, key: str, row: int) -> str:
        """What `strata explain` says about ``key`` (or the nearest table above it that it knows)."""
        if self.outcome.resolved is None:
            here = [p for p in self.outcome.problems if p.line == row + 1]
            return "the profile does not resolve:\n" + problems_text(here or self.outcome.problems)
        plan = self.outcome.resolved.plan
        parts = key.split(".")
        while parts:
            text = explain_text(plan, ".".join(parts))
            if text is not None:
                return text
            parts.pop()
        origin = self.outcome.resolved.loaded.origin(key)
        where = f" (written at {origin})" if origin else ""
        return (
            f"{key}{where} is not a setting the resolver decides: it describes the machine or the profile "
            "itself, and the plan takes it as given"
        )

    def action_diff(self) -> None:
        if self.file is None:
            return
        disk = self.file.disk_now()
        disk_text = disk.decode("utf-8", errors="replace") if disk is not None else None
        name = self.file.path.as_posix()
        disk_plan: LaunchPlan | str | None = None
        if disk_text is not None:
            old = resolve_editor_text(disk_text, self.file.path, self.machine_probe, self.strict)
            disk_plan = old.resolved.plan if old.resolved else problems_text(old.problems)
        now = self.outcome.resolved.plan if self.outcome.resolved else problems_text(self.outcome.problems)
        page = diff_page(disk_text, self.editor.text, name, disk_plan, now, self.file.changed_on_disk())

        def done(answer: str | None) -> None:
            if answer == "reload" and self.file is not None:
                self._reload()

        self.push_screen(DiffScreen(f"diff {name}", page), done)

    def _reload(self) -> None:
        assert self.file is not None
        if self.file.disk_now() is None:
            self.notify(f"{self.file.path.as_posix()} is not on disk", severity="warning")
            return
        self.open(ProfileFile.open(self.file.path))
        self.notify(f"reloaded {self.file.path.as_posix()} from disk")

    def action_new(self) -> None:
        def made(result: tuple[Path, str] | None) -> None:
            if result is not None:
                path, text = result
                self.open(ProfileFile.new(path), text)
                self.editor.focus()
                self.notify(f"new profile {path.as_posix()}: review it, then save with Ctrl+S")

        def ask(yes: bool | None = True) -> None:
            if yes:
                self.push_screen(NewProfileScreen(self.root, self.probe), made)

        if self.modified:
            assert self.file is not None
            self.push_screen(ConfirmScreen(f"Drop the unsaved edits to {self.file.path.as_posix()}?"), ask)
        else:
            ask()

    def action_launch(self) -> None:
        if self.file is None:
            return
        if self.modified:
            self.notify("save first (Ctrl+S): a launch runs the saved file", severity="warning")
            return
        self.push_screen(
            LaunchScreen(self.file.path, self.runs_root, self.launch_options, strict=self.strict)
        )

    def on_launch_stopped(self, message: LaunchStopped) -> None:
        self.notify(f"the engine of {message.run_dir.as_posix()} is stopped")

    def action_help(self) -> None:
        self.push_screen(HelpScreen(b for b in self.BINDINGS if isinstance(b, Binding)))

    async def action_quit(self) -> None:
        def leave(yes: bool | None) -> None:
            if yes:
                self.exit()

        if self.modified:
            assert self.file is not None
            self.push_screen(ConfirmScreen(f"Quit without saving {self.file.path.as_posix()}?"), leave)
        else:
            self.exit()
