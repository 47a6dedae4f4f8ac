"""The open file and the disk, driven with Pilot: what a save writes (and with which permissions), what it
warns about, reloading from disk, and a change made elsewhere while the file is open."""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from textual.widgets import Static
from tui_helpers import (
    DEMO,
    add_line_after,
    app_on,
    pilot_test,
    plain,
    settle,
    text_of,
    until,
    work_on_copies,
)

from strata_cfg.tui.app import StrataApp
from strata_cfg.tui.document import backup_path
from strata_cfg.tui.screens.diff import DiffScreen

SIZE = (160, 48)


@pytest.fixture
def profiles(tmp_path, monkeypatch) -> Path:
    return work_on_copies(tmp_path, monkeypatch)


@pytest.fixture
def umask() -> Iterator[int]:
    """A umask that gives neither 0600 nor the file's own mode (restored afterwards)."""
    mask = 0o007
    old = os.umask(mask)
    yield mask
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _notices(app: StrataApp) -> list[tuple[str, str]]:
    """(message, severity) of every notification the app shows from now on."""
    seen: list[tuple[str, str]] = []
    notify = app.notify

    def record(message: str, **kw) -> None:
        seen.append((message, kw.get("severity", "information")))
        notify(message, **kw)

    app.notify = record  # type: ignore[method-assign]
    return seen


def _status(app: StrataApp) -> str:
    return plain(app.query_one("#status", Static).content)


@pilot_test
async def test_saving_keeps_the_profiles_permissions_and_a_new_profile_gets_the_umasks(profiles, umask):
    path = profiles / "demo.toml"
    path.chmod(0o664)  # readable by all, as a profile in a shared checkout is
    app = app_on(DEMO, probe=lambda: "0, NVIDIA GeForce RTX 3090, 24576\n")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await add_line_after(pilot, "mtp = true", "groups = 2")
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert "groups = 2" in path.read_text()
        assert _mode(path) == 0o664 and _mode(backup_path(path)) == 0o664

        await pilot.press("ctrl+n")
        await until(pilot, lambda: getattr(app.screen, "result", None) is not None, what="for the probe")
        await pilot.press("ctrl+u", *"profiles/fresh", "enter")
        await settle(pilot)
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert _mode(Path("profiles/fresh.toml")) == 0o666 & ~umask


@pilot_test
async def test_reloading_from_the_diff_view_asks_first_and_ctrl_z_brings_the_edits_back(profiles):
    path = profiles / "demo.toml"
    on_disk = path.read_text()
    app = app_on(DEMO)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await add_line_after(pilot, "mtp = true", "groups = 2")
        await settle(pilot)
        edited = app.editor.text

        await pilot.press("ctrl+r")
        await pilot.pause()
        assert isinstance(app.screen, DiffScreen)
        await pilot.press("r")
        await pilot.pause()
        assert "dropping the edits" in getattr(app.screen, "question", "")
        await pilot.press("escape")  # no: the edits stay
        await pilot.pause()
        assert app.editor.text == edited and app.modified

        await pilot.press("ctrl+r")
        await pilot.pause()
        await pilot.press("r", "y")
        await settle(pilot)
        assert app.editor.text == on_disk and not app.modified
        assert "1 group · serial · batch MTP on" in text_of(app.query_one("#plan-summary"))

        app.editor.focus()
        await pilot.press("ctrl+z")  # the reload is one edit: undoing it brings the edits back
        await settle(pilot)
        assert app.editor.text == edited and app.modified


@pilot_test
async def test_saving_a_profile_that_does_not_resolve_warns_that_it_is_refused(profiles):
    path = profiles / "demo.toml"
    app = app_on(DEMO)
    async with app.run_test(size=SIZE) as pilot:
        notices = _notices(app)
        await settle(pilot)
        app.debounce_s = 60  # no pause in typing resolves it: the save must judge the text it saves
        await add_line_after(pilot, "mtp = true", "groups = two")
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert "groups = two" in path.read_text()  # saved: the user may want to keep a work in progress
        warnings = [m for m, severity in notices if severity == "warning"]
        assert len(warnings) == 1 and "does not resolve (1 problem)" in warnings[0]
        assert "launching refuse it" in warnings[0]


@pilot_test
async def test_a_change_made_on_disk_is_noticed_without_saving(profiles):
    path = profiles / "demo.toml"
    app = app_on(DEMO)
    async with app.run_test(size=SIZE) as pilot:
        notices = _notices(app)
        await settle(pilot)
        # No edits in the editor: the file is reloaded (as an edit, so Ctrl+Z could undo it).
        elsewhere = path.read_text().replace("slots = 2", "slots = 3")
        path.write_text(elsewhere)
        await until(pilot, lambda: app.editor.text == elsewhere, 10, "for the reload")
        await settle(pilot)
        assert not app.modified and app.outcome.resolved.plan.batch.slots == 3

        # With edits: they stay, and the status line and a warning say what happened.
        await add_line_after(pilot, "mtp = true", "groups = 2")
        path.write_text(elsewhere + f"# {secrets.token_hex(4)}\n")
        await until(pilot, lambda: "changed on disk" in _status(app), 10, "for the status line")
        assert "groups = 2" in app.editor.text
        assert any("changed on disk" in m and s == "warning" for m, s in notices)
