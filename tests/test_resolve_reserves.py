"""The two VRAM reserves land where docs/PROFILES.md says: ``memory.vram_reserve_mib`` on the first stage's
GPU, ``memory.vram_reserve_later_mib`` on every other GPU (helpers included), in the budget, in the auto
split's room per stage, and in the engine's command line. Every case sets them to different values, so a
swap anywhere fails here."""

from __future__ import annotations

from cfg_fixtures import RULES_DIR, plan_of

from strata_cfg.report.engine_args import engine_args
from strata_cfg.schema.plan import MIB

FIRST, LATER = 200, 48
RESERVES = [f"memory.vram_reserve_mib={FIRST}", f"memory.vram_reserve_later_mib={LATER}"]


def _reserves(plan) -> dict[int, int]:
    return {g.index: g.budget.reserve // MIB for g in plan.gpus}


def test_the_first_reserve_is_on_the_first_stages_gpu_and_the_later_one_on_the_others():
    plan = plan_of(RULES_DIR / "batch-mtp.remote-opt.toml", RESERVES)
    assert [s.gpu for s in plan.stages] == [0, 1]
    assert _reserves(plan) == {0: FIRST, 1: LATER}
    # Against both reserves at FIRST (the later one defaults to the first): only GPU 1 changes, and only
    # its free VRAM, by the difference.
    equal = plan_of(RULES_DIR / "batch-mtp.remote-opt.toml", [RESERVES[0]])
    assert plan.gpus[0].budget == equal.gpus[0].budget
    assert plan.gpus[1].budget.free - equal.gpus[1].budget.free == (FIRST - LATER) * MIB


def test_the_first_reserve_follows_the_first_stage_not_gpu_0():
    plan = plan_of(RULES_DIR / "batch-mtp.remote-opt.toml", [*RESERVES, "split.devices=[1, 0]"])
    assert [s.gpu for s in plan.stages] == [1, 0]
    assert _reserves(plan) == {1: FIRST, 0: LATER}


def test_a_helper_gpu_keeps_the_later_reserve():
    plan = plan_of(RULES_DIR / "batch-mtp.helper-caches.toml", RESERVES)
    roles = {g.index: g.role for g in plan.gpus}
    assert roles == {0: "stage", 1: "stage", 2: "helper", 3: "idle"}
    assert _reserves(plan) == {0: FIRST, 1: LATER, 2: LATER, 3: 0}


def test_the_auto_split_leaves_the_first_reserve_room_on_the_first_stage():
    # Two 64 MiB devices, tight enough that 24 MiB decides where the boundary goes: the stage that carries
    # the reserve takes fewer layers, and every expert still fits.
    tight = ["machine.gpus.0.vram_mib=64", "machine.gpus.1.vram_mib=64", "memory.context=256"]
    on_first = plan_of(
        RULES_DIR / "split.auto.toml",
        [*tight, "memory.vram_reserve_mib=24", "memory.vram_reserve_later_mib=0"],
    )
    on_later = plan_of(
        RULES_DIR / "split.auto.toml",
        [*tight, "memory.vram_reserve_mib=0", "memory.vram_reserve_later_mib=24"],
    )
    first_layers = [p.stages[0].layers[1] for p in (on_first, on_later)]
    assert first_layers[0] < first_layers[1]
    for plan, reserves in ((on_first, {0: 24, 1: 0}), (on_later, {0: 0, 1: 24})):
        assert _reserves(plan) == reserves
        assert all(g.experts_resident == g.experts_total for g in plan.gpus)


def test_engine_args_give_the_first_reserve_then_the_later_one():
    plan = plan_of(RULES_DIR / "batch-mtp.remote-opt.toml", RESERVES)
    args = engine_args(plan)
    assert args[args.index("--vram-reserve-mib") + 1] == f"{FIRST},{LATER}"
    assert plan.memory.vram_reserve_mib == FIRST and plan.memory.vram_reserve_later_mib == LATER
