"""Messages the TUI's widgets send up to the app: small dataclasses, one per thing that happened."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from textual.message import Message

if TYPE_CHECKING:
    from .engine import Engine


@dataclass
class ProfileChosen(Message):
    """The user picked a profile in the list."""

    path: Path


@dataclass
class LaunchStarted(Message):
    """The launch page started an engine; the app watches it from now on."""

    engine: Engine


@dataclass
class LaunchStopped(Message):
    """A launch started from the TUI was stopped (or found already gone)."""

    run_dir: Path
