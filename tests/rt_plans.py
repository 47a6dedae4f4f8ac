"""Launch plans for runtime tests, built directly with the plan schema.

Runtime tests need plans whose shape they control exactly (stages, slots, groups, drafting) on virtual CPU
devices; these helpers build them. The budget figures are placeholders: the runtime does not read them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from strata_cfg.schema.facts import GpuFacts, MachineFacts, ModelFacts
from strata_cfg.schema.plan import (
    BatchPlan,
    Budget,
    ExpertsPlan,
    GpuPlan,
    LaunchPlan,
    MemoryPlan,
    ModelPlan,
    ServePlan,
    SpecPlan,
    StagePlan,
    WindowPlan,
)
from strata_cfg.schema.presets import preset_config
from strata_cfg.schema.windows import BATCH_MTP_ROWS_PER_SLOT, BATCH_MTP_SLOTS_PER_WINDOW, MAX_WINDOW_ROWS


def even_split(n_layers: int, n_stages: int) -> list[int]:
    """First layer of each later stage for an even split."""
    return [round(n_layers * i / n_stages) for i in range(1, n_stages)]


def make_plan(
    *,
    preset: str | None = "tiny",
    model_dir: str | Path | None = None,
    stages: int = 1,
    boundaries: list[int] | None = None,
    slots: int = 1,
    groups: int = 1,
    batch_mtp: bool = False,
    draft_tokens: int = 0,
    context: int = 256,
    prefill_chunk: int = 64,
    seed: int = 0,
    layer_scale: float | None = None,
    backend: str = "cpu",
    dtype: str = "float32",
    serve: bool = False,
    **experts: Any,
) -> LaunchPlan:
    """A plan for a synthetic preset (default) or a model directory, split evenly over ``stages`` devices."""
    if model_dir is not None:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        source, preset = str(model_dir), None
    else:
        assert preset is not None
        config, source = preset_config(preset), f"synthetic:{preset}"
    facts = ModelFacts.from_config(config, source=source, dtype=dtype)
    n = facts.num_hidden_layers
    cuts = [0, *(boundaries if boundaries is not None else even_split(n, stages)), n]
    machine = MachineFacts(
        backend=backend,  # type: ignore[arg-type]
        gpus=tuple(
            GpuFacts(index=i, name=f"virtual {i}", vram_mib=4096, bandwidth_gbs=100.0) for i in range(stages)
        ),
    )
    slots_eff = max(slots, 1)
    mode = "solo" if slots_eff == 1 else ("pipelined" if groups > 1 else "serial")
    drafting = draft_tokens >= 2 or batch_mtp
    stage_plans = []
    for i in range(stages):
        last = i == stages - 1
        holds = (("embedding",) if i == 0 else ()) + (("final_norm", "lm_head") if last else ())
        if last and drafting:
            holds += ("mtp", "drafters")
        stage_plans.append(
            StagePlan(
                index=i,
                gpu=i,
                device=f"{backend}:{i}",
                layers=(cuts[i], cuts[i + 1]),
                holds=holds,
                drafters=tuple(range(slots_eff)) if last and drafting else (),
            )
        )
    budget = Budget(total=4096 << 20, weights=0, kv=0, drafters=0, workspace=0, reserve=0, experts=0, free=0)
    gpus = tuple(
        GpuPlan(
            index=i, device=f"{backend}:{i}", name=f"virtual {i}", role="stage", stages=(i,), budget=budget
        )
        for i in range(stages)
    )
    return LaunchPlan(
        profile="test",
        machine=machine,
        model=ModelPlan(
            path=None if model_dir is None else str(model_dir),
            synthetic=preset,
            seed=seed,
            layer_scale=layer_scale,
            facts=facts,
        ),
        stages=tuple(stage_plans),
        gpus=gpus,
        batch=BatchPlan(
            slots=slots_eff,
            groups=groups,
            mode=mode,  # type: ignore[arg-type]
            mtp=batch_mtp,
            slots_per_window=BATCH_MTP_SLOTS_PER_WINDOW if batch_mtp else min(slots_eff, MAX_WINDOW_ROWS),
            rows_per_slot=BATCH_MTP_ROWS_PER_SLOT if batch_mtp else 1,
        ),
        spec=SpecPlan(draft_tokens=draft_tokens, mtp=draft_tokens >= 2, pipeline_windows=0),
        memory=MemoryPlan(
            context=context,
            kv_dtype=dtype,  # type: ignore[arg-type]
            prefill_chunk=prefill_chunk,
            vram_reserve_mib=0,
            vram_reserve_later_mib=0,
        ),
        experts=ExpertsPlan(cache=None, **experts),
        windows=WindowPlan(
            max_rows=MAX_WINDOW_ROWS,
            handoff_rows=MAX_WINDOW_ROWS,
            solo_rows=max(draft_tokens, 1),
            batch_rows=MAX_WINDOW_ROWS,
        ),
        serve=ServePlan(host="127.0.0.1", port=8000, api_key_env=None, model_name="test") if serve else None,
        decisions=(),
        settings={},
    )
