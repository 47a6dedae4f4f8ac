"""The plan file: the one place that names, reads and writes ``plan.json``.

The launcher writes a resolved `LaunchPlan` here and the engine process reads it back, so both sides go
through these functions (this module imports only the standard library and the plan model, so the runtime
may use it).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from pydantic import ValidationError

from .plan import LaunchPlan

PLAN_FILE = "plan.json"
"""The name of the plan inside a run directory."""


class PlanFileError(ValueError):
    """A plan file that cannot be read or is not a valid launch plan; the message names the file."""


def read_plan(path: str | os.PathLike[str]) -> LaunchPlan:
    """The launch plan in ``path``; raises `PlanFileError` with one line naming the file and the problem."""
    where = Path(path)
    try:
        raw = where.read_bytes()
    except OSError as exc:
        raise PlanFileError(f"cannot read the plan {where}: {exc.strerror or exc}") from None
    try:
        return LaunchPlan.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        key = ".".join(str(x) for x in first["loc"])
        at = f"{key}: " if key else ""
        raise PlanFileError(f"{where} is not a valid launch plan: {at}{first['msg']}") from None


def write_plan(plan: LaunchPlan, path: str | os.PathLike[str]) -> Path:
    """Write the plan's public JSON to ``path`` (parents created) and return the path.

    The file is written beside its final name and renamed over it, so a reader never sees half a plan.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(plan.to_json(), indent=2) + "\n"
    # A plain open (not mkstemp) so the file gets the usual permissions, like any file the user writes.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out
