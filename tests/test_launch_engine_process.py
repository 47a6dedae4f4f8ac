"""Reaching the engine as a process: the plan file and the command line."""

from __future__ import annotations

import json
import sys

from strata_cfg.launch.engine_process import runtime_command
from strata_cfg.plan.from_profile import resolve_profile
from strata_cfg.schema.plan import LaunchPlan


def test_runtime_command_writes_the_plan_and_names_it(tmp_path):
    plan = resolve_profile(None)
    argv = runtime_command("generate", plan, ["--prompt", "hi"], run_dir=tmp_path / "run")
    assert argv[:4] == [sys.executable, "-m", "strata_runtime", "generate"]
    assert argv[4] == "--plan" and argv[6:] == ["--prompt", "hi"]
    written = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert LaunchPlan.model_validate(written) == plan


def test_default_run_dir_is_fresh(tmp_path):
    plan = resolve_profile(None)
    a = runtime_command("bench", plan)
    b = runtime_command("bench", plan)
    assert a[5] != b[5]
