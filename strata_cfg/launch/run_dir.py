"""The run directory: everything about one launch in one folder.

``plan.json`` (what runs), ``engine.log`` (the engine's output, appended across restarts), ``launch.pid``
(the supervisor, while it runs), ``engine.pid`` (the current engine process), ``engine.id`` (the id the
run's engine answers ``/health`` with) and, for a detached launch, ``launch.log`` (the supervisor's own
output). Also how to find the runs under ``runs/`` and whether their supervisor still lives.

The logs are private to their owner (0600): an engine's log can hold what clients sent it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..schema.plan import LaunchPlan
from ..schema.plan_file import PLAN_FILE, PlanFileError, read_plan

ENGINE_LOG = "engine.log"
LAUNCH_LOG = "launch.log"
LAUNCH_PID = "launch.pid"
ENGINE_PID = "engine.pid"
ENGINE_ID = "engine.id"
ENGINE_START_MARK = b"--- strata launch: engine start "
"""How each start of the engine begins in ``engine.log``: the mark, then the start's number, when and the
command."""
LOG_MODE = 0o600
"""Logs are read and written by their owner only."""
RUNS_ROOT = Path("runs")
"""Where run directories go by default, relative to the working directory."""


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def plan(self) -> Path:
        return self.path / PLAN_FILE

    @property
    def engine_log(self) -> Path:
        return self.path / ENGINE_LOG

    @property
    def launch_log(self) -> Path:
        return self.path / LAUNCH_LOG

    @property
    def launch_pid(self) -> Path:
        return self.path / LAUNCH_PID

    @property
    def engine_pid(self) -> Path:
        return self.path / ENGINE_PID

    @property
    def engine_id_file(self) -> Path:
        return self.path / ENGINE_ID

    def engine_id(self) -> str:
        """The id this run's engine reports in ``/health``: made once per run directory, by the first to ask
        (the launcher, before it starts anything), and read by every later start."""
        try:
            made = self.engine_id_file.read_text().strip()
        except FileNotFoundError:
            made = ""
        if made:
            return made
        made = secrets.token_hex(8)
        tmp = self.engine_id_file.with_name(f".{ENGINE_ID}.{os.getpid()}")
        tmp.write_text(f"{made}\n")
        tmp.replace(self.engine_id_file)  # whole or absent, never half written
        return made

    def load_plan(self) -> LaunchPlan:
        return read_plan(self.plan)


def open_log(path: Path) -> BinaryIO:
    """``path`` opened for appending, created private (`LOG_MODE`), and made private if it was not."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, LOG_MODE)
    os.fchmod(fd, LOG_MODE)
    return os.fdopen(fd, "ab")


def new_run_dir(profile: str, root: Path = RUNS_ROOT, now: float | None = None) -> Path:
    """``root/<profile>-<YYYYmmdd-HHMMSS>``, with a suffix when that already exists."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    base = root / f"{_safe(profile)}-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "profile"


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive; /proc tells, where there is one.
    with contextlib.suppress(OSError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0] != "Z"
    return True


def live_supervisor(run: RunDir) -> int | None:
    """The pid of the supervisor of ``run`` when it is still running, else None."""
    pid = read_pid(run.launch_pid)
    if pid is None or not pid_alive(pid):
        return None
    with contextlib.suppress(OSError):  # a recycled pid that is no strata process is not ours
        if b"strata" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return None
    return pid


def find_runs(root: Path = RUNS_ROOT) -> list[RunDir]:
    """Run directories under ``root``, most recent first."""
    if not root.is_dir():
        return []
    runs = [RunDir(p) for p in root.iterdir() if (p / PLAN_FILE).is_file()]
    return sorted(runs, key=lambda r: r.plan.stat().st_mtime, reverse=True)


def run_profile_name(run: RunDir) -> str | None:
    """The profile a run directory's plan was resolved from; None when its plan cannot be read."""
    try:
        return run.load_plan().profile
    except PlanFileError:
        return None


def profile_name(target: str) -> str:
    """The profile a command's target names: a profile file's stem, or the name itself."""
    path = Path(target)
    return path.stem if path.suffix == ".toml" else target


def launches_of(target: str | None, root: Path = RUNS_ROOT) -> tuple[list[RunDir], str]:
    """The run directories a command's ``target`` names, most recent first: the run directory itself, the
    launches under ``root`` of the profile it names (by name or file), or, without one, every launch under
    ``root``. None: [] and one sentence saying why."""
    if target is not None and (Path(target) / PLAN_FILE).is_file():
        return [RunDir(Path(target))], ""
    runs = find_runs(root)
    if target is None:
        return runs, "" if runs else f"no launch under {root}/"
    name = profile_name(target)
    runs = [r for r in runs if run_profile_name(r) == name or r.path.name.startswith(f"{name}-")]
    return runs, "" if runs else f"no launch of profile `{name}` under {root}/"
