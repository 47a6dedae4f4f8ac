"""What this runtime does not implement, named, so that a plan needing it is refused at start.

The resolver already keeps plans consistent (its rules are in `strata_cfg.resolve`); this list is only what
a valid plan may ask for and this engine cannot do yet. Each entry names the plan field and the missing
feature, so that the refusal reads as "not implemented", never as "your plan is wrong".
"""

from __future__ import annotations

from strata_cfg.schema.plan import LaunchPlan
from strata_cfg.schema.windows import BATCH_MTP_ROWS_PER_SLOT, BATCH_MTP_SLOTS_PER_WINDOW, MAX_WINDOW_ROWS


def refusals(plan: LaunchPlan) -> list[str]:
    """Everything in ``plan`` this runtime does not implement (empty: it can run the plan as written)."""
    out = []
    if plan.experts.remote_opt:
        out.append("experts.remote_opt = true: remote expert optimisation is not implemented")
    for s in plan.stages:
        if s.host != "local":
            out.append(f"stage {s.index} is on host {s.host!r}: only local stages are implemented")
        if s.drafters and s.index != len(plan.stages) - 1:
            out.append(f"stage {s.index} holds drafters: drafters are implemented only on the last stage")
    if plan.spec.pipeline_windows:
        out.append(
            f"split.pipeline_windows = {plan.spec.pipeline_windows}: "
            "overlapped solo windows are not implemented"
        )
    if plan.batch.mtp and (
        plan.batch.rows_per_slot != BATCH_MTP_ROWS_PER_SLOT
        or plan.batch.slots_per_window > BATCH_MTP_SLOTS_PER_WINDOW
    ):
        out.append(
            f"batch MTP windows of {plan.batch.rows_per_slot} rows per slot and "
            f"{plan.batch.slots_per_window} slots: only {BATCH_MTP_ROWS_PER_SLOT} rows per slot and at most "
            f"{BATCH_MTP_SLOTS_PER_WINDOW} slots are implemented"
        )
    if plan.windows.max_rows > MAX_WINDOW_ROWS or plan.windows.handoff_rows > MAX_WINDOW_ROWS:
        out.append(f"windows of more than {MAX_WINDOW_ROWS} rows are not implemented")
    return out
