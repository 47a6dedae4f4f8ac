"""The engine as a process: ``python -m strata_runtime COMMAND --plan plan.json ...``.

strata_cfg never imports strata_runtime; the commands that need the engine (generate, bench, serve, launch)
write the plan as JSON and start the runtime as a process. `runtime_argv` is the one place that spells the
runtime's command line. Also what a supervisor needs to know about an engine process: that it dies with its
parent, why it exited, and the tail of its log.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from ..schema.plan import LaunchPlan
from ..schema.plan_file import PLAN_FILE, write_plan

RUNTIME_MODULE = "strata_runtime"
"""The engine's package, run with ``python -m``."""


def runtime_argv(command: str, *args: str, plan_file: str | os.PathLike[str] | None = None) -> list[str]:
    """``python -m strata_runtime COMMAND [--plan FILE] ARGS...``, with this interpreter."""
    argv = [sys.executable, "-m", RUNTIME_MODULE, command]
    if plan_file is not None:
        argv += ["--plan", os.fspath(plan_file)]
    return argv + list(args)


def engine_command(plan_file: Path, engine_id: str | None = None) -> list[str]:
    """The serving engine of a run directory's plan (what the supervisor starts), answering ``/health``
    with ``engine_id`` when given."""
    return runtime_argv("serve", *(["--engine-id", engine_id] if engine_id else []), plan_file=plan_file)


def runtime_command(
    cmd: str, plan: LaunchPlan, extra_args: Sequence[str] = (), run_dir: str | os.PathLike[str] | None = None
) -> list[str]:
    """Write ``plan.json`` into ``run_dir`` (default: a new temporary directory) and return the command line
    that runs runtime command ``cmd`` on it."""
    directory = (
        Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix=f"strata-{plan.profile}-"))
    )
    plan_path = write_plan(plan, directory / PLAN_FILE)
    return runtime_argv(cmd, *extra_args, plan_file=plan_path)


def exec_runtime(
    cmd: str, plan: LaunchPlan, extra_args: Sequence[str] = (), run_dir: str | os.PathLike[str] | None = None
) -> NoReturn:
    """Replace this process with the runtime (signals and the terminal go straight to the engine)."""
    exec_argv(runtime_command(cmd, plan, extra_args, run_dir))


def exec_argv(argv: list[str]) -> NoReturn:
    """Replace this process with ``argv`` (a runtime command line, `runtime_argv`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)


def die_with_parent(parent: int) -> Callable[[], None]:
    """A preexec hook: the child gets SIGTERM when ``parent`` dies (Linux), so it is never orphaned."""

    def hook() -> None:
        if sys.platform.startswith("linux"):
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the hook ran
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


def exit_reason(code: int) -> str:
    """How a process ended, in words: ``exited with code 1``, ``was killed by SIGKILL``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


TAIL_BLOCK = 64 << 10
"""Bytes `log_tail` reads at a time, from the end back."""


def log_tail(path: Path, start: int = 0, lines: int = 15) -> list[str]:
    """The last ``lines`` lines of ``path`` written after byte offset ``start`` (``lines`` 0: all of them).
    It reads back from the end only as far as they need, so a long-running engine's log costs the TUI's
    polls and `strata logs` its last lines, not the whole file."""
    try:
        with path.open("rb") as f:
            pos = f.seek(0, os.SEEK_END)
            data = b""
            # More than `lines` newlines: the partial line the read may start in is not among the last.
            while pos > start and (lines <= 0 or data.count(b"\n") <= lines):
                step = min(TAIL_BLOCK, pos - start)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-lines:]
