"""Step 5: overlapped solo windows on a two-stage split; the first failing reason turns them off."""

from __future__ import annotations

from ..schema.facts import ModelFacts
from .defaults import drafts_by_lookup, drafts_with_mtp
from .gate import Reason, first_failing
from .ledger import Ledger
from .topology import Topology, is_test_split


def pipeline_windows_gate(model: ModelFacts, topo: Topology, led: Ledger) -> None:
    """Overlapped solo windows on a two-stage split; the first failing reason turns them off."""
    if not led["split.pipeline_windows"]:
        return
    layers = ("split.layers",)
    lookup = drafts_by_lookup(led)
    reasons = (
        ("pipeline-windows.needs-split", not topo.split, "there is no layer split", layers),
        (
            "pipeline-windows.shared-gpu",
            is_test_split(topo, led),
            "the split is a single-GPU test split",
            ("split.test_shared_gpu",),
        ),
        (
            "pipeline-windows.two-stages",
            topo.n_stages != 2,
            f"the split has {topo.n_stages} stages, not 2",
            layers,
        ),
        (
            "pipeline-windows.needs-mtp",
            not drafts_with_mtp(model, led),
            'the solo path drafts by n-gram lookup (spec.method = "ngram"), not with MTP'
            if lookup
            else "the solo path does not draft with MTP",
            ("spec.method",) if lookup else ("spec.draft_tokens",),
        ),
        ("pipeline-windows.batch", led["batch.slots"] >= 2, "batch slots are on", ("batch.slots",)),
        (
            "pipeline-windows.peer-device",
            led["experts.peer_device"] is not None,
            "a peer device is set",
            ("experts.peer_device",),
        ),
        (
            "pipeline-windows.helper-caches",
            bool(led["experts.helper_devices"]),
            "helper caches are set",
            ("experts.helper_devices",),
        ),
    )
    first_failing(
        led,
        "split.pipeline_windows",
        0,
        (
            Reason(rule, fails, f"pipeline windows are off: {why}", because)
            for rule, fails, why, because in reasons
        ),
    )
