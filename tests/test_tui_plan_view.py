"""The plan view's lines, as pure functions of the plan: the host-memory line (only when experts or a prefix
store live in host memory) and the batch line."""

from __future__ import annotations

from cfg_fixtures import PROFILES, plan_of

from strata_cfg.schema.plan import MIB
from strata_cfg.tui.widgets.plan_view import summary_rows


def _rows(plan) -> dict[str, str]:
    return {label: text.plain for label, text in summary_rows(plan)}


def test_the_host_line_shows_the_experts_pinned_and_the_ram():
    box = PROFILES / "rtx3080-20g-x2.toml"
    plan = plan_of(box)
    pinned = plan.gpus[0].experts_total + plan.gpus[1].experts_total  # both GPUs stream their experts
    mib = pinned * plan.model.facts.expert_bytes() // MIB
    assert _rows(plan)["host"] == f"{mib} MiB experts pinned; RAM unknown"
    known = _rows(plan_of(box, ["machine.host_ram_mib=131072"]))
    assert known["host"] == f"{mib} MiB experts pinned; RAM 131072, {131072 - mib - 4096} free"


def test_no_host_line_when_every_expert_is_in_vram():
    assert "host" not in _rows(plan_of(PROFILES / "h200.toml"))


def test_the_host_line_names_the_prefix_store_apart_from_the_experts():
    store = _rows(plan_of(PROFILES / "h200.toml", ["memory.prefix_store_mib=2048"]))
    assert store["host"] == "2048 MiB prefix store; RAM unknown"
    box = PROFILES / "rtx3080-20g-x2.toml"
    both = _rows(plan_of(box, ["memory.prefix_store_mib=512"]))["host"]
    assert both == _rows(plan_of(box))["host"].replace("pinned;", "pinned, 512 MiB prefix store;")


def test_the_batch_line_says_batch_mtp_runs_inside_the_pipelined_groups():
    rows = _rows(plan_of(PROFILES / "h200-x2-mtp-groups.toml"))
    assert rows["batch"] == "4 slots · 2 groups · pipelined · batch MTP inside 2 pipelined groups"
    plain = _rows(plan_of(PROFILES / "h200-x2-mtp-groups.toml", ["batch.mtp_in_groups=false"]))
    assert plain["batch"] == "4 slots · 2 groups · pipelined · ! batch MTP off although asked for"
