"""Shared by the TUI tests: a copy of the repository's profiles in a temporary directory, running a Pilot
test without an async pytest plugin, waiting for the app (to finish resolving after an edit, or for any
condition), and reading what it shows."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import shutil
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console, RenderableType
from textual.errors import NoWidget
from textual.widget import Widget
from textual.widgets import Static

from strata_cfg.tui.app import StrataApp

REPO = Path(__file__).resolve().parent.parent
DEMO = "profiles/demo.toml"
PRODUCTION = "profiles/rtx3080-20g-x2.toml"


def copy_profiles(tmp_path: Path) -> Path:
    """``tmp_path/profiles``: a copy of the repository's profiles, so no test touches the real files."""
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    return tmp_path / "profiles"


def work_on_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Work in ``tmp_path`` on a copy of the profiles; returns ``profiles`` (relative, as a user types it)."""
    monkeypatch.chdir(tmp_path)
    copy_profiles(tmp_path)
    return Path("profiles")


def app_on(first: str | None = DEMO, **kw: Any) -> StrataApp:
    """The app on ``profiles/`` (the working directory's), with ``first`` open, resolving soon after a key."""
    kw.setdefault("debounce_s", 0.05)
    return StrataApp(Path("profiles"), Path(first) if first else None, **kw)


def pilot_test(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test body in its own event loop (its fixtures pass through)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return run


async def settle(pilot, rounds: int = 200) -> None:
    """Wait until the edit just made has been resolved and shown."""
    for _ in range(rounds):
        await pilot.pause()
        if not pilot.app.resolve_pending:
            await pilot.pause()
            return
        await pilot.pause(0.02)
    raise AssertionError("the app did not resolve the edit")


def plain(renderable: RenderableType) -> str:
    """What a widget was given to show, as text on one wide line per line (no wrapping)."""
    console = Console(width=1000, record=True, file=io.StringIO())
    console.print(renderable)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines())


def row_of(text: str, line: str) -> int:
    """0-based row of the first line equal to ``line``."""
    return text.splitlines().index(line)


async def go_to_end_of(pilot, line: str) -> int:
    """Put the editor's cursor at the end of the first line equal to ``line``; returns its row."""
    app = pilot.app
    row = row_of(app.editor.text, line)
    app.editor.move_cursor((row, len(line)))
    await pilot.pause()
    return row


async def add_line_after(pilot, line: str, typed: str) -> int:
    """Type ``typed`` on a new line after the first line equal to ``line``; returns that line's row."""
    row = await go_to_end_of(pilot, line)
    await pilot.press("enter", *typed)
    return row


async def until(pilot, condition: Callable[[], object], seconds: float = 30.0, what: str = "") -> None:
    """Wait (the app running meanwhile) until ``condition()`` is true."""
    for _ in range(int(seconds / 0.05)):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"waited {seconds:g} s {what or 'for a condition'}")


def text_of(widget: Widget) -> str:
    """What a Static shows, or the Statics inside ``widget``, one per line."""
    lines = [widget] if isinstance(widget, Static) else list(widget.query(Static))
    return "\n".join(plain(line.content) for line in lines if isinstance(line, Static))


def in_view(widget: Widget) -> set[Widget]:
    """The widgets drawn in the visible part of scrolling ``widget`` (sampled down its left edge)."""
    region = widget.content_region
    seen: set[Widget] = set()
    for y in range(region.y, region.bottom):
        with contextlib.suppress(NoWidget):  # a blank row between parts
            seen.add(widget.screen.get_widget_at(region.x + 1, y)[0])
    return seen
