"""Step 7, after the budget: which LM head the MTP head drafts through (``spec.draft_head = "auto"``).

An 8-bit copy of the LM head (``"int8"``) halves the bytes of most of a draft step (on the 30B preset, 622
of a step's 752 MB are the head), and costs V x H bytes on the last stage's GPU. Where every expert is
resident those bytes are free VRAM and the copy pays: one stream ran 4.0% faster on one H100. Under an
expert cache they would hold experts instead, whose misses cross the host link; so ``auto`` takes the copy
only on GPUs, only where the MTP head drafts, and only where the copy leaves every stage GPU that held all
of its experts holding them and the last stage's GPU holds all of its own. The rule's note says which, and
why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..schema.facts import MachineFacts, ModelFacts
from ..schema.plan import MIB, GpuPlan
from .budget import PlacedStage, gpu_budgets, stage_gpu_budgets
from .ledger import Ledger
from .placement import Sizing

KEY = "spec.draft_head"
RULE = "spec.draft-head-auto"


def draft_head_auto(
    model: ModelFacts,
    machine: MachineFacts,
    placed: Sequence[PlacedStage],
    sz: Sizing,
    gpus: list[GpuPlan],
    led: Ledger,
) -> tuple[list[GpuPlan], Sizing]:
    """Resolve ``spec.draft_head = "auto"``: ``"int8"`` where the copy fits beside every expert it would
    otherwise displace (see the module), else ``"shared"``. Returns the budgets and the sizing, recomputed
    where the copy is taken."""
    if led[KEY] != "auto":
        return gpus, sz
    # Without a note: the MTP head does not draft, or virtual CPU devices, whose float32 head costs less than
    # widening 8-bit rows.
    if not sz.with_mtp or led["machine.backend"] != "cuda":
        led.resolve_auto(KEY, "shared", RULE)
        return gpus, sz
    mib = model.int8_head_bytes() / MIB
    stage = {g.index: g for g in gpus if g.role == "stage"}
    last = placed[-1].gpu
    trial = stage_gpu_budgets(model, machine, placed, replace(sz, int8_draft_head=True), Ledger())
    if (
        trial is None
        or not trial[last].all_experts_resident
        or any(g.all_experts_resident and not trial[i].all_experts_resident for i, g in stage.items())
    ):
        held = (
            "" if trial is None else f" ({stage[last].experts_resident - trial[last].experts_resident} fewer)"
        )
        led.resolve_auto(
            KEY,
            "shared",
            RULE,
            f"the MTP head drafts through the model's own LM head: an 8-bit copy ({mib:,.1f} MiB on GPU "
            f"{last}) would take VRAM that holds routed experts{held}, whose misses cross the host link",
        )
        return gpus, sz
    taken = replace(sz, int8_draft_head=True)
    budgets = gpu_budgets(model, machine, placed, taken, led)
    assert budgets is not None  # the stage GPUs fit in the trial, and the others do not depend on it
    led.resolve_auto(
        KEY,
        "int8",
        RULE,
        f"the MTP head drafts through an 8-bit copy of the LM head ({mib:,.1f} MiB on GPU {last}, which "
        "holds every expert with it): half the bytes of most of a draft step; the model verifies with its "
        "own",
    )
    return budgets, taken
