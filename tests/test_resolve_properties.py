"""Properties of `resolve` over random profiles (Hypothesis): it only ever refuses with a ProfileError, and
every plan it returns is consistent (layers covered once, drafters on the last stage, budgets that add up,
groups that divide the slots, batch MTP on a split in one group, deterministic, JSON round trip); and it
does not depend on the order of gates that are independent of each other."""

from __future__ import annotations

from typing import Any
from unittest.mock import patch

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_cfg.resolve import batch_gates, core, resolve
from strata_cfg.schema.errors import ProfileError
from strata_cfg.schema.facts import GpuFacts, MachineFacts, ModelFacts
from strata_cfg.schema.plan import Budget, LaunchPlan
from strata_cfg.schema.presets import preset_config
from strata_cfg.schema.profile import Profile

PRESETS = ("tiny", "small", "qwen3-30b-a3b")
LAYERS = {name: preset_config(name)["num_hidden_layers"] for name in PRESETS}
FEW = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


gpu_specs = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["RTX 3080 20GB", "R9700", "H200", "virtual"]),
        "vram_mib": st.one_of(
            st.sampled_from([64, 2048, 16376, 20480, 32624, 143771]), st.integers(1, 200_000)
        ),
        "bandwidth_gbs": st.floats(5, 6000, allow_nan=False),
    }
)


@st.composite
def any_profile(draw: st.DrawFn) -> dict[str, Any]:
    """Any profile the schema accepts, valid for resolution or not."""
    preset = draw(st.sampled_from(PRESETS))
    n_layers = LAYERS[preset]
    layers = draw(
        st.one_of(
            st.none(),
            st.just("auto"),
            st.lists(st.integers(0, n_layers + 2), max_size=9),
            st.lists(st.integers(2, n_layers - 1), max_size=3, unique=True).map(sorted),
        )
    )
    device = st.one_of(st.integers(0, 5), st.sampled_from(["local:1", "node2:0", "0"]))
    profile: dict[str, Any] = {
        "machine": {"gpus": draw(st.lists(gpu_specs, min_size=1, max_size=5))},
        "model": {"synthetic": preset},
        "split": {
            "layers": layers,
            "devices": draw(_maybe(st.lists(device, min_size=1, max_size=5))),
            "test_shared_gpu": draw(_maybe(st.booleans())),
            "pipeline_windows": draw(_maybe(st.sampled_from([0, 1, 2]))),
        },
        "batch": {
            "slots": draw(_maybe(st.integers(0, 20))),
            "groups": draw(_maybe(st.one_of(st.just("auto"), st.integers(1, 6)))),
            "mtp": draw(_maybe(st.booleans())),
            "mtp_in_groups": draw(_maybe(st.booleans())),
        },
        "spec": {"draft_tokens": draw(_maybe(st.integers(0, 8)))},
        "memory": {
            "context": draw(_maybe(st.integers(16, 50_000))),
            "kv_dtype": draw(_maybe(st.sampled_from(["float32", "float16", "bfloat16"]))),
            "prefill_chunk": draw(_maybe(st.integers(8, 2048))),
            "vram_reserve_mib": draw(_maybe(st.integers(0, 2000))),
            "vram_reserve_later_mib": draw(_maybe(st.integers(0, 2000))),
        },
        "experts": {
            "cache": draw(_maybe(st.one_of(st.just("auto"), st.integers(0, 5000)))),
            "helper_devices": draw(_maybe(st.lists(st.integers(0, 5), max_size=2))),
            "remote_opt": draw(_maybe(st.booleans())),
            "peer_device": draw(_maybe(st.integers(0, 5))),
        },
    }
    if draw(st.booleans()):
        profile["machine"]["backend"] = draw(st.sampled_from(["cuda", "cpu"]))
    if draw(st.booleans()):
        profile["serve"] = {
            "host": draw(st.sampled_from(["127.0.0.1", "0.0.0.0", "::1"])),
            "api_key_env": draw(_maybe(st.just("STRATA_KEY"))),
        }
    return profile


@st.composite
def valid_profile(draw: st.DrawFn) -> dict[str, Any]:
    """Profiles that must resolve: roomy GPUs, rising boundaries, one GPU per stage, no expert helpers."""
    preset = draw(st.sampled_from(("tiny", "small")))
    n_layers = LAYERS[preset]
    n_gpus = draw(st.integers(1, 4))
    gpus = [
        {"name": "roomy", "vram_mib": 65536, "bandwidth_gbs": draw(st.floats(100, 5000, allow_nan=False))}
        for _ in range(n_gpus)
    ]
    boundaries = draw(st.lists(st.integers(2, n_layers - 1), max_size=n_gpus - 1, unique=True).map(sorted))
    layers = draw(st.sampled_from([boundaries, "auto"])) if n_gpus > 1 else boundaries
    slots = draw(_maybe(st.integers(0, 16)))
    profile: dict[str, Any] = {
        "machine": {"gpus": gpus, "backend": draw(st.sampled_from(["cuda", "cpu"]))},
        "model": {"synthetic": preset},
        "split": {"layers": layers},
        "batch": {
            "slots": slots,
            "groups": draw(_maybe(st.one_of(st.just("auto"), st.integers(1, 4)))),
            "mtp": draw(_maybe(st.booleans())),
            # batch MTP in groups of more than 4 slots is refused; a valid profile keeps them small
            "mtp_in_groups": draw(_maybe(st.booleans())) if slots is None or slots <= 4 else None,
        },
        "spec": {"draft_tokens": draw(_maybe(st.integers(0, 8)))},
        "memory": {"context": draw(_maybe(st.integers(16, 8192)))},
    }
    if draw(st.booleans()):
        profile["serve"] = {}
    return profile


def facts(profile: Profile) -> tuple[MachineFacts, ModelFacts]:
    assert profile.machine is not None and profile.machine.gpus is not None and profile.model is not None
    backend = profile.machine.backend or "cuda"
    machine = MachineFacts(
        backend=backend,
        gpus=tuple(
            GpuFacts(index=i, name=g.name, vram_mib=g.vram_mib, bandwidth_gbs=g.bandwidth_gbs)
            for i, g in enumerate(profile.machine.gpus)
        ),
    )
    name = profile.model.synthetic or "tiny"
    model = ModelFacts.from_config(preset_config(name), source=f"synthetic:{name}", dtype="float16")
    return machine, model


def check_plan(plan: LaunchPlan) -> None:
    n_layers = plan.model.facts.num_hidden_layers
    # the stages cover every layer exactly once, in order
    edges = [s.layers for s in plan.stages]
    assert edges[0][0] == 0 and edges[-1][1] == n_layers
    assert all(a < b for a, b in edges) and all(edges[i][1] == edges[i + 1][0] for i in range(len(edges) - 1))
    # every drafter is on the last stage's GPU
    assert all(not s.drafters and "drafters" not in s.holds for s in plan.stages[:-1])
    last_gpu = plan.stages[-1].gpu
    assert all(g.budget.drafters == 0 for g in plan.gpus if g.index != last_gpu)
    assert ("drafters" in plan.stages[-1].holds) == bool(plan.stages[-1].drafters)
    # each budget adds up, with no negative term
    for g in plan.gpus:
        terms = [getattr(g.budget, t) for t in Budget.TERMS]
        assert sum(terms) == g.budget.total == plan.machine.gpus[g.index].vram_mib * 2**20
        assert min(terms) >= 0
        assert 0 <= g.experts_resident <= g.experts_total or g.role == "helper"
    # groups divide slots; batch MTP on a split means one group, unless it runs inside pipelined groups:
    # then each group's window holds at most 4 slots of 2 rows, and every slot drafts on the last stage
    b = plan.batch
    assert b.slots % b.groups == 0
    if b.mtp and len(plan.stages) > 1:
        assert b.groups == 1 or b.mtp_in_groups
    assert b.mtp_in_groups == (b.mtp and b.groups > 1)
    if b.mtp_in_groups:
        assert b.mode == "pipelined" and plan.settings["batch.mtp_in_groups"].value is True
        assert b.slots_per_window == b.slots // b.groups <= 4 and b.rows_per_slot == 2
        assert plan.stages[-1].drafters == tuple(range(b.slots))
    assert plan.windows.batch_rows <= plan.windows.max_rows == 8
    # every default and auto was resolved
    assert all(s.value != "auto" for s in plan.settings.values())
    assert LaunchPlan.model_validate(plan.to_json()) == plan


@FEW
@given(any_profile(), st.booleans())
def test_resolve_refuses_only_with_a_profile_error_and_plans_are_consistent(data, strict):
    profile = Profile.model_validate(data)
    machine, model = facts(profile)
    try:
        plan = resolve(profile, machine, model, strict=strict)
    except ProfileError as exc:
        assert exc.problems and all(p.message for p in exc.problems)
        return
    check_plan(plan)


@FEW
@given(valid_profile())
def test_valid_profiles_resolve_consistently_and_deterministically(data):
    profile = Profile.model_validate(data)
    machine, model = facts(profile)
    plan = resolve(profile, machine, model)
    check_plan(plan)
    again = resolve(Profile.model_validate(data), machine, model)
    assert again == plan and again.to_json() == plan.to_json()


@FEW
@given(valid_profile())
def test_strict_refuses_exactly_when_a_rule_overrode_an_explicit_ask(data):
    profile = Profile.model_validate(data)
    machine, model = facts(profile)
    plan = resolve(profile, machine, model)
    asked = {d.rule for d in plan.decisions if d.requested}
    try:
        resolve(profile, machine, model, strict=True)
    except ProfileError as exc:
        assert asked and {p.rule for p in exc.problems} == asked
    else:
        assert not asked


# ---- the order of the gates ------------------------------------------------------------------------------


@st.composite
def gated_profile(draw: st.DrawFn) -> dict[str, Any]:
    """Split profiles that exercise every gate: helper caches on spare GPUs, remote opt, no serve table,
    short spec windows, pipeline windows, groups unset, "auto" or a number."""
    preset = draw(st.sampled_from(("tiny", "small")))
    n_layers = LAYERS[preset]
    n_gpus = draw(st.integers(2, 4))
    n_stages = draw(st.integers(1, min(n_gpus, n_layers - 1)))
    bounds = sorted(
        draw(
            st.lists(st.integers(2, n_layers - 1), min_size=n_stages - 1, max_size=n_stages - 1, unique=True)
        )
    )
    stages = list(range(len(bounds) + 1))
    spare = [i for i in range(n_gpus) if i not in stages]
    helpers = draw(st.lists(st.sampled_from(spare), unique=True, max_size=len(spare))) if spare else []
    profile: dict[str, Any] = {
        "machine": {"gpus": [{"name": "roomy", "vram_mib": 65536, "bandwidth_gbs": 1000}] * n_gpus},
        "model": {"synthetic": preset},
        "split": {
            "layers": bounds,
            "devices": stages,
            "pipeline_windows": draw(_maybe(st.sampled_from([0, 1, 2]))),
        },
        "batch": {
            "slots": draw(_maybe(st.integers(0, 8))),
            "groups": draw(_maybe(st.one_of(st.just("auto"), st.integers(1, 4)))),
            "mtp": draw(_maybe(st.booleans())),
            "mtp_in_groups": draw(_maybe(st.booleans())),
        },
        "spec": {"draft_tokens": draw(_maybe(st.integers(0, 8)))},
        "experts": {"helper_devices": helpers or None, "remote_opt": draw(_maybe(st.booleans()))},
    }
    if draw(st.booleans()):
        profile["serve"] = {}
    return profile


def _outcome(plan: LaunchPlan) -> tuple[dict[str, Any], dict[str, Any]]:
    """The plan without its record of how (the settings' values stay, their sources and rules go)."""
    out = plan.to_json()
    settings = {k: v["value"] for k, v in out.pop("settings").items()}
    out.pop("decisions")
    return out, settings


def _decisions(plan: LaunchPlan) -> list[tuple[str, str, str]]:
    return sorted((d.rule, d.key, d.message) for d in plan.decisions)


def _resolve_with(data: dict[str, Any], gates: tuple[Any, ...]) -> LaunchPlan:
    profile = Profile.model_validate(data)
    machine, model = facts(profile)
    with patch.object(core, "GATES", gates):
        return resolve(profile, machine, model)


@FEW
@given(gated_profile())
def test_resolving_does_not_depend_on_where_the_independent_pipeline_windows_gate_runs(data):
    batch, batch_mtp, groups, windows = core.GATES
    plan = _resolve_with(data, core.GATES)
    check_plan(plan)
    for order in [(batch, windows, batch_mtp, groups), (batch, batch_mtp, windows, groups)]:
        moved = _resolve_with(data, order)
        assert _outcome(moved) == _outcome(plan)
        assert _decisions(moved) == _decisions(plan)


@FEW
@given(gated_profile())
def test_resolving_does_not_depend_on_the_order_of_the_batch_mtp_reasons(data):
    # The reasons of step 3 are independent: any order turns batch MTP off for the same profiles, with the
    # same groups and windows; only which reason is named may change.
    plan = _resolve_with(data, core.GATES)
    reasons = batch_gates.batch_mtp_reasons
    with patch.object(batch_gates, "batch_mtp_reasons", lambda *a, **k: tuple(reversed(reasons(*a, **k)))):
        reversed_plan = _resolve_with(data, core.GATES)
    assert _outcome(reversed_plan) == _outcome(plan)
    off = [d for d in reversed_plan.decisions if d.key == "batch.mtp" and d.severity == "off"]
    assert len(off) == (0 if plan.batch.mtp or not plan.settings["batch.mtp"].requested else 1)


@FEW
@given(st.one_of(valid_profile(), gated_profile()))
def test_a_profile_without_mtp_in_groups_resolves_as_with_it_false(data):
    # batch.mtp_in_groups is opt-in: leaving it out is the same plan as writing false, decisions included.
    batch = dict(data.get("batch", {}))
    batch.pop("mtp_in_groups", None)
    without = _resolve_with({**data, "batch": batch}, core.GATES)
    with_false = _resolve_with({**data, "batch": {**batch, "mtp_in_groups": False}}, core.GATES)
    assert _outcome(without) == _outcome(with_false)
    assert _decisions(without) == _decisions(with_false)
