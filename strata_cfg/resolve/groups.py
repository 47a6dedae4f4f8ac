"""Step 4: slot groups, resolved as a pure function of slots, stages and batch MTP, then the gate that
depends on them (batch MTP does not run in pipelined groups)."""

from __future__ import annotations

from .gate import Reason, first_failing
from .ledger import Ledger
from .topology import Topology, count


def auto_groups(slots: int, stages: int) -> int:
    """The largest d <= stages such that slots % d == 0."""
    return max(d for d in range(1, max(stages, 1) + 1) if slots % d == 0)


def resolve_groups(topo: Topology, led: Ledger) -> None:
    """Groups resolved as a pure function of slots, stages and batch MTP, then the group-dependent gate."""
    asked = led.asked("batch.groups")
    slots = max(led.get("batch.slots", "groups.auto"), 1)
    stages = topo.n_stages
    defaulted = asked is None and topo.split and slots > 1
    if asked == "auto" or defaulted:
        groups = auto_groups(slots, stages)
        if defaulted and led.get("batch.mtp", "groups.batch-mtp-yield"):
            tail = (
                f", and batch.groups = {groups} would pipeline them and turn batch MTP off"
                if groups > 1
                else ""
            )
            led.change(
                "batch.groups",
                1,
                "groups.batch-mtp-yield",
                f"one group of {slots} slots, because batch MTP does not run in pipelined groups{tail}",
                because=("batch.mtp",),
            )
        else:
            why = 'batch.groups = "auto"' if asked == "auto" else "batch.groups unset"
            led.resolve_auto(
                "batch.groups",
                groups,
                "groups.auto",
                f"{why}: {count(groups, 'group')} of {count(slots // groups, 'slot')} (the largest divisor "
                f"of {slots} slots that is at most {count(stages, 'stage')})",
            )
    elif asked is None:
        led.take("batch.groups", None, 1)
    groups = led["batch.groups"]
    if groups > 1 and not topo.split:
        led.change(
            "batch.groups",
            1,
            "groups.no-split",
            f"{groups} groups need a layer split to pipeline; 1 group",
            because=("split.layers",),
        )
    elif groups > 1 and slots % groups:
        led.change(
            "batch.groups",
            1,
            "groups.not-divisor",
            f"{groups} groups do not divide {slots} slot{'s' * (slots != 1)}; 1 group",
            because=("batch.slots",),
        )
    groups = led["batch.groups"]
    if topo.split and led["batch.mtp"]:
        message = (
            f"batch MTP is off: it does not combine with pipelined slot groups yet ({groups} groups); "
            "leave batch.groups unset or set it to 1 to run it"
        )
        pipelined = Reason("batch-mtp.pipelined-groups", groups > 1, message, ("batch.groups",))
        first_failing(led, "batch.mtp", False, [pipelined])
