"""From the editor's text to a plan, by the CLI's own path (`load_profile_text`, then `resolve_loaded`),
with the problems kept instead of raised, and the machine probe run once per session."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..plan.from_profile import Resolved, resolve_loaded
from ..profile.load import load_profile_text
from ..schema.errors import Problem, ProfileError


@dataclass(frozen=True)
class Outcome:
    """The last resolution of the editor's text."""

    resolved: Resolved | None
    problems: tuple[Problem, ...] = ()


class ProbeOnce:
    """The machine probe, run at most once per session: a profile with ``machine.probe = true`` is resolved
    on every edit, and nvidia-smi can take seconds. Its failure is remembered too."""

    def __init__(self, probe: Callable[[], str]) -> None:
        self.probe = probe
        self.calls = 0
        self._answer: str | None = None
        self._error: Exception | None = None

    def __call__(self) -> str:
        if self._answer is None and self._error is None:
            self.calls += 1
            try:
                self._answer = self.probe()
            except (OSError, subprocess.SubprocessError) as exc:
                self._error = exc
        if self._error is not None:
            raise self._error
        assert self._answer is not None
        return self._answer


def resolve_editor_text(text: str, path: Path, probe: Callable[[], str], strict: bool) -> Outcome:
    """The CLI's path from text to plan, with the problems kept instead of raised."""
    try:
        loaded = load_profile_text(text, path.as_posix())
        return Outcome(resolve_loaded(loaded, strict=strict, probe=probe))
    except ProfileError as exc:
        return Outcome(None, tuple(exc.problems))
