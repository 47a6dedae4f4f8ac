"""Step 5: overlapped solo windows on a two-stage split; the first failing reason turns them off."""

from __future__ import annotations

from ..schema.facts import ModelFacts
from .defaults import drafts_with_mtp
from .ledger import Ledger
from .topology import Topology, is_test_split


def pipeline_windows_gate(model: ModelFacts, topo: Topology, led: Ledger) -> None:
    """Overlapped solo windows on a two-stage split; the first failing reason turns them off."""
    pw = led["split.pipeline_windows"]
    if not pw:
        return
    reasons = (
        ("pipeline-windows.needs-split", not topo.split, "there is no layer split"),
        ("pipeline-windows.shared-gpu", is_test_split(topo, led), "the split is a single-GPU test split"),
        ("pipeline-windows.two-stages", topo.n_stages != 2, f"the split has {topo.n_stages} stages, not 2"),
        (
            "pipeline-windows.needs-mtp",
            not drafts_with_mtp(model, led),
            "the solo path does not draft with MTP",
        ),
        ("pipeline-windows.batch", led["batch.slots"] >= 2, "batch slots are on"),
        ("pipeline-windows.peer-device", led["experts.peer_device"] is not None, "a peer device is set"),
        ("pipeline-windows.helper-caches", bool(led["experts.helper_devices"]), "helper caches are set"),
    )
    for rule_id, fails, why in reasons:
        led.get("split.pipeline_windows", rule_id)
        if fails:
            led.change("split.pipeline_windows", 0, rule_id, f"pipeline windows are off: {why}")
            return
