"""Step 4: slot groups, resolved as a pure function of slots, stages and batch MTP, then the gate that
depends on them: batch MTP does not run in pipelined groups, unless ``batch.mtp_in_groups`` opts in to
running it inside each group (at most 4 slots per group, since each slot sends 2 rows)."""

from __future__ import annotations

from ..schema.windows import BATCH_MTP_SLOTS_PER_WINDOW
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
            effect = (
                f"run batch MTP inside {groups} pipelined groups"
                if led["batch.mtp_in_groups"]
                else "pipeline them and turn batch MTP off"
            )
            tail = f", and batch.groups = {groups} would {effect}" if groups > 1 else ""
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
        in_groups = bool(led["batch.mtp_in_groups"])
        message = (
            f"batch MTP is off: it does not combine with pipelined slot groups yet ({groups} groups); "
            "leave batch.groups unset or set it to 1 to run it"
        )
        fails = groups > 1 and not in_groups
        pipelined = Reason("batch-mtp.pipelined-groups", fails, message, ("batch.groups",))
        first_failing(led, "batch.mtp", False, [pipelined])
        if in_groups and groups > 1:
            mtp_in_groups(slots, groups, led)
    lone_prompt_window(groups, led)


def lone_prompt_window(groups: int, led: Ledger) -> None:
    """A lone prompt's longer window is a serial-window schedule: pipelined groups stream every prompt's
    chunks through the stages, so the window (and the workspace planned for it) falls to the chunk."""
    chunk, alone = led["memory.prefill_chunk"], led["memory.prefill_chunk_alone"]
    if groups > 1 and alone > chunk:
        led.change(
            "memory.prefill_chunk_alone",
            chunk,
            "memory.prefill-chunk-alone-pipelined",
            f"a lone prompt's window of {alone} rows is for serial windows; {groups} pipelined groups read "
            f"every prompt in chunks of {chunk}, so the plan holds workspace for {chunk}",
            because=("batch.groups",),
        )


def _enough_groups(slots: int) -> int:
    """The fewest groups that divide ``slots`` into groups of at most 4."""
    return next(d for d in range(1, slots + 1) if slots % d == 0 and slots // d <= BATCH_MTP_SLOTS_PER_WINDOW)


def mtp_in_groups(slots: int, groups: int, led: Ledger) -> None:
    """Batch MTP inside each pipelined group: a group's window holds its slots' token and proposal rows,
    so a group of more than 4 slots is refused."""
    per_group = slots // groups
    cause = ("batch.groups", "batch.mtp_in_groups")
    if per_group > BATCH_MTP_SLOTS_PER_WINDOW:
        led.refuse(
            "batch-mtp.in-groups-too-many-slots",
            "batch.groups",
            f"batch MTP inside pipelined groups sends 2 rows per slot, so a group holds at most "
            f"{BATCH_MTP_SLOTS_PER_WINDOW} slots: {slots} slots in {groups} groups is {per_group} per group; "
            f"set batch.groups = {_enough_groups(slots)}, or use fewer slots",
        )
        return
    led.note(
        "batch-mtp.in-groups",
        "batch.mtp",
        f"batch MTP runs inside each of the {groups} pipelined groups (batch.mtp_in_groups): each slot sends "
        f"its token and one proposal, {per_group} slots ({2 * per_group} rows) per group window, the "
        f"drafters of all {slots} slots on the last stage",
        because=cause,
    )
