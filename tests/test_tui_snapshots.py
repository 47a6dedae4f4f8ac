"""The look of `strata tui`, pinned as SVG snapshots at fixed terminal sizes.

Profiles are copies in a temporary directory (the working directory of the test), the cursor never
blinks, and every snapshot is taken once the plan has been resolved. Update after a deliberate change with
``pytest tests/test_tui_snapshots.py --snapshot-update`` and look at the new SVGs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tui_helpers import DEMO, PRODUCTION, copy_profiles, row_of, settle

from strata_cfg.tui import app as app_module
from strata_cfg.tui.app import StrataApp


class StillApp(StrataApp):
    """The app with the editor's cursor blink off from the start: switched off later, a blink already
    under way can still hide the cursor in the snapshot on a busy machine."""

    CSS_PATH = Path(app_module.__file__).with_name("app.tcss")  # a relative one would be read from tests/

    def on_mount(self) -> None:  # Textual runs this, then the app's own on_mount, which focuses the editor
        self.editor.cursor_blink = False


@pytest.fixture(autouse=True)
def profiles(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return copy_profiles(tmp_path)


async def _ready(pilot) -> None:
    await settle(pilot)


def test_main_screen_on_the_demo_profile_at_80x24(snap_compare):
    app = StillApp(Path("profiles"), Path(DEMO))
    assert snap_compare(app, terminal_size=(80, 24), run_before=_ready)


def test_main_screen_on_the_production_box_profile(snap_compare):
    app = StillApp(Path("profiles"), Path(PRODUCTION))
    assert snap_compare(app, terminal_size=(120, 36), run_before=_ready)


def test_main_screen_when_pipelined_groups_turn_off_the_batch_mtp_asked_for(snap_compare):
    async def groups_2(pilot) -> None:
        editor = pilot.app.editor
        row = row_of(editor.text, "mtp = true")
        editor.move_cursor((row, len("mtp = true")))
        await pilot.press("enter", *"groups = 2")
        await _ready(pilot)

    app = StillApp(Path("profiles"), Path(PRODUCTION), debounce_s=0.05)
    assert snap_compare(app, terminal_size=(120, 36), run_before=groups_2)
