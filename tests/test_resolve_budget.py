"""The VRAM budget counts what the engine really allocates: built on virtual CPU devices (float32), every
stage's weights and experts, its KV, and the last stage's drafters match the plan's budget to the byte."""

from __future__ import annotations

import pytest
from cfg_fixtures import RULES_DIR, plan_of

from strata_runtime.model import Model

CASES = {
    "demo: 2 stages, 2 slots, batch MTP": (None, []),
    "no drafting: no MTP head, no drafters": (None, ["batch.mtp=false", "spec.draft_tokens=0"]),
    "solo with spec: one drafter": (None, ["batch.slots=1", "batch.mtp=false"]),
    "3 stages, 3 slots, longer context": (
        RULES_DIR / "pipeline-windows.two-stages.toml",
        ["split.pipeline_windows=0", "batch.slots=3", "memory.context=300"],
    ),
    "small preset: dense and MoE layers, shared expert": (
        RULES_DIR / "split.auto.toml",
        ["memory.context=128", "batch.slots=2"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_budget_matches_what_the_engine_allocates(case):
    path, sets = CASES[case]
    plan = plan_of(path, sets)
    assert all(g.experts_resident == g.experts_total for g in plan.gpus)
    model = Model.from_plan(plan)
    by_gpu = {g.index: g.budget for g in plan.gpus}
    for stage, sp in zip(model.stages, plan.stages, strict=True):
        budget = by_gpu[sp.gpu]
        assert stage.weight_bytes == budget.weights + budget.experts, f"stage {sp.index} weights"
        assert stage.kv.nbytes == budget.kv, f"stage {sp.index} KV"
    drafters = sum(d.nbytes for d in model.drafters.values())
    assert drafters == by_gpu[plan.stages[-1].gpu].drafters
    assert sorted(model.drafters) == list(plan.stages[-1].drafters)
