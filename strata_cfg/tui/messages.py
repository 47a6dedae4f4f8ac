"""Messages the TUI's widgets send up to the app: small dataclasses, one per thing that happened."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from textual.message import Message


@dataclass
class ProfileChosen(Message):
    """The user picked a profile in the list."""

    path: Path


@dataclass
class LaunchStopped(Message):
    """A launch started from the TUI was stopped (or found already gone)."""

    run_dir: Path
