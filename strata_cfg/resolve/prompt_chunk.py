"""Step 7, after the budget: how long a lone prompt's chunks are under an expert cache.

``memory.prefill_chunk_alone`` left unset is the chunk every prompt takes (``memory.prefill_chunk``). Under an
expert cache that is too short: the prefill path's grouped products read each expert a chunk routes to once
for every tile of up to `PREFILL_EXPERT_TILE_ROWS` of the chunk's rows, and an expert held in host memory
crosses the host link at each read, so a prompt read in longer chunks crosses it fewer times (a 4096-token
prompt on a 24 GiB cache: 2,276 tok/s in 4096-row chunks against 1,250 in 512-row ones). The longer chunk's
workspace comes out of the cache's slots, so the rule takes the longest of `CACHED_CHUNKS` that costs each
cached GPU at most 1/`SLOT_SHARE` of its slots and leaves every other stage GPU's experts resident.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..schema.facts import MachineFacts, ModelFacts
from ..schema.plan import GpuPlan
from ..schema.windows import PREFILL_EXPERT_TILE_ROWS
from .budget import PlacedStage, gpu_budgets, stage_gpu_budgets
from .ledger import Ledger
from .placement import Sizing

KEY = "memory.prefill_chunk_alone"
RULE = "memory.prefill-chunk-alone-cached"
CACHED_CHUNKS = (4096, 2048, 1024)
"""Lone-prompt chunks tried under an expert cache, longest first."""
SLOT_SHARE = 32
"""A longer chunk may cost a cached GPU at most 1/SLOT_SHARE of its expert slots."""


def _cached(plan: GpuPlan) -> bool:
    return plan.experts_resident < plan.experts_total


def lone_prompt_chunk(
    model: ModelFacts,
    machine: MachineFacts,
    placed: Sequence[PlacedStage],
    sz: Sizing,
    gpus: list[GpuPlan],
    led: Ledger,
) -> tuple[list[GpuPlan], Sizing]:
    """Resolve an unset ``memory.prefill_chunk_alone`` under an expert cache (GPU backend, serial windows):
    the longest of `CACHED_CHUNKS` past the current chunk whose workspace fits. Returns the budgets and the
    sizing, recomputed where the chunk changed."""
    stage = {g.index: g for g in gpus if g.role == "stage"}
    if (
        led.user_set(KEY)
        or led["machine.backend"] != "cuda"
        or led["batch.groups"] not in (None, 1)
        or not any(_cached(g) for g in stage.values())
    ):
        return gpus, sz
    for rows in CACHED_CHUNKS:
        if rows <= sz.prefill_chunk_alone:
            break
        longer = replace(sz, prefill_chunk_alone=rows)
        trial = stage_gpu_budgets(model, machine, placed, longer, Ledger())
        if trial is None:
            continue
        costs = {i: g.experts_resident - trial[i].experts_resident for i, g in stage.items()}
        keeps = all(_cached(g) or not _cached(trial[i]) for i, g in stage.items())
        if keeps and all(costs[i] * SLOT_SHARE <= g.experts_resident for i, g in stage.items() if _cached(g)):
            budgets = gpu_budgets(model, machine, placed, longer, led)
            assert budgets is not None  # the stage GPUs fit in the trial, and the others do not depend on it
            paid = ", ".join(
                f"{costs[i]} of GPU {i}'s {g.experts_resident} expert slots"
                for i, g in stage.items()
                if _cached(g)
            )
            message = (
                f"under an expert cache a prompt read alone goes in chunks of {rows} rows, not "
                f"{sz.prefill_chunk_alone}: the prefill path reads each expert a chunk routes to once for up "
                f"to {PREFILL_EXPERT_TILE_ROWS} of its rows, and one held in host memory crosses the host "
                f"link at each read, so longer chunks cross it fewer times; their workspace costs {paid}"
            )
            led.resolve_auto(KEY, rows, RULE, message)
            return budgets, longer
    return gpus, sz
