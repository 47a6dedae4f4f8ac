"""Step 8: how slots are scheduled (solo, serial, pipelined; batch MTP) and the bounds on window shapes, from
the row rules in `strata_cfg/schema/windows.py` that the engine schedules with."""

from __future__ import annotations

from ..schema.plan import BatchMode, WindowPlan
from ..schema.windows import (
    BATCH_MTP_ROWS_PER_SLOT,
    BATCH_MTP_SLOTS_PER_WINDOW,
    HANDOFF_ROWS,
    MAX_WINDOW_ROWS,
)
from .ledger import Ledger

INERT = "windows.adaptive-depth-inert"


def batch_shape(led: Ledger) -> tuple[int, int, BatchMode, int, int]:
    """(slots, groups, mode, slots per window, rows per slot).

    Batch MTP in more than one group (``batch.mtp_in_groups``, checked in step 4 to hold at most 4 slots per
    group) is pipelined, each group's window holding its slots' token and proposal rows."""
    slots = max(led["batch.slots"], 1)
    groups = led["batch.groups"] if slots > 1 else 1
    if slots < 2:
        return 1, 1, "solo", 1, 1
    mode: BatchMode = "pipelined" if groups > 1 else "serial"
    if led["batch.mtp"]:
        per_window = min(slots // groups, BATCH_MTP_SLOTS_PER_WINDOW)
        return slots, groups, mode, per_window, BATCH_MTP_ROWS_PER_SLOT
    return slots, groups, mode, min(slots // groups, MAX_WINDOW_ROWS), 1


def resolve_windows(led: Ledger, all_experts_resident: bool) -> WindowPlan:
    """The window bounds of the plan; a note on what more batch-MTP slots than one window holds do: with
    every expert resident, serial windows carry them while more than one window's worth decode (a row
    brings a token there, not a proposal); with experts streaming, they take turns. A note (which strict
    mode refuses) where the profile asks for ``spec.adaptive_depth`` and solo windows do not draft."""
    slots, groups, mode, per_window, rows_per_slot = batch_shape(led)
    draft = led["spec.draft_tokens"]
    solo_rows = min(1 + max(draft - 1, 0), MAX_WINDOW_ROWS)
    if led["batch.mtp"] and groups == 1 and slots > BATCH_MTP_SLOTS_PER_WINDOW:
        per, rows = BATCH_MTP_SLOTS_PER_WINDOW, MAX_WINDOW_ROWS
        led.note(
            "windows.batch-mtp-rotation",
            "batch.slots",
            f"{slots} batch-MTP slots: while more than {per} decode, serial windows carry them all (every "
            f"expert is resident, so a row is worth more as a token than as a proposal); {per} or fewer "
            f"share a batch-MTP window of token and proposal rows"
            if all_experts_resident
            else f"{slots} batch-MTP slots take turns, {per} per window of {rows} rows (token and proposal "
            "each)",
        )
    if solo_rows < 2 and led.user_set("spec.adaptive_depth") and led.get("spec.adaptive_depth", INERT):
        led.note(
            INERT,
            "spec.adaptive_depth",
            "spec.adaptive_depth = true does nothing: solo windows do not draft "
            f"(spec.draft_tokens = {draft})",
            requested=True,
            because=("spec.draft_tokens",),
        )
    batch_rows = solo_rows if mode == "solo" else per_window * rows_per_slot
    return WindowPlan(
        max_rows=MAX_WINDOW_ROWS, handoff_rows=HANDOFF_ROWS, solo_rows=solo_rows, batch_rows=batch_rows
    )


def prefix_reuse_note(led: Ledger) -> None:
    """A note where ``memory.prefix_reuse`` meets calibrated synthetic routing: each request's routing tables
    follow from its whole prompt, so a slot's KV serves again only a request with the same prompt."""
    if led["memory.prefix_reuse"] and led["model.routing"] == "calibrated":
        led.note(
            "windows.prefix-reuse-calibrated",
            "memory.prefix_reuse",
            "memory.prefix_reuse with calibrated routing: a request's routing follows from its whole prompt, "
            "so a slot's kept KV serves only a request with the same prompt",
            because=("model.routing",),
        )
