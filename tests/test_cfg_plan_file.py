"""The plan file: one name, one reader that names the file on every error, one atomic writer."""

from __future__ import annotations

import json
import os

import pytest

from strata_cfg.schema.plan_file import PLAN_FILE, PlanFileError, read_plan, write_plan
from strata_cfg.runner import resolve_profile


@pytest.fixture(scope="module")
def plan():
    return resolve_profile(None)


def test_a_written_plan_reads_back_equal(tmp_path, plan):
    path = write_plan(plan, tmp_path / "deep" / "run" / PLAN_FILE)
    assert path == tmp_path / "deep" / "run" / "plan.json"
    assert json.loads(path.read_text()) == plan.to_json()
    assert read_plan(path) == plan
    # Nothing but the plan is left beside it (the temporary file was renamed over the final name).
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]


def test_rewriting_replaces_the_file_whole(tmp_path, plan):
    path = tmp_path / PLAN_FILE
    path.write_text("x" * 100_000)
    write_plan(plan, path)
    assert read_plan(path) == plan


def test_a_failed_write_leaves_the_old_plan_and_no_stray_file(tmp_path, plan, monkeypatch):
    path = write_plan(plan, tmp_path / PLAN_FILE)
    before = path.read_bytes()

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        write_plan(plan.model_copy(update={"profile": "other"}), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_a_missing_plan_names_the_file(tmp_path):
    missing = tmp_path / "nowhere" / PLAN_FILE
    with pytest.raises(PlanFileError) as err:
        read_plan(missing)
    assert str(err.value) == f"cannot read the plan {missing}: No such file or directory"


def test_an_invalid_plan_names_the_file_and_the_field(tmp_path, plan):
    data = plan.to_json()
    data["batch"]["slots"] = "many"
    path = tmp_path / PLAN_FILE
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError) as err:
        read_plan(path)
    message = str(err.value)
    assert message.startswith(f"{path} is not a valid launch plan: batch.slots: ")
    assert "\n" not in message


def test_a_plan_that_is_not_json_names_the_file(tmp_path):
    path = tmp_path / PLAN_FILE
    path.write_text("{ not json")
    with pytest.raises(PlanFileError, match=f"^{path} is not a valid launch plan: "):
        read_plan(path)
    assert issubclass(PlanFileError, ValueError)
