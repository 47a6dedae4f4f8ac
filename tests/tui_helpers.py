"""Shared by the TUI tests: a copy of the repository's profiles in a temporary directory, running a Pilot
test without an async pytest plugin, and waiting for the app to finish resolving after an edit."""

from __future__ import annotations

import asyncio
import functools
import io
import shutil
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from rich.console import Console, RenderableType

REPO = Path(__file__).resolve().parent.parent
DEMO = "profiles/demo.toml"
PRODUCTION = "profiles/rtx3080-20g-x2.toml"


def copy_profiles(tmp_path: Path) -> Path:
    """``tmp_path/profiles``: a copy of the repository's profiles, so no test touches the real files."""
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    return tmp_path / "profiles"


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
