"""The look of `strata tui`, pinned as SVG snapshots at fixed terminal sizes.

Profiles are copies in a temporary directory (the working directory of the test), the cursor does not
blink, and every snapshot is taken once the plan has been resolved. Update after a deliberate change with
``pytest tests/test_tui_snapshots.py --snapshot-update`` and look at the new SVGs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tui_helpers import DEMO, PRODUCTION, copy_profiles, row_of, settle

from strata_cfg.tui.app import StrataApp


@pytest.fixture(autouse=True)
def profiles(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return copy_profiles(tmp_path)


async def _ready(pilot) -> None:
    pilot.app.editor.cursor_blink = False
    await settle(pilot)


def test_main_screen_on_the_demo_profile_at_80x24(snap_compare):
    app = StrataApp(Path("profiles"), Path(DEMO))
    assert snap_compare(app, terminal_size=(80, 24), run_before=_ready)


def test_main_screen_on_the_production_box_profile(snap_compare):
    app = StrataApp(Path("profiles"), Path(PRODUCTION))
    assert snap_compare(app, terminal_size=(120, 36), run_before=_ready)


def test_main_screen_when_pipelined_groups_turn_off_the_batch_mtp_asked_for(snap_compare):
    async def groups_2(pilot) -> None:
        editor = pilot.app.editor
        row = row_of(editor.text, "mtp = true")
        editor.move_cursor((row, len("mtp = true")))
        await pilot.press("enter", *"groups = 2")
        await _ready(pilot)

    app = StrataApp(Path("profiles"), Path(PRODUCTION), debounce_s=0.05)
    assert snap_compare(app, terminal_size=(120, 36), run_before=groups_2)
