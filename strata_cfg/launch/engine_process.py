"""Starting the engine process for a resolved plan: ``python -m strata_runtime CMD --plan plan.json ...``.

strata_cfg never imports strata_runtime; commands that need the engine (generate, bench, serve) resolve the
profile here, write the plan as JSON, and start the runtime as a process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..schema.plan import LaunchPlan
from ..schema.plan_file import PLAN_FILE, write_plan


def runtime_command(
    cmd: str, plan: LaunchPlan, extra_args: Sequence[str] = (), run_dir: str | os.PathLike[str] | None = None
) -> list[str]:
    """Write ``plan.json`` into ``run_dir`` (default: a new temporary directory) and return the command line
    that runs runtime command ``cmd`` on it."""
    directory = (
        Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix=f"strata-{plan.profile}-"))
    )
    plan_path = write_plan(plan, directory / PLAN_FILE)
    return [sys.executable, "-m", "strata_runtime", cmd, "--plan", str(plan_path), *extra_args]


def exec_runtime(
    cmd: str, plan: LaunchPlan, extra_args: Sequence[str] = (), run_dir: str | os.PathLike[str] | None = None
) -> NoReturn:
    """Replace this process with the runtime (signals and the terminal go straight to the engine)."""
    argv = runtime_command(cmd, plan, extra_args, run_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)


def spawn_runtime(
    cmd: str,
    plan: LaunchPlan,
    extra_args: Sequence[str] = (),
    run_dir: str | os.PathLike[str] | None = None,
    **popen: Any,
) -> subprocess.Popen[Any]:
    """Start the runtime as a child process; ``popen`` goes to `subprocess.Popen`."""
    return subprocess.Popen(runtime_command(cmd, plan, extra_args, run_dir), **popen)


def run_runtime(
    cmd: str, plan: LaunchPlan, extra_args: Sequence[str] = (), run_dir: str | os.PathLike[str] | None = None
) -> int:
    """Run the runtime to completion and return its exit code."""
    return subprocess.run(runtime_command(cmd, plan, extra_args, run_dir), check=False).returncode
