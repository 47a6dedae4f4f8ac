"""The resolver's reference cases, on the reference production box (2x RTX 3080 20 GB, split 23, 2 slots,
spec 4, batch MTP on), and the other shipped profiles resolving as their comments say."""

from __future__ import annotations

import pytest
from cfg_fixtures import PROFILES, decision, line_of, plan_of

BOX = PROFILES / "rtx3080-20g-x2.toml"


def test_groups_unset_gives_one_group_with_batch_mtp_on_and_the_reason():
    plan = plan_of(BOX)
    assert [s.layers for s in plan.stages] == [(0, 23), (23, 48)]
    assert (plan.batch.slots, plan.batch.groups, plan.batch.mode, plan.batch.mtp) == (2, 1, "serial", True)
    assert plan.spec.draft_tokens == 4
    d = decision(plan, "groups.batch-mtp-yield")
    assert "batch MTP does not run in pipelined groups" in d.message
    assert not any(d.severity == "off" for d in plan.decisions)


@pytest.mark.parametrize("groups", ["2", '"auto"'])
def test_explicit_groups_turn_batch_mtp_off_with_the_reason(groups):
    plan = plan_of(BOX, [f"batch.groups={groups}"])
    assert (plan.batch.groups, plan.batch.mode, plan.batch.mtp) == (2, "pipelined", False)
    d = decision(plan, "batch-mtp.pipelined-groups")
    assert d.severity == "off" and d.requested
    assert d.origin is not None and d.origin.line == line_of(BOX, "mtp = true")


def test_without_batch_mtp_the_default_pipelines_two_groups():
    plan = plan_of(BOX, ["batch.mtp=false"])
    assert (plan.batch.groups, plan.batch.mode, plan.batch.mtp) == (2, "pipelined", False)
    assert decision(plan, "groups.auto").severity == "note"


def test_production_box_streams_experts_which_is_where_batch_mtp_pays():
    plan = plan_of(BOX)
    assert all(g.experts_resident < g.experts_total for g in plan.gpus)
    assert not any(d.rule == "batch-mtp.all-experts-resident" for d in plan.decisions)
    last = plan.stages[-1]
    assert last.drafters == (0, 1) and "drafters" in last.holds and plan.gpus[0].budget.drafters == 0


def test_r9700_keeps_every_expert_resident_and_pipelines():
    plan = plan_of(PROFILES / "r9700-x2.toml")
    assert all(g.experts_resident == g.experts_total for g in plan.gpus)
    assert (plan.batch.slots, plan.batch.groups, plan.batch.mode) == (4, 2, "pipelined")
    turned_on = plan_of(PROFILES / "r9700-x2.toml", ["batch.mtp=true"])
    assert turned_on.batch.mtp and decision(turned_on, "batch-mtp.all-experts-resident")


def test_four_stage_box_pipelines_four_groups_of_two():
    plan = plan_of(PROFILES / "gpu16-x4.toml")
    assert len(plan.stages) == 4 and (plan.batch.groups, plan.batch.slots) == (4, 8)


def test_h200_profiles():
    one = plan_of(PROFILES / "h200.toml")
    assert len(one.stages) == 1 and one.batch.mtp and one.serve is not None
    assert one.machine.gpus[0].vram_mib == 143771 and one.machine.gpus[0].bandwidth_gbs == 4800
    two = plan_of(PROFILES / "h200-x2.toml")
    assert [s.layers for s in two.stages] == [(0, 24), (24, 48)] and two.batch.slots == 2


def test_h200_x2_runs_batch_mtp_inside_two_pipelined_groups():
    plan = plan_of(PROFILES / "h200-x2-mtp-groups.toml")
    b = plan.batch
    assert (b.mode, b.groups, b.mtp, b.mtp_in_groups, b.rows_per_slot, b.slots_per_window) == (
        "pipelined",
        2,
        True,
        True,
        2,
        2,
    )
    assert [s.layers for s in plan.stages] == [(0, 24), (24, 48)] and plan.stages[1].drafters == (0, 1, 2, 3)
    assert plan.to_json()["batch"]["mtp_in_groups"] is True


def test_demo_resolves_to_one_group_with_batch_mtp_on():
    plan = plan_of(None)
    assert plan.profile == "demo" and plan.machine.backend == "cpu" and len(plan.machine.gpus) == 2
    assert (plan.batch.groups, plan.batch.mtp, plan.batch.slots) == (1, True, 2)
    assert plan.serve is not None and plan.serve.host == "127.0.0.1"
    assert plan.model.facts.dtype == "float32"


def test_the_emulated_reference_box_is_the_reference_box_on_h200s():
    real = plan_of(BOX)
    emulated = plan_of(PROFILES / "emulate" / "rtx3080-20g-x2-on-h200.toml")
    assert [(s.gpu, s.device, s.layers, s.drafters) for s in emulated.stages] == [
        (s.gpu, s.device, s.layers, s.drafters) for s in real.stages
    ]
    assert emulated.batch == real.batch and emulated.batch.mtp and emulated.batch.slots == 2
    # the same VRAM budget to the byte on each GPU: the runtime caps each H200 at these figures
    assert [g.budget for g in emulated.gpus] == [g.budget for g in real.gpus]
    assert all(g.experts_resident < g.experts_total for g in emulated.gpus)
    assert emulated.host.total == real.host.total > 0 and emulated.host.ram is not None
    assert all("H200" in g.name for g in emulated.machine.gpus)


def test_the_emulated_24g_h200_keeps_experts_in_host_memory():
    plan = plan_of(PROFILES / "emulate" / "h200-24g.toml")
    whole = plan_of(PROFILES / "h200.toml")
    assert [s.device for s in plan.stages] == ["cuda:0"] and plan.gpus[0].budget.total == 24576 * 2**20
    assert (plan.batch.slots, plan.batch.mtp) == (2, True)
    # The same memory settings, but for the prefill path's chunks, launched under the cache
    # (`windows.prefill-graphs-cached`), and a lone prompt's, whose 4096 rows would cost the cache more
    # than 1/32 of its slots (`memory.prefill-chunk-alone-cached`).
    update = {"prefill_graph_rows": 0, "prefill_chunk_alone": 2048}
    assert plan.memory == whole.memory.model_copy(update=update)
    assert (plan.memory.prompt_graph_rows, whole.memory.prefill_graph_rows) == (8, 512)
    assert whole.memory.prefill_chunk_alone == 4096 > plan.memory.prefill_chunk_alone > 512
    assert plan.gpus[0].experts_resident < plan.gpus[0].experts_total
    assert whole.gpus[0].experts_resident == whole.gpus[0].experts_total
    assert plan.host.free is not None and plan.host.free > 0
