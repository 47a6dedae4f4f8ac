"""Make the README's picture of `strata tui`: the production box with ``batch.groups = 2`` typed in, so that
the plan shows batch MTP turned off although the profile asked for it, and why.

    python scripts/tui_screenshot.py [OUT.svg]   (default: docs/tui.svg)

It runs on a copy of ``profiles/`` in a temporary directory, so nothing in the repository is edited.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

from strata_cfg.tui.app import StrataApp

REPO = Path(__file__).resolve().parent.parent
SIZE = (120, 36)


async def shoot(out: Path) -> None:
    app = StrataApp(Path("profiles"), Path("profiles/rtx3080-20g-x2.toml"), debounce_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        editor = app.editor
        editor.cursor_blink = False
        row = editor.text.splitlines().index("mtp = true")
        editor.move_cursor((row, len("mtp = true")))
        await pilot.press("enter", *"groups = 2")
        while app.resolve_pending:
            await pilot.pause(0.05)
        await pilot.pause()
        app.save_screenshot(out.name, path=str(out.parent))


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else REPO / "docs" / "tui.svg").resolve()
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(REPO / "profiles", Path(tmp) / "profiles")
        os.chdir(tmp)
        asyncio.run(shoot(out))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
