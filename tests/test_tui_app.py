"""`strata tui` driven with Pilot: keys pressed, state asserted, on copies of the repository's profiles."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest
from textual.widgets import Static
from tui_helpers import (
    DEMO,
    PRODUCTION,
    add_line_after,
    app_on,
    go_to_end_of,
    in_view,
    pilot_test,
    plain,
    row_of,
    settle,
    text_of,
    work_on_copies,
)

from strata_cfg.tui.app import StrataApp
from strata_cfg.tui.document import backup_path
from strata_cfg.tui.screens.dialogs import ChoiceScreen, PageScreen
from strata_cfg.tui.screens.diff import DiffScreen
from strata_cfg.tui.screens.help import HelpScreen
from strata_cfg.tui.screens.new_profile import NewProfileScreen

SIZE = (160, 48)  # wide enough that a problem's message fits on its editor line


@pytest.fixture
def profiles(tmp_path, monkeypatch) -> Path:
    return work_on_copies(tmp_path, monkeypatch)


def _shown(app: StrataApp, part: str) -> str:
    return text_of(app.query_one(f"#plan-{part}"))


@pilot_test
async def test_setting_batch_groups_to_2_turns_batch_mtp_off_in_the_plan_view_with_its_reason(profiles):
    app = app_on(PRODUCTION)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert "batch MTP on" in _shown(app, "summary")
        assert "batch-mtp.pipelined-groups" not in _shown(app, "decisions")

        await add_line_after(pilot, "mtp = true", "groups = 2")
        await settle(pilot)

        summary = _shown(app, "summary")
        assert "2 groups · pipelined · ! batch MTP off although asked for" in summary
        decisions = _shown(app, "decisions").splitlines()
        # The asked-for feature a rule turned off comes first, marked, with its reason and where asked.
        assert decisions[0].startswith("! OFF batch-mtp.pipelined-groups")
        assert "does not combine with pipelined slot groups" in decisions[0]
        assert f"asked at {PRODUCTION}:{row_of(app.editor.text, 'mtp = true') + 1}" in decisions[0]
        assert app.outcome.resolved is not None and app.outcome.resolved.plan.batch.mtp is False
        assert "● modified" in plain(app.query_one("#status", Static).content)

        # Undo brings batch MTP back: the view follows the text both ways.
        await pilot.press("ctrl+z")
        await settle(pilot)
        assert "batch MTP on" in _shown(app, "summary")


@pilot_test
async def test_a_key_typo_shows_the_did_you_mean_at_its_line_in_the_editor(profiles):
    app = app_on(DEMO)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        row = await go_to_end_of(pilot, "slots = 2")
        app.editor.move_cursor((row, len("slots")))
        await pilot.press("backspace")  # slots -> slot
        await settle(pilot)

        message = "unknown key `slot`; did you mean `slots`?"
        assert app.editor.problems == {row: message}
        drawn = app.editor.render_line(row - app.editor.scroll_offset.y).text
        assert drawn.lstrip().startswith(f"{row + 1}") and f"slot = 2  ◀ {message}" in drawn
        assert f"line {row + 1}  batch.slot: {message}" in _shown(app, "problems")
        assert app.plan_view.has_class("-stale")  # the last plan that resolved stays, dimmed
        assert "refused: 1 problem" in plain(app.query_one("#status", Static).content)

        await pilot.press("s")  # fixed: the mark goes
        await settle(pilot)
        assert app.editor.problems == {} and not app.plan_view.has_class("-stale")


@pilot_test
async def test_saving_writes_the_file_and_keeps_a_backup(profiles):
    path = profiles / "demo.toml"
    before = path.read_text()
    app = app_on(DEMO)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        port = 20000 + secrets.randbelow(20000)
        row = row_of(app.editor.text, "port = 8000")
        app.editor.move_cursor((row, len("port = ")))
        await pilot.press("shift+end", *str(port))
        await settle(pilot)
        assert app.modified
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert path.read_text() == before.replace("port = 8000", f"port = {port}")
        assert backup_path(path).read_text() == before
        assert not app.modified
        assert " saved" in plain(app.query_one("#status", Static).content)


@pilot_test
async def test_a_save_that_would_clobber_a_change_on_disk_is_refused(profiles):
    path = profiles / "demo.toml"
    app = app_on(DEMO)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await add_line_after(pilot, "mtp = true", "groups = 2")
        elsewhere = path.read_text() + f"# changed in another editor {secrets.token_hex(4)}\n"
        path.write_text(elsewhere)
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert path.read_text() == elsewhere
        assert not backup_path(path).exists()
        assert app.modified  # the edits are still in the editor, not lost either

        # The diff says why, and reloading takes the file as it is on disk now.
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert isinstance(app.screen, DiffScreen)
        page = plain(app.screen.body)
        assert "changed on disk since it was opened" in page and "+groups = 2" in page
        await pilot.press("r", "y")  # reload, and yes, drop the edits
        await settle(pilot)
        assert app.editor.text == elsewhere and not app.modified


@pilot_test
async def test_a_crash_during_save_leaves_the_original_intact(profiles, monkeypatch):
    path = profiles / "demo.toml"
    before = path.read_text()
    app = app_on(DEMO)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await add_line_after(pilot, "mtp = true", "groups = 2")

        def crash(src, dst):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "replace", crash)
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert path.read_text() == before
        assert sorted(p.name for p in profiles.iterdir() if p.name.startswith(".")) == []  # no temp files
        assert app.modified


@pilot_test
async def test_explain_shows_value_source_and_rules_of_the_key_under_the_cursor(profiles):
    app = app_on(DEMO)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        row = await go_to_end_of(pilot, "mtp = true")
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert isinstance(app.screen, PageScreen)
        page = plain(app.screen.body)
        assert page.startswith("batch.mtp = true")
        assert f"source     user ({DEMO}:{row + 1})" in page
        assert "on         every gate passed (9 checked)" in page and "groups.batch-mtp-yield" in page
        await pilot.press("escape")
        # On the table header: every key of the table, defaults and derived ones included.
        await go_to_end_of(pilot, "[batch]")
        await pilot.press("f2")
        await pilot.pause()
        page = plain(app.screen.body)
        assert "batch.groups = 1" in page and "derived by groups.batch-mtp-yield" in page


@pilot_test
async def test_diff_shows_text_and_plan_changes_against_the_saved_file(profiles):
    app = app_on(DEMO)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await add_line_after(pilot, "mtp = true", "groups = 2")
        await settle(pilot)
        await pilot.press("ctrl+r")
        await pilot.pause()
        page = plain(app.screen.body)
        assert "+groups = 2" in page
        assert "batch.mtp" in page and "true -> false" in page
        assert "+ off   batch-mtp.pipelined-groups" in page


@pilot_test
async def test_new_profile_from_a_machine_probe_opens_unsaved_and_saves_into_the_list(profiles):
    vram = [8192 + 1024 * secrets.randbelow(16) for _ in range(2)]
    csv = "".join(f"{i}, NVIDIA GeForce RTX 3090, {v}\n" for i, v in enumerate(vram))
    app = app_on(DEMO, probe=lambda: csv)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert isinstance(app.screen, NewProfileScreen)
        screen = app.screen
        for _ in range(100):
            if screen.result is not None:
                break
            await pilot.pause(0.02)
        await pilot.press("ctrl+u", *"profiles/box", "enter")
        await settle(pilot)
        path = Path("profiles/box.toml")
        assert not path.exists() and app.modified
        assert f"vram_mib = {vram[1]}, bandwidth_gbs = 936" in app.editor.text
        plan = app.outcome.resolved.plan
        assert [g.vram_mib for g in plan.machine.gpus] == vram and len(plan.stages) == 2
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert path.read_text() == app.editor.text
        assert path in app.profile_list.paths


@pilot_test
async def test_a_failed_probe_still_gives_a_profile_that_resolves(profiles):
    def no_gpu() -> str:
        raise OSError("nvidia-smi was not found on PATH")

    app = app_on(DEMO, probe=no_gpu)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("f4")
        await pilot.pause()
        for _ in range(100):
            if app.screen.result is not None:
                break
            await pilot.pause(0.02)
        assert "nvidia-smi was not found" in plain(app.screen.query_one("#probe-result", Static).content)
        await pilot.press("enter")
        await settle(pilot)
        assert "nvidia-smi was not found on PATH" in app.editor.text
        assert app.outcome.resolved is not None and app.outcome.resolved.machine.backend == "cpu"


@pilot_test
async def test_switching_profiles_with_unsaved_edits_asks_to_save_discard_or_cancel(profiles):
    app = app_on(None)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert app.file.path == Path(DEMO)  # the first profile in the list opens
        app.editor.focus()
        await pilot.press("x")
        await pilot.press("ctrl+o")
        assert app.profile_list.has_focus
        await pilot.press("down", "enter")
        assert isinstance(app.screen, ChoiceScreen)
        assert [b.label.plain for b in app.screen.query("Button")] == [
            "Save [s]",
            "Discard the edits [d]",
            "Cancel [Esc]",
        ]
        await pilot.press("escape")  # cancel: nothing changes
        assert app.file.path == Path(DEMO) and app.modified
        await pilot.press("enter", "d")  # discard: the other profile opens, the file is as it was
        await settle(pilot)
        assert app.file.path == Path("profiles/gpu16-x4.toml") and not app.modified
        assert not Path(DEMO).read_text().startswith("x")

        # Save: the edits are written, then the other profile opens.
        app.editor.focus()
        await pilot.press("y")
        await pilot.press("ctrl+o", "up", "enter", "s")
        await settle(pilot)
        assert app.file.path == Path(DEMO) and not app.modified
        assert Path("profiles/gpu16-x4.toml").read_text().startswith("y")


@pilot_test
async def test_every_pane_is_reached_with_tab_and_every_action_has_a_key(profiles):
    app = app_on(DEMO)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert not app.profile_list.display  # narrow: the list hides once a profile is open
        focused = []
        await pilot.press("ctrl+o")
        for _ in range(3):
            focused.append(app.focused.id if app.focused else None)
            await pilot.press("tab")
        assert focused == ["profiles", "editor", "plan"]
        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        page = plain(app.screen.body)
        for key in (
            "Ctrl+O",
            "Ctrl+S",
            "Ctrl+T / F2",
            "Ctrl+R / F3",
            "Ctrl+N / F4",
            "Ctrl+L / F5",
            "F1",
            "Ctrl+Q",
        ):
            assert key in page


@pilot_test
async def test_a_probed_machine_is_probed_once_not_on_every_edit(profiles):
    vram = 8192 + 1024 * secrets.randbelow(24)
    calls = []

    def probe() -> str:
        calls.append(1)
        return f"0, NVIDIA GeForce RTX 4090, {vram}\n"

    probed = profiles / "probed.toml"
    probed.write_text(
        'name = "probed"\n\n[machine]\nprobe = true\n\n[model]\nsynthetic = "tiny"\n\n[batch]\nslots = 2\n'
    )
    app = app_on(str(probed), probe=probe)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await go_to_end_of(pilot, "slots = 2")
        for n in "3456":
            await pilot.press("backspace", n)
            await settle(pilot)
        plan = app.outcome.resolved.plan
        assert plan.batch.slots == 6 and [g.vram_mib for g in plan.machine.gpus] == [vram]
        assert len(calls) == 1


@pilot_test
async def test_a_profile_that_does_not_resolve_shows_no_plan_of_another_profile(profiles):
    broken = profiles / "broken.toml"  # first in the list
    demo = (profiles / "demo.toml").read_text()
    broken.write_text(demo.replace('name = "demo"', 'name = "broken"').replace("slots = 2", "slot = 2"))
    app = app_on(PRODUCTION)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert app.plan_view.border_title == "plan: rtx3080-20g-x2"
        await pilot.press("ctrl+o", "home", "enter")
        await settle(pilot)
        assert app.file.path == broken
        # Its error, and no plan under it: the production box's plan says nothing about this file.
        assert "batch.slot: unknown key" in _shown(app, "problems")
        assert app.plan_view.border_title == "plan"
        assert not app.query_one("#plan-summary").display and not app.query_one("#plan-decisions").display

        # Once it resolves, its own plan is the one kept (dimmed) under its next problem.
        row = await go_to_end_of(pilot, "slot = 2")
        app.editor.move_cursor((row, len("slot")))
        await pilot.press("s")
        await settle(pilot)
        assert app.plan_view.border_title == "plan: broken"
        await pilot.press("backspace")
        await settle(pilot)
        assert app.plan_view.border_title == "plan: broken (last that resolved)"
        assert "1 group" in _shown(app, "summary")


@pilot_test
async def test_at_80x24_the_plan_scrolls_to_and_highlights_what_an_edit_changed(profiles):
    app = app_on(PRODUCTION)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        # The plan was scrolled down to the VRAM bars, so the batch line is out of sight.
        app.plan_view.focus()
        await pilot.press("end")
        await pilot.pause()
        assert app.plan_view.scroll_y > 0

        app.editor.focus()
        mtp = await add_line_after(pilot, "mtp = true", "groups = 2")
        await settle(pilot)
        await pilot.pause()

        lines = list(app.plan_view.query(Static))

        def line(text: str) -> Static:
            return next(w for w in lines if text in plain(w.content))

        batch, turned_off = line("! batch MTP off"), line("! OFF batch-mtp.pipelined-groups")
        assert batch in in_view(app.plan_view)  # the first thing the edit changed is in sight
        assert batch.has_class("-changed") and turned_off.has_class("-changed")
        assert not line("spec").has_class("-changed")  # unchanged: not highlighted
        assert not line("model").has_class("-changed")

        # The line that asked for batch MTP is marked in the editor's gutter.
        drawn = app.editor.render_line(mtp - app.editor.scroll_offset.y).text
        assert drawn.lstrip().startswith(f"{mtp + 1}! mtp = true")
        assert app.editor.overrides == {mtp: "off: batch-mtp.pipelined-groups"}

        # An edit that changes nothing in the plan highlights nothing.
        await pilot.press("enter", *"# a comment")
        await settle(pilot)
        assert not any(w.has_class("-changed") for w in app.plan_view.query(Static))


@pilot_test
async def test_the_140_column_rule_for_the_list_is_applied_again_on_resize(profiles):
    app = app_on(DEMO)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert app.profile_list.display
        await pilot.resize_terminal(100, 30)
        await pilot.pause()
        assert not app.profile_list.display
        await pilot.resize_terminal(150, 40)
        await pilot.pause()
        assert app.profile_list.display


@pilot_test
async def test_quitting_with_unsaved_edits_offers_to_save_them(profiles):
    path = profiles / "demo.toml"
    app = app_on(DEMO)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await add_line_after(pilot, "mtp = true", "groups = 2")
        await pilot.press("ctrl+q")
        await pilot.pause()
        assert isinstance(app.screen, ChoiceScreen) and "unsaved edits" in app.screen.question
        await pilot.press("s")
        await pilot.pause()
        assert app.return_code == 0
        assert "mtp = true\ngroups = 2\n" in path.read_text()
