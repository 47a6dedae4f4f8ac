"""Helpers for the configuration tests: resolve fixture profiles by name, find decisions and problems."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from strata_cfg.plan.from_profile import Resolved, resolve_loaded
from strata_cfg.profile.load import load
from strata_cfg.schema.errors import Problem, ProfileError
from strata_cfg.schema.facts import ModelFacts
from strata_cfg.schema.plan import Decision, LaunchPlan
from strata_cfg.schema.presets import preset_config

HERE = Path(__file__).parent
FIXTURES = HERE / "profiles"
RULES_DIR = FIXTURES / "rules"
BAD_DIR = FIXTURES / "bad"
REPO = HERE.parent
PROFILES = REPO / "profiles"


def preset_facts(name: str) -> ModelFacts:
    """The facts of synthetic preset ``name`` in float16."""
    return ModelFacts.from_config(preset_config(name), source=f"synthetic:{name}", dtype="float16")


def no_probe() -> str:
    raise OSError("no probe in this test")


def no_meminfo() -> str:
    """The tests never read this machine's /proc/meminfo: a probed host memory is unknown unless given."""
    raise OSError("no /proc/meminfo in this test")


def resolve_file(
    path: Path | str, sets=(), *, strict: bool = False, probe=no_probe, meminfo=no_meminfo
) -> Resolved:
    return resolve_loaded(load(path, sets), strict=strict, probe=probe, meminfo=meminfo)


def plan_of(
    path: Path | str, sets=(), *, strict: bool = False, probe=no_probe, meminfo=no_meminfo
) -> LaunchPlan:
    return resolve_file(path, sets, strict=strict, probe=probe, meminfo=meminfo).plan


def problems_of(
    path: Path | str, sets=(), *, strict: bool = False, probe=no_probe, meminfo=no_meminfo
) -> list[Problem]:
    with pytest.raises(ProfileError) as err:
        resolve_file(path, sets, strict=strict, probe=probe, meminfo=meminfo)
    assert err.value.problems, "a ProfileError must carry at least one problem"
    return err.value.problems


def decision(plan: LaunchPlan, rule: str) -> Decision:
    found = [d for d in plan.decisions if d.rule == rule]
    assert len(found) >= 1, f"{rule} did not fire; fired: {[d.rule for d in plan.decisions]}"
    return found[0]


def problem(problems: list[Problem], rule: str) -> Problem:
    found = [p for p in problems if p.rule == rule]
    assert found, f"{rule} did not refuse; problems: {[str(p) for p in problems]}"
    return found[0]


def line_of(path: Path, text: str) -> int:
    """1-based line of the first line of ``path`` that contains ``text`` (so tests don't hard-code lines)."""
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if text in line:
            return n
    raise AssertionError(f"{text!r} not in {path}")


def raised_within(seconds: float, fn: Callable[[], object]) -> BaseException | None:
    """What ``fn`` raised, run on a daemon thread; fails the test if it has not returned within ``seconds``
    (for reads that could block for ever, such as opening a FIFO)."""
    raised: list[BaseException] = []

    def call() -> None:
        try:
            fn()
        except BaseException as exc:  # handed back to the test to judge
            raised.append(exc)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(timeout=seconds)
    assert not worker.is_alive(), f"still blocked after {seconds} s"
    return raised[0] if raised else None
