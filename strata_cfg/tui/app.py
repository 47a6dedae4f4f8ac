"""`strata tui`: edit a profile and watch what it resolves to, pane by pane.

Three panes: the profile list, the TOML editor and the plan view, with a status line and the key bindings
under them. Every edit re-resolves the editor's text (after a short pause in typing) through the same
functions as the CLI (`resolving.py`), and the plan view, the editor's problem marks and the status line
follow. Every action has a key, and Tab moves the focus, so it works without a
mouse over SSH, at 80x24 too (below 140 columns the list hides once a profile is open; Ctrl+O shows it).

The app also watches the open file on disk, so a change made elsewhere shows at once, and keeps an eye on
the engine a launch started, so it stays visible (and stoppable) after its page is closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.timer import Timer
from textual.widgets import Footer, TextArea

from ..facts.machine import probe_nvidia_smi
from ..launch.options import LaunchOptions
from ..launch.run_dir import RUNS_ROOT
from ..plan.from_profile import Resolved
from ..report.explain import explain_text
from ..report.problems import problems_text
from ..schema.plan import LaunchPlan
from .document import ProfileFile, SaveFailed, SaveRefused, key_at, overrides_by_row, problems_by_row
from .engine import Engine, find_running
from .messages import LaunchStarted, LaunchStopped, ProfileChosen
from .resolving import Outcome, ProbeOnce, resolve_editor_text
from .screens.dialogs import SAVE_DISCARD, YES, Choice, ChoiceScreen, PageScreen
from .screens.diff import DiffScreen, diff_page
from .screens.help import HelpScreen
from .screens.launch import LaunchScreen
from .screens.new_profile import NewProfileScreen
from .widgets.editor import ProfileEditor
from .widgets.engine_indicator import EngineIndicator
from .widgets.plan_view import PlanView
from .widgets.profile_list import ProfileList
from .widgets.status_bar import StatusBar, status_text

DEBOUNCE_S = 0.25
"""Pause in typing after which the editor's text is resolved again."""
WIDE = 140
"""From this many columns the profile list stays beside the editor."""
WATCH_S = 1.0
"""How often the open file is looked at on disk, to notice a change made elsewhere."""


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
            "ctrl+l,f5",
            "launch",
            "Launch",
            tooltip="launch the saved profile; shows health and the log (while an engine runs: its page)",
        ),
        Binding("f1", "help", "Help", tooltip="this help"),
        Binding(
            "ctrl+q",
            "quit",
            "Quit",
            tooltip="quit; asks first about unsaved edits (save, discard) and a running engine (stop, keep)",
            priority=True,
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
        watch_s: float = WATCH_S,
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
        self.watch_s = watch_s
        self.file: ProfileFile | None = None
        self.outcome = Outcome(None)
        self.last_good: Resolved | None = None
        """The open file's last resolution that succeeded (never another file's)."""
        self._pending: Timer | None = None
        self.disk_changed = False
        """The open file changed on disk while the editor held edits to it."""
        self._disk_stamp: tuple[int, int, int] | None = None
        self._wide: bool | None = None

    # ---- layout ---------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with Horizontal(id="panes"):
            yield ProfileList(self.root, id="profiles")
            yield ProfileEditor(id="editor")
            yield PlanView(id="plan")
        with Horizontal(id="status-row"):
            yield StatusBar(id="status")
            yield EngineIndicator(id="engine")
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
        self._wide = self.size.width >= WIDE
        self._list_shown(first is None or self._wide)
        (self.editor if first is not None else self.profile_list).focus()
        self.set_interval(self.watch_s, self.watch_file)

    def _list_shown(self, shown: bool) -> None:
        self.profile_list.display = shown

    def on_resize(self, event: events.Resize) -> None:
        """Apply the 140-column rule again when the terminal crosses it (not on every resize, so Ctrl+O's
        choice holds while the width stays on one side)."""
        wide = event.size.width >= WIDE
        if self._wide is None or wide == self._wide:
            return
        self._wide = wide
        if wide:
            self._list_shown(True)
        elif self.file is not None and not self.profile_list.has_focus:
            self._list_shown(False)

    # ---- the open profile ---------------------------------------------------------------------

    @property
    def modified(self) -> bool:
        return self.file is not None and self.file.is_modified(self.editor.text)

    def open(self, file: ProfileFile, text: str | None = None) -> None:
        """Put ``file`` in the editor (with ``text`` instead of what is on disk, for a new profile)."""
        if self.file is None or file.path != self.file.path:
            self.last_good = None  # another file's plan says nothing about this one
        self._take(file)
        self.editor.load_text(file.saved_text if text is None else text)
        self.editor.border_title = file.path.as_posix()
        self.profile_list.mark_open(file.path)
        self.resolve_now()

    def _take(self, file: ProfileFile) -> None:
        """Make ``file`` the open one, as it is on disk now."""
        self.file = file
        self.disk_changed = False
        self._disk_stamp = file.disk_stamp()

    def on_profile_chosen(self, message: ProfileChosen) -> None:
        def switch() -> None:
            self.open(ProfileFile.open(message.path))
            if self.size.width < WIDE:
                self._list_shown(False)
            self.editor.focus()

        if self.file is not None and message.path == self.file.path:
            return switch()
        self.unless_unsaved(f"opening {message.path.as_posix()}", switch)

    def unless_unsaved(self, doing: str, then: Callable[[], object]) -> None:
        """Do ``then``; with unsaved edits, first ask: save them (and go on if that worked), discard them,
        or cancel."""
        if not self.modified:
            then()
            return
        assert self.file is not None

        def answer(choice: str | None) -> None:
            if choice == "discard" or (choice == "save" and self.save()):
                then()

        question = f"{self.file.path.as_posix()} has unsaved edits. Save them before {doing}?"
        self.push_screen(ChoiceScreen(question, SAVE_DISCARD), answer)

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
        before = self.last_good
        self.outcome = resolve_editor_text(self.editor.text, self.file.path, self.machine_probe, self.strict)
        resolved = self.outcome.resolved
        if resolved is not None:
            self.last_good = resolved
        path = self.file.path.as_posix()
        shown = resolved or self.last_good
        self.plan_view.show(
            shown.plan if shown else None, self.outcome.problems, path, before.plan if before else None
        )
        overrides = overrides_by_row(resolved.plan.decisions, path) if resolved else {}
        self.editor.show_marks(problems_by_row(self.outcome.problems, path), overrides)
        self.show_status()

    def show_status(self) -> None:
        plan = self.outcome.resolved.plan if self.outcome.resolved else None
        path = self.file.path if self.file else None
        problems = len(self.outcome.problems)
        text = status_text(path, self.modified, plan, problems, self.editor.highlighting, self.disk_changed)
        self.query_one(StatusBar).update(text)

    # ---- the file on disk ---------------------------------------------------------------------

    def watch_file(self) -> None:
        """Notice a change made to the open file elsewhere: without edits in the editor, reload it; with
        some, say so (a save would be refused)."""
        file = self.file
        if file is None or file.on_disk is None:
            return
        stamp = file.disk_stamp()
        if stamp == self._disk_stamp:
            return
        self._disk_stamp = stamp
        changed = file.changed_on_disk()
        if changed and stamp is not None and not self.modified:
            self._reload(f"{file.path.as_posix()} changed on disk; reloaded it (Ctrl+Z undoes that)")
            return
        if changed and not self.disk_changed:
            what = "was deleted" if stamp is None else "changed"
            self.notify(
                f"{file.path.as_posix()} {what} on disk; your edits stay here, but saving is refused until "
                "you reload (Ctrl+R shows the difference, r there reloads)",
                title="changed on disk",
                severity="warning",
                timeout=10,
            )
        self.disk_changed = changed
        self.show_status()

    # ---- actions --------------------------------------------------------------------------------

    def action_profiles(self) -> None:
        shown = not self.profile_list.display or not self.profile_list.has_focus
        self._list_shown(shown)
        (self.profile_list if shown else self.editor).focus()

    def action_save(self) -> None:
        self.save()

    def save(self) -> bool:
        """Save the editor's text and say how that went; False when nothing was written."""
        if self.file is None:
            return False
        if self._pending is not None:  # judge the text being saved, not the one before the last keys
            self._pending.stop()
            self.resolve_now()
        try:
            backup = self.file.save(self.editor.text)
        except (SaveRefused, SaveFailed) as exc:
            self.notify(str(exc), title="not saved", severity="error", timeout=10)
            return False
        self._take(self.file)
        name = self.file.path.as_posix()
        kept = f"; the previous version is in {backup.name}" if backup else ""
        n = len(self.outcome.problems)
        if n:
            self.notify(
                f"saved {name}{kept}; but it does not resolve ({n} problem{'s' * (n != 1)}), so "
                "`strata plan` and launching refuse it as it is",
                title="saved a refused profile",
                severity="warning",
                timeout=10,
            )
        else:
            self.notify(f"saved {name}{kept}", title="saved")
        if self.file.path not in self.profile_list.paths:
            self.profile_list.reload()
            self.profile_list.mark_open(self.file.path)
        self.show_status()
        return True

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
            if answer == "reload":
                self.ask_reload()

        self.push_screen(DiffScreen(f"diff {name}", page), done)

    def ask_reload(self) -> None:
        """Reload the file from disk; with edits in the editor, only once the user says so."""
        if self.file is None:
            return
        name = self.file.path.as_posix()
        if not self.modified:
            return self._reload(f"reloaded {name} from disk")

        def answer(choice: str | None) -> None:
            if choice == "yes":
                self._reload(f"reloaded {name} from disk; Ctrl+Z brings back your edits")

        question = f"Reload {name} from disk, dropping the edits in the editor? (Ctrl+Z brings them back)"
        self.push_screen(ChoiceScreen(question, YES), answer)

    def _reload(self, said: str) -> None:
        """Take the file as it is on disk now. The editor's text is replaced by an edit, not loaded, so
        Ctrl+Z brings back what it held."""
        assert self.file is not None
        if self.file.disk_now() is None:
            self.notify(f"{self.file.path.as_posix()} is not on disk", severity="warning")
            return
        self._take(ProfileFile.open(self.file.path))
        history = self.editor.history
        history.checkpoint()
        self.editor.replace(self.file.saved_text, (0, 0), self.editor.document.end)
        history.checkpoint()
        self.resolve_now()
        self.notify(said)

    def action_new(self) -> None:
        def made(result: tuple[Path, str] | None) -> None:
            if result is not None:
                path, text = result
                self.open(ProfileFile.new(path), text)
                self.editor.focus()
                self.notify(f"new profile {path.as_posix()}: review it, then save with Ctrl+S")

        self.unless_unsaved(
            "making a new profile", lambda: self.push_screen(NewProfileScreen(self.root, self.probe), made)
        )

    def action_launch(self) -> None:
        """The launch page of the saved profile; while an engine runs, that engine's page again."""
        if self.file is None:
            return
        engine = self.engine if self.engine is not None and self.engine.alive() else self._found_running()
        if engine is not None:
            if engine is not self.engine:
                self.query_one(EngineIndicator).watch_engine(engine)
            self.push_screen(LaunchScreen(self.file.path, self.runs_root, self.launch_options, engine=engine))
            return
        if self.modified:
            self.notify("save first (Ctrl+S): a launch runs the saved file", severity="warning")
            return
        self.push_screen(
            LaunchScreen(self.file.path, self.runs_root, self.launch_options, strict=self.strict)
        )

    def _found_running(self) -> Engine | None:
        """An engine of the open profile left running under the runs directory (by an earlier session)."""
        resolved = self.outcome.resolved or self.last_good
        return find_running(resolved.plan.profile, self.runs_root) if resolved else None

    @property
    def engine(self) -> Engine | None:
        """The engine a launch from this session started (or Ctrl+L found running), once there is one."""
        return self.query_one(EngineIndicator).engine

    def on_launch_started(self, message: LaunchStarted) -> None:
        self.query_one(EngineIndicator).watch_engine(message.engine)

    def on_launch_stopped(self, message: LaunchStopped) -> None:
        self.query_one(EngineIndicator).show_state()
        self.notify(f"the engine of {message.run_dir.as_posix()} is stopped")

    def action_help(self) -> None:
        self.push_screen(HelpScreen(b for b in self.BINDINGS if isinstance(b, Binding)))

    async def action_quit(self) -> None:
        self.unless_unsaved("quitting", self._quit_unless_engine)

    def _quit_unless_engine(self) -> None:
        """Quit; while the session's engine runs, first ask whether to stop it."""
        engine = self.engine
        if engine is None or not engine.alive():
            self.exit()
            return

        def answer(choice: str | None) -> None:
            if choice == "keep":
                self.exit()
            elif choice == "stop":
                self.run_worker(self._stop_and_quit(engine), exclusive=True)

        question = (
            f"The engine of {engine.plan.profile} is running at {engine.url}/v1 "
            f"(run {engine.run.path.as_posix()}). Stop it before quitting?"
        )
        choices = (Choice("s", "Stop it and quit", "stop"), Choice("k", "Keep it running and quit", "keep"))
        self.push_screen(ChoiceScreen(question, choices), answer)

    async def _stop_and_quit(self, engine: Engine) -> None:
        self.notify("stopping the engine...")
        await asyncio.to_thread(engine.stop, self.launch_options.grace_s + 5)
        self.exit()
