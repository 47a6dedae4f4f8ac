"""The arms `strata bench` compares: each a set of ``--set`` overrides of one profile, and whether the
resolved plan really runs as the arm's name says (a rule may have changed it)."""

from __future__ import annotations

from typing import Any

from ..schema.plan import LaunchPlan

ARMS: dict[str, tuple[tuple[str, Any], ...]] = {
    "serial": (("batch.groups", 1), ("batch.mtp", False)),
    "pipelined": (("batch.groups", "auto"), ("batch.mtp", False)),
    "batch-mtp": (("batch.groups", 1), ("batch.mtp", True)),
    "solo": (("batch.slots", 1), ("batch.mtp", False)),
    "pipelined-mtp": (("batch.groups", "auto"), ("batch.mtp", True), ("batch.mtp_in_groups", True)),
    "solo-adaptive": (("batch.slots", 1), ("batch.mtp", False), ("spec.adaptive_depth", True)),
    "solo-fixed": (("batch.slots", 1), ("batch.mtp", False), ("spec.adaptive_depth", False)),
}
"""Each arm as ``--set`` overrides of the profile."""
DEFAULT_ARMS = ("serial", "pipelined", "batch-mtp", "solo")
"""The arms a bench runs when none are named (``pipelined-mtp``, ``solo-adaptive`` and ``solo-fixed`` are
opt-in: ``solo`` follows the profile's ``spec.adaptive_depth``, and these two set it)."""
SEEDED_NOTE = (
    "sampled bench requests are seeded, and a seeded sampled request drafts every proposal: as solo-fixed "
    "(--unseeded sends them without a seed)"
)
"""Why ``solo-adaptive`` runs as ``solo-fixed`` on a sampled workload with seeds."""


def arm_runs_as_named(name: str, plan: LaunchPlan) -> bool:
    """Whether the resolved plan really is the arm its name says."""
    b = plan.batch
    return {
        "serial": b.groups == 1 and not b.mtp,
        "pipelined": b.groups > 1,
        "batch-mtp": b.mtp,
        "solo": b.slots <= 1,
        "pipelined-mtp": b.mode == "pipelined" and b.groups > 1 and b.mtp,
        "solo-adaptive": b.slots <= 1 and plan.spec.drafts and plan.spec.adaptive_depth,
        "solo-fixed": b.slots <= 1 and not plan.spec.adaptive_depth,
    }[name]


def arm_note(name: str, plan: LaunchPlan) -> str | None:
    """Why an arm does not run as named, from the decisions that changed what it asked for."""
    if arm_runs_as_named(name, plan):
        return None
    keys = {k for k, _ in ARMS[name]}
    why = [d.message for d in plan.decisions if d.key in keys and d.severity != "note" or d.requested]
    b = plan.batch
    runs = f"{b.mode}, {b.groups} group(s), batch MTP {'on' if b.mtp else 'off'}"
    if name == "solo-adaptive" and not plan.spec.drafts:
        runs += ", no drafting"
    return f"forced: runs as {runs}" + (f" ({'; '.join(why)})" if why else "")
