"""Steps 2 and 3: the batch gate (how many slots may batch) and the batch-MTP gate (the reasons batch MTP
cannot run that do not depend on groups; the first failing one turns it off)."""

from __future__ import annotations

from ..schema.facts import ModelFacts
from .gate import Reason, first_failing
from .ledger import Ledger
from .topology import Topology, is_test_split

MAX_PLAIN_SLOTS = 8


def batch_gate(topo: Topology, led: Ledger) -> None:
    """Batching needs two slots and real GPUs per stage; plain batching is bounded by the window."""
    rid = "batch.single-slot"
    slots = led.get("batch.slots", rid)
    if slots < 2 and led.user_set("batch.slots"):
        led.note(rid, "batch.slots", f"batch.slots = {slots}: no batching, one request at a time")
    if slots >= 2 and is_test_split(topo, led):
        led.change(
            "batch.slots",
            1,
            "batch.test-split",
            "batching is off: a single-GPU test split runs one request at a time",
            because=("split.test_shared_gpu",),
        )
        slots = 1
    if slots > MAX_PLAIN_SLOTS and not led.get("batch.mtp", "batch.max-slots"):
        led.change(
            "batch.slots",
            MAX_PLAIN_SLOTS,
            "batch.max-slots",
            f"{slots} slots without batch MTP: clamped to {MAX_PLAIN_SLOTS}, the rows one window holds",
        )


def batch_mtp_reasons(model: ModelFacts, topo: Topology, led: Ledger, *, serving: bool) -> tuple[Reason, ...]:
    """Why batch MTP cannot run, for reasons that do not depend on groups, in the order they are checked."""
    slots = led["batch.slots"]
    draft = led["spec.draft_tokens"]
    return (
        Reason(
            "batch-mtp.needs-batching",
            slots < 2,
            f"batch MTP is off: batching is off ({slots} slot)",
            ("batch.slots",),
        ),
        Reason(
            "batch-mtp.needs-mtp-weights",
            not model.has_mtp,
            f"batch MTP is off: {model.source} has no MTP weights",
            ("model.path",) if led.user_set("model.path") else ("model.synthetic",),
        ),
        Reason(
            "batch-mtp.spec-ngram",
            led["spec.method"] == "ngram",
            'batch MTP is off: spec.method = "ngram" proposes from the text; batch MTP drafts with the MTP '
            "head",
            ("spec.method",),
        ),
        Reason(
            "batch-mtp.needs-spec",
            draft < 2,
            f"batch MTP is off: spec.draft_tokens = {draft} turns MTP drafting off",
            ("spec.draft_tokens",),
        ),
        Reason(
            "batch-mtp.shared-gpu",
            topo.shared_gpu,
            "batch MTP is off: two stages share one GPU",
            ("split.devices",),
        ),
        Reason("batch-mtp.needs-serve", not serving, "batch MTP is off: the profile has no [serve] table"),
        Reason(
            "batch-mtp.helper-caches",
            topo.split and bool(led["experts.helper_devices"]),
            "batch MTP is off: on a split it does not combine with helper-GPU expert caches",
            ("experts.helper_devices",),
        ),
        Reason(
            "batch-mtp.remote-opt",
            topo.split and bool(led["experts.remote_opt"]),
            "batch MTP is off: on a split it does not combine with remote expert opt",
            ("experts.remote_opt",),
        ),
    )


def batch_mtp_gate(model: ModelFacts, topo: Topology, led: Ledger, *, serving: bool) -> None:
    """Reasons batch MTP cannot run that do not depend on groups; the first failing one turns it off."""
    if led["batch.mtp"]:
        first_failing(led, "batch.mtp", False, batch_mtp_reasons(model, topo, led, serving=serving))
