"""Every resolution rule, pinned by a test named after it and a profile under profiles/rules/ that fires it.

Two rules cannot be reached from a profile, because an earlier step always decides first (see UNREACHABLE);
they are pinned by calling their gate directly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from cfg_fixtures import PROFILES, RULES_DIR, decision, line_of, plan_of, problem, problems_of

from strata_cfg.resolve import RULES
from strata_cfg.resolve.batch_gates import batch_mtp_gate
from strata_cfg.resolve.groups import auto_groups
from strata_cfg.resolve.ledger import Ledger
from strata_cfg.resolve.pipeline_windows import pipeline_windows_gate
from strata_cfg.resolve.topology import Topology
from strata_cfg.schema.plan import MIB

UNREACHABLE = {
    # Two stages on one GPU are refused unless it is a test split, and a test split turns batching off in
    # step 2, so step 3's first reason (batching off) always wins.
    "batch-mtp.shared-gpu",
    # A peer device with a split is refused in step 1, and without a split the first reason wins.
    "pipeline-windows.peer-device",
}


def rule_file(rule_id: str):
    return RULES_DIR / f"{rule_id}.toml"


def _slug(rule_id: str) -> str:
    return "test_" + rule_id.replace(".", "_").replace("-", "_")


def test_every_rule_has_a_test_named_after_it_and_a_profile_that_fires_it():
    tests = [name for name in globals() if name.startswith("test_")]
    for rule_id in RULES:
        assert any(t.startswith(_slug(rule_id)) for t in tests), f"no test named after {rule_id}"
        if rule_id not in UNREACHABLE:
            path = rule_file(rule_id)
            assert path.exists(), f"no profile fires {rule_id}"
            assert f"# rule: {rule_id}" in path.read_text()


MYSTERY_SMI = "0, Mystery Accelerator 9000, 24576\n"
H200_SMI = "0, NVIDIA H200, 143771\n"
MEMINFO = "MemTotal:       263808196 kB\nMemFree:        200000000 kB\nMemAvailable:   251658240 kB\n"
PROBES = {
    # The rules that only a probing profile fires, with what the probes answer.
    "machine.estimated-bandwidth": {"probe": lambda: MYSTERY_SMI},
    "machine.host-ram-probed": {"probe": lambda: H200_SMI, "meminfo": lambda: MEMINFO},
}


@pytest.mark.parametrize("rule_id", sorted(set(RULES) - UNREACHABLE))
def test_each_rule_profile_fires_its_rule(rule_id):
    path = rule_file(rule_id)
    kwargs = PROBES.get(rule_id, {})
    if RULES[rule_id].severity == "error":
        assert any(p.rule == rule_id for p in problems_of(path, **kwargs))
    else:
        assert any(d.rule == rule_id for d in plan_of(path, **kwargs).decisions)


# ---- step 0 -------------------------------------------------------------------------------------


def test_model_cpu_float32_forces_float32_and_says_so():
    plan = plan_of(rule_file("model.cpu-float32"))
    assert plan.model.facts.dtype == "float32"
    s = plan.settings["model.dtype"]
    assert (s.value, s.source.kind, s.requested) == ("float32", "forced", "float16")
    d = decision(plan, "model.cpu-float32")
    assert (
        d.requested
        and d.origin is not None
        and d.origin.line == line_of(rule_file("model.cpu-float32"), "dtype")
    )


def test_memory_context_cap_clamps_to_the_models_positions():
    plan = plan_of(rule_file("memory.context-cap"))
    assert plan.memory.context == plan.model.facts.max_position_embeddings == 4096
    assert decision(plan, "memory.context-cap").severity == "clamp"
    assert plan.settings["memory.context"].requested == 8192


def test_memory_prefill_chunk_alone_floor_raises_a_lone_prompts_chunk_to_every_prompts():
    plan = plan_of(rule_file("memory.prefill-chunk-alone-floor"))
    assert plan.memory.prefill_chunk_alone == plan.memory.prefill_chunk == 256
    assert decision(plan, "memory.prefill-chunk-alone-floor").severity == "clamp"
    assert plan.settings["memory.prefill_chunk_alone"].requested == 64


def test_memory_prefix_store_needs_reuse_turns_the_store_off_where_slots_keep_nothing():
    plan = plan_of(rule_file("memory.prefix-store-needs-reuse"))
    assert plan.memory.prefix_store_mib == 0 and plan.host.prefix_store == 0 and not plan.memory.prefix_reuse
    d = decision(plan, "memory.prefix-store-needs-reuse")
    assert d.severity == "off" and d.requested and d.because == ("memory.prefix_reuse",)
    assert plan.settings["memory.prefix_store_mib"].requested == 512
    on = plan_of(rule_file("memory.prefix-store-needs-reuse"), ["memory.prefix_reuse=true"])
    assert on.memory.prefix_store_mib == 512 and on.host.prefix_store == 512 * MIB


def test_memory_prefill_chunk_alone_pipelined_drops_the_lone_prompt_window_and_its_workspace():
    path = rule_file("memory.prefill-chunk-alone-pipelined")
    plan = plan_of(path)
    assert plan.batch.mode == "pipelined"
    assert plan.memory.prefill_chunk_alone == plan.memory.prefill_chunk == 64
    d = decision(plan, "memory.prefill-chunk-alone-pipelined")
    assert d.severity == "clamp" and d.requested and d.because == ("batch.groups",)
    assert plan.settings["memory.prefill_chunk_alone"].requested == 512
    # The plan holds the workspace the engine uses: as if the key were not written.
    plain = plan_of(path, [("memory.prefill_chunk_alone", 64)])
    assert [g.budget.workspace for g in plan.gpus] == [g.budget.workspace for g in plain.gpus]
    # Serial windows keep the lone prompt's window, and plan its workspace.
    serial = plan_of(path, [("batch.groups", 1)])
    assert serial.batch.mode == "serial" and serial.memory.prefill_chunk_alone == 512
    assert not any(d.rule == "memory.prefill-chunk-alone-pipelined" for d in serial.decisions)
    assert serial.gpus[0].budget.workspace > plan.gpus[0].budget.workspace


def _slots_paid(path, overrides=()) -> tuple[int, int]:
    """(the cache's slots with the lone prompt's chunk at the chunk's 512 rows, the slots the chunk of the
    plan of ``overrides`` costs) on the first GPU."""
    short = plan_of(path, [*overrides, ("memory.prefill_chunk_alone", 512)]).gpus[0].experts_resident
    return short, short - plan_of(path, list(overrides)).gpus[0].experts_resident


def test_memory_prefill_chunk_alone_cached_reads_a_lone_prompt_in_longer_chunks_under_an_expert_cache():
    """Unset under an expert cache: the longest chunk whose workspace costs the cache at most 1/32 of its
    slots, derived, with a note naming what it costs; the budget is the one planned for its rows. On the
    24 GiB card 2048 rows (4096 would cost more), on a 40 GiB one 4096."""
    path = rule_file("memory.prefill-chunk-alone-cached")
    plan = plan_of(path)
    assert plan.experts.cache is not None and plan.memory.prefill_chunk == 512
    assert plan.memory.prefill_chunk_alone == 2048
    s = plan.settings["memory.prefill_chunk_alone"]
    assert (s.value, s.source.kind, s.source.rule) == (2048, "derived", "memory.prefill-chunk-alone-cached")
    slots, paid = _slots_paid(path)
    assert paid > 0 and paid * 32 <= slots
    d = decision(plan, "memory.prefill-chunk-alone-cached")
    assert d.severity == "note" and d.key == "memory.prefill_chunk_alone"
    assert (
        "chunks of 2048 rows, not 512" in d.message and f"{paid} of GPU 0's {slots} expert slots" in d.message
    )
    assert plan.experts.cache == plan.gpus[0].experts_resident == slots - paid
    written = plan_of(path, [("memory.prefill_chunk_alone", 2048)])
    assert [g.budget for g in written.gpus] == [g.budget for g in plan.gpus]
    slots, paid = _slots_paid(path, [("memory.prefill_chunk_alone", 4096)])
    assert paid * 32 > slots
    bigger = [("machine.gpus", [{"name": "H", "vram_mib": 40960, "bandwidth_gbs": 4800}])]
    assert plan_of(path, bigger).memory.prefill_chunk_alone == 4096
    slots, paid = _slots_paid(path, bigger)
    assert paid > 0 and paid * 32 <= slots


def test_memory_prefill_chunk_alone_cached_takes_a_shorter_chunk_where_a_longer_one_costs_too_many_slots():
    """The reference box's split on two 8 GiB cards: a 4096- or 2048-row chunk would cost more than 1/32 of
    a cache's few hundred slots, so 1024 rows, whose cost is within it on both GPUs; on 6 GiB cards even
    that costs too much, and the chunk stays."""
    path = PROFILES / "rtx3080-20g-x2.toml"
    gpus = ("machine.gpus", [{"name": n, "vram_mib": 8192, "bandwidth_gbs": 760} for n in "AB"])
    plan = plan_of(path, [gpus])
    assert plan.memory.prefill_chunk_alone == 1024
    for rows in (2048, 4096):
        slots, paid = _slots_paid(path, [gpus, ("memory.prefill_chunk_alone", rows)])
        assert paid * 32 > slots, rows
    slots, paid = _slots_paid(path, [gpus])
    assert paid > 0 and paid * 32 <= slots
    assert (
        f"{paid} of GPU 0's {slots} expert slots"
        in decision(plan, "memory.prefill-chunk-alone-cached").message
    )
    small = ("machine.gpus", [{"name": n, "vram_mib": 6144, "bandwidth_gbs": 760} for n in "AB"])
    assert plan_of(path, [small]).memory.prefill_chunk_alone == 512


def test_memory_prefill_chunk_alone_cached_keeps_every_expert_of_a_resident_gpu_resident():
    """A split whose first GPU just holds all its experts and whose second caches them: a longer chunk's
    workspace would push the first GPU's experts into a cache too, so the chunk stays."""
    path = PROFILES / "rtx3080-20g-x2.toml"
    gpus = (
        "machine.gpus",
        [{"name": n, "vram_mib": v, "bandwidth_gbs": 760} for n, v in (("A", 29350), ("B", 20480))],
    )
    plan = plan_of(path, [gpus])
    a, b = plan.gpus
    assert a.experts_resident == a.experts_total and b.experts_resident < b.experts_total
    assert plan.memory.prefill_chunk_alone == 512
    assert "memory.prefill-chunk-alone-cached" not in [d.rule for d in plan.decisions]
    longer = plan_of(path, [gpus, ("memory.prefill_chunk_alone", 1024)]).gpus[0]
    assert longer.experts_resident < longer.experts_total


@pytest.mark.parametrize(
    ("profile", "overrides"),
    [
        (None, [("memory.prefill_chunk_alone", 512)]),  # written: taken as is
        (None, [("machine.gpus", [{"name": "H200", "vram_mib": 143771, "bandwidth_gbs": 4800}])]),  # resident
        (None, [("machine.backend", "cpu"), ("machine.host_ram_mib", 262144)]),  # no prefill path
        ("rtx3080-20g-x2.toml", [("batch.mtp", False), ("batch.groups", 2)]),  # pipelined groups
    ],
    ids=["written", "all-resident", "cpu", "pipelined"],
)
def test_memory_prefill_chunk_alone_cached_leaves_the_chunk_alone_otherwise(profile, overrides):
    path = PROFILES / profile if profile else rule_file("memory.prefill-chunk-alone-cached")
    plan = plan_of(path, overrides)
    assert plan.memory.prefill_chunk_alone == plan.memory.prefill_chunk == 512
    assert "memory.prefill-chunk-alone-cached" not in [d.rule for d in plan.decisions]
    if profile is not None:  # the reference box still holds a cache: only the pipelined groups keep the chunk
        assert plan.experts.cache is not None


def test_the_plan_text_shows_a_lone_prompts_longer_chunk():
    from strata_cfg.report.plan_text import plan_text

    plan = plan_of(rule_file("memory.prefill-chunk-alone-floor"))
    assert "prefill chunk 256\n" in plan_text(plan)  # raised to the chunk: nothing more to say
    longer = plan.model_copy(update={"memory": plan.memory.model_copy(update={"prefill_chunk_alone": 1024})})
    assert "prefill chunk 256 (1024 for a prompt alone)" in plan_text(longer)


def test_prefill_q_is_split_unless_asked_and_the_plan_text_names_fp16():
    from strata_cfg.report.plan_text import plan_text

    path = rule_file("memory.prefill-chunk-alone-floor")
    plan = plan_of(path)
    assert plan.model.prefill_q == "split" and plan.settings["model.prefill_q"].source.kind == "default"
    assert "fp16 q" not in plan_text(plan)
    fast = plan_of(path, [("model.prefill_q", "fp16")])
    assert fast.model.prefill_q == "fp16" and fast.settings["model.prefill_q"].source.kind == "user"
    assert ", prompt attention with fp16 q\n" in plan_text(fast)


def test_spec_needs_mtp_weights_turns_drafting_off():
    plan = plan_of(rule_file("spec.needs-mtp-weights"))
    assert not plan.model.facts.has_mtp
    assert (plan.spec.draft_tokens, plan.spec.mtp) == (0, False)
    assert plan.windows.solo_rows == 1
    assert decision(plan, "spec.needs-mtp-weights").requested


NGRAM = ['spec.method="ngram"']


def _no_mtp_profile(tmp_path, spec: str) -> Path:
    """A profile of the model without MTP weights whose ``[spec]`` table is ``spec``."""
    path = tmp_path / "nomtp.toml"
    path.write_text(
        f'extends = "{RULES_DIR.parent / "base-cpu2.toml"}"\n'
        f'[model]\npath = "{RULES_DIR.parent / "models" / "nomtp-micro"}"\n[spec]\n{spec}\n'
    )
    return path


def test_spec_needs_mtp_weights_does_not_turn_ngram_lookup_off(tmp_path):
    # Without MTP weights, n-gram lookup drafts: the default window is 4 and no rule turns it off.
    plan = plan_of(_no_mtp_profile(tmp_path, 'method = "ngram"'))
    assert not plan.model.facts.has_mtp
    s = plan.spec
    assert (s.draft_tokens, s.mtp, s.ngram, s.ngram_min, s.ngram_max) == (4, False, True, 2, 4)
    assert s.adaptive_depth and plan.windows.solo_rows == s.draft_tokens
    assert plan.settings["spec.draft_tokens"].source.kind == "default"
    assert plan.settings["spec.method"].source.kind == "user"
    assert "spec.needs-mtp-weights" not in [d.rule for d in plan.decisions]
    j = plan.to_json()["spec"]  # what `strata plan --json` prints
    assert (j["ngram"], j["ngram_min"], j["ngram_max"], j["mtp"]) == (True, 2, 4, False)
    # No drafter, no MTP head: lookup reads the request's own tokens.
    assert all(st.drafters == () and "mtp" not in st.holds for st in plan.stages)
    assert all(g.budget.drafters == 0 for g in plan.gpus)
    # A written window is kept, and its solo rows follow it.
    three = plan_of(_no_mtp_profile(tmp_path, 'method = "ngram"\ndraft_tokens = 3'))
    assert (three.spec.draft_tokens, three.spec.ngram, three.windows.solo_rows) == (3, True, 3)
    # Without a proposal in the window, nothing drafts and nothing adapts.
    off = plan_of(_no_mtp_profile(tmp_path, 'method = "ngram"\ndraft_tokens = 1'))
    assert (off.spec.ngram, off.spec.mtp, off.spec.adaptive_depth, off.windows.solo_rows) == (
        False,
        False,
        False,
        1,
    )


def test_spec_needs_mtp_weights_still_turns_mtp_off_on_the_same_model(tmp_path):
    plan = plan_of(_no_mtp_profile(tmp_path, 'method = "mtp"'))
    assert (plan.spec.draft_tokens, plan.spec.mtp, plan.spec.ngram) == (0, False, False)
    assert plan.settings["spec.draft_tokens"].source.kind == "default"  # unset: 0 without MTP weights
    asked = plan_of(_no_mtp_profile(tmp_path, 'method = "mtp"\ndraft_tokens = 4'))
    assert (asked.spec.draft_tokens, asked.spec.mtp, asked.spec.ngram) == (0, False, False)
    d = decision(asked, "spec.needs-mtp-weights")
    assert d.requested and "spec.method" in d.because
    assert asked.windows.solo_rows == 1


def test_spec_ngram_defaults_follow_a_written_bound(tmp_path):
    plan = plan_of(_no_mtp_profile(tmp_path, 'method = "ngram"\nngram_min = 6'))
    assert (plan.spec.ngram_min, plan.spec.ngram_max) == (6, 6)
    plan = plan_of(_no_mtp_profile(tmp_path, 'method = "ngram"\nngram_max = 1'))
    assert (plan.spec.ngram_min, plan.spec.ngram_max) == (1, 1)
    plan = plan_of(_no_mtp_profile(tmp_path, 'method = "ngram"\nngram_min = 3\nngram_max = 5'))
    assert (plan.spec.ngram_min, plan.spec.ngram_max) == (3, 5)


def test_spec_ngram_min_over_max_names_the_file_line_and_key(tmp_path):
    path = _no_mtp_profile(tmp_path, 'method = "ngram"\nngram_min = 5\nngram_max = 3')
    [p] = problems_of(path)
    assert (p.file, p.line, p.key) == (str(path), line_of(path, "ngram_max"), "spec.ngram_max")
    assert "ngram_min = 5" in p.message and "ngram_max = 3" in p.message
    # From --set too: the key's origin is the override.
    [p] = problems_of(rule_file("batch-mtp.spec-ngram"), ["spec.ngram_min=4", "spec.ngram_max=2"])
    assert p.key == "spec.ngram_max" and p.file == "--set"


def test_spec_ngram_inert_notes_each_written_bound_under_mtp():
    path = rule_file("spec.ngram-inert")
    plan = plan_of(path)
    assert plan.spec.mtp and not plan.spec.ngram
    notes = [d for d in plan.decisions if d.rule == "spec.ngram-inert"]
    assert [d.key for d in notes] == ["spec.ngram_min", "spec.ngram_max"]
    for d in notes:
        assert d.severity == "note" and d.requested and d.because == ("spec.method",)
        assert 'does nothing: spec.method is "mtp"' in d.message
        assert d.origin is not None and d.origin.line == line_of(path, d.key.split(".")[1])
    lookup = plan_of(path, NGRAM)
    assert lookup.spec.ngram and (lookup.spec.ngram_min, lookup.spec.ngram_max) == (3, 6)
    assert "spec.ngram-inert" not in [d.rule for d in lookup.decisions]
    # An unset bound says nothing.
    plain = plan_of(rule_file("batch-mtp.needs-spec"))
    assert "spec.ngram-inert" not in [d.rule for d in plain.decisions]
    # Strict mode refuses what does nothing.
    problems = problems_of(path, strict=True)
    assert {p.key for p in problems} == {"spec.ngram_min", "spec.ngram_max"}


def test_plan_text_says_the_solo_path_drafts_by_ngram_lookup():
    from strata_cfg.report.engine_args import engine_args_text
    from strata_cfg.report.plan_text import plan_text

    path = rule_file("spec.ngram-inert")
    text = plan_text(plan_of(path, NGRAM))
    assert "window 4: token + up to 3 proposals by n-gram lookup (3-6 tokens matched)" in text
    assert "MTP proposals" not in text
    same = plan_text(plan_of(path, [*NGRAM, "spec.ngram_max=3", "spec.adaptive_depth=false"]))
    assert "window 4: token + 3 proposals by n-gram lookup (3 tokens matched)" in same
    several = plan_text(plan_of(path, [*NGRAM, "batch.slots=2"]))
    assert "when one request runs alone, and in the rows a window of several spares" in several
    assert "a window of several spares" not in text
    mtp = plan_text(plan_of(path))
    assert "window 4: token + up to 3 MTP proposals" in mtp and "proposals by n-gram" not in mtp
    assert 'spec.method = "ngram"' in engine_args_text(plan_of(path, NGRAM))
    assert "ngram" not in engine_args_text(plan_of(path))


def test_model_decode_attention_auto_takes_tensor_cores_where_the_shape_allows():
    path = rule_file("model.decode-attention")
    plan = plan_of(path)  # head dim 8: the tensor-core kernel does not take it
    assert plan.model.decode_attention == "cuda_cores"
    d = decision(plan, "model.decode-attention")
    assert d.severity == "note" and not d.requested and d.key == "model.decode_attention"
    assert "head dim 8" in d.message and "16, 32, 64, 128" in d.message
    s = plan.settings["model.decode_attention"]
    assert (s.source.kind, s.source.rule) == ("derived", "model.decode-attention")
    # A preset's shape runs on tensor cores, silently; a written choice is the user's and needs no rule.
    preset = plan_of(rule_file("memory.prefill-chunk-alone-cached"))  # the 30B preset on a GPU
    assert preset.model.decode_attention == "tensor_cores"
    assert "model.decode-attention" not in [x.rule for x in preset.decisions]
    asked = plan_of(path, ['model.decode_attention="cuda_cores"'])
    assert asked.model.decode_attention == "cuda_cores"
    assert asked.settings["model.decode_attention"].source.kind == "user"
    assert "model.decode-attention" not in [x.rule for x in asked.decisions]
    # On virtual CPU devices the choice does nothing, and the plan says nothing about it.
    cpu = plan_of(rule_file("spec.needs-mtp-weights"))
    assert "model.decode-attention" not in [x.rule for x in cpu.decisions]


def test_machine_host_ram_probed_reads_mem_available_and_says_so():
    plan = plan_of(rule_file("machine.host-ram-probed"), **PROBES["machine.host-ram-probed"])
    s = plan.settings["machine.host_ram_mib"]
    assert (s.value, s.source.kind, s.source.rule) == (
        251658240 // 1024,
        "derived",
        "machine.host-ram-probed",
    )
    assert plan.machine.host_ram_source == "probe" and plan.host.ram == 251658240 * 1024
    assert "probed from /proc/meminfo" in decision(plan, "machine.host-ram-probed").message


def test_machine_estimated_bandwidth_flags_an_unknown_probed_card():
    plan = plan_of(
        rule_file("machine.estimated-bandwidth"), probe=lambda: "0, Mystery Accelerator 9000, 24576\n"
    )
    (gpu,) = plan.machine.gpus
    assert plan.machine.source == "probe"
    assert gpu.bandwidth_estimated and gpu.vram_mib == 24576
    assert "estimate" in decision(plan, "machine.estimated-bandwidth").message


# ---- step 1 -------------------------------------------------------------------------------------


def test_split_remote_host_is_refused_as_not_built():
    p = problem(problems_of(rule_file("split.remote-host")), "split.remote-host")
    assert p.key == "split.devices.1" and p.line == line_of(rule_file("split.remote-host"), "devices")
    assert "node2" in p.message and "not built" in p.message


def test_experts_peer_with_split_is_refused():
    p = problem(problems_of(rule_file("experts.peer-with-split")), "experts.peer-with-split")
    assert p.key == "experts.peer_device" and p.line == line_of(
        rule_file("experts.peer-with-split"), "peer_device"
    )


def test_experts_peer_with_helpers_is_refused():
    p = problem(problems_of(rule_file("experts.peer-with-helpers")), "experts.peer-with-helpers")
    assert "helper" in p.message and p.line == line_of(rule_file("experts.peer-with-helpers"), "peer_device")


def test_split_rising_refuses_falling_boundaries():
    p = problem(problems_of(rule_file("split.rising")), "split.rising")
    assert p.key == "split.layers" and "[3, 2]" in p.message


def test_split_range_names_the_boundary_outside_the_layers():
    p = problem(problems_of(rule_file("split.range")), "split.range")
    assert p.key == "split.layers.0" and "below 4" in p.message
    assert p.line == line_of(rule_file("split.range"), "layers")


def test_split_max_stages_refuses_more_than_eight():
    p = problem(problems_of(rule_file("split.max-stages")), "split.max-stages")
    assert "10 stages" in p.message and "at most 8" in p.message


def test_split_too_many_devices_refuses_more_devices_than_gpus():
    problems = problems_of(rule_file("split.too-many-devices"))
    p = problem(problems, "split.too-many-devices")
    assert "3 split devices" in p.message and "2 GPUs" in p.message
    assert problem(problems, "machine.device-missing").key == "split.devices.2"


def test_split_device_count_wants_one_gpu_per_stage():
    problems = problems_of(rule_file("split.device-count"))
    p = problem(problems, "split.device-count")
    assert "1 device for 2 stages" in p.message
    assert [q.rule for q in problems] == ["split.device-count"]


def test_machine_device_missing_names_the_key():
    p = problem(problems_of(rule_file("machine.device-missing")), "machine.device-missing")
    assert p.key == "experts.helper_devices.0" and "GPU 5 does not exist" in p.message


def test_split_shared_gpu_needs_the_test_flag():
    p = problem(problems_of(rule_file("split.shared-gpu")), "split.shared-gpu")
    assert "test_shared_gpu" in p.message


def test_experts_helper_is_stage_is_refused():
    p = problem(problems_of(rule_file("experts.helper-is-stage")), "experts.helper-is-stage")
    assert p.key == "experts.helper_devices.0" and "GPU 1 holds a stage" in p.message


def test_split_auto_single_gpu_gives_one_stage_with_a_note():
    plan = plan_of(rule_file("split.auto-single-gpu"))
    assert len(plan.stages) == 1 and plan.stages[0].layers == (0, 4)
    assert decision(plan, "split.auto-single-gpu").severity == "note"
    assert plan.settings["split.layers"].value == []


# ---- step 2 -------------------------------------------------------------------------------------


def test_batch_single_slot_means_no_batching():
    plan = plan_of(rule_file("batch.single-slot"))
    assert (plan.batch.mode, plan.batch.slots) == ("solo", 1)
    assert decision(plan, "batch.single-slot").severity == "note"


def test_batch_test_split_turns_batching_off():
    plan = plan_of(rule_file("batch.test-split"))
    assert plan.split_test_shared_gpu and plan.batch.mode == "solo"
    assert [s.gpu for s in plan.stages] == [0, 0]
    assert decision(plan, "batch.test-split").requested


def test_batch_max_slots_clamps_plain_batching_to_eight():
    plan = plan_of(rule_file("batch.max-slots"))
    assert plan.batch.slots == 8 and not plan.batch.mtp
    assert plan.settings["batch.slots"].requested == 12
    assert decision(plan, "batch.max-slots").severity == "clamp"


def test_batch_max_slots_leaves_batch_mtp_slots_alone():
    plan = plan_of(rule_file("windows.batch-mtp-rotation"), ["batch.slots=12"])
    assert plan.batch.slots == 12 and plan.batch.mtp
    assert not any(d.rule == "batch.max-slots" for d in plan.decisions)


# ---- step 3 -------------------------------------------------------------------------------------


def _batch_mtp_off(rule_id: str, sets=()) -> str:
    plan = plan_of(rule_file(rule_id), sets)
    assert not plan.batch.mtp
    off = [d for d in plan.decisions if d.key == "batch.mtp" and d.severity == "off"]
    assert [d.rule for d in off] == [rule_id], "exactly one reason turns batch MTP off: the first failing one"
    assert off[0].requested and off[0].origin is not None
    assert plan.settings["batch.mtp"].source.kind == "forced"
    return off[0].message


def test_batch_mtp_needs_batching():
    assert "batching is off" in _batch_mtp_off("batch-mtp.needs-batching")


def test_batch_mtp_needs_mtp_weights():
    assert "no MTP weights" in _batch_mtp_off("batch-mtp.needs-mtp-weights")


def test_batch_mtp_needs_spec():
    assert "spec.draft_tokens = 1" in _batch_mtp_off("batch-mtp.needs-spec")


def test_batch_mtp_spec_ngram_turns_batch_mtp_and_its_drafters_off():
    message = _batch_mtp_off("batch-mtp.spec-ngram")
    assert 'spec.method = "ngram"' in message
    plan = plan_of(rule_file("batch-mtp.spec-ngram"))
    assert plan.model.facts.has_mtp
    off = decision(plan, "batch-mtp.spec-ngram")
    assert off.because == ("spec.method",) and off.severity == "off"
    assert "batch-mtp.spec-ngram" in plan.settings["spec.method"].rules
    assert (plan.spec.ngram, plan.spec.mtp, plan.windows.solo_rows) == (True, False, 4)
    # Nothing drafts with the MTP head: no drafters, no MTP head, no drafter memory.
    last = plan.stages[-1]
    assert last.drafters == () and "drafters" not in last.holds and "mtp" not in last.holds
    assert all(g.budget.drafters == 0 for g in plan.gpus)
    # The same profile drafting with MTP runs batch MTP with a drafter per slot.
    mtp = plan_of(rule_file("batch-mtp.spec-ngram"), ['spec.method="mtp"'])
    assert mtp.batch.mtp and mtp.spec.mtp and not mtp.spec.ngram
    assert mtp.stages[-1].drafters == (0, 1) and "mtp" in mtp.stages[-1].holds
    assert sum(g.budget.drafters for g in mtp.gpus) > 0


def test_batch_mtp_shared_gpu_is_a_reason_when_batching_survives():
    led = Ledger()
    led.take("batch.slots", 2, 1)
    led.take("batch.mtp", True, False)
    led.take("spec.draft_tokens", 4, 4)
    led.take("spec.method", None, "mtp")
    led.take("experts.helper_devices", None, ())
    led.take("experts.remote_opt", None, False)
    topo = Topology(
        n_stages=2,
        devices=(0, 0),
        hosts=("local", "local"),
        auto=False,
        boundaries=(2,),
        usable=(0,),
        devices_given=True,
    )
    model = plan_of(rule_file("batch-mtp.needs-serve")).model.facts
    batch_mtp_gate(model, topo, led, serving=True)
    assert led["batch.mtp"] is False
    assert [d.rule for d in led.decisions] == ["batch-mtp.shared-gpu"]


def test_batch_mtp_needs_serve():
    assert "[serve]" in _batch_mtp_off("batch-mtp.needs-serve")


def test_batch_mtp_helper_caches():
    assert "helper" in _batch_mtp_off("batch-mtp.helper-caches")


def test_batch_mtp_remote_opt():
    assert "remote expert opt" in _batch_mtp_off("batch-mtp.remote-opt")


def test_batch_mtp_first_failing_reason_wins():
    # No serve table AND draft_tokens 1: needs-spec comes first in the order.
    message = _batch_mtp_off("batch-mtp.needs-spec", ["serve.port=9000"])
    assert "draft_tokens" in message


# ---- step 4 -------------------------------------------------------------------------------------


def test_groups_auto_takes_the_largest_divisor_up_to_the_stages():
    plan = plan_of(rule_file("groups.auto"))
    assert (plan.batch.groups, plan.batch.mode, plan.batch.slots_per_window) == (2, "pipelined", 2)
    s = plan.settings["batch.groups"]
    assert (s.value, s.source.kind, s.source.rule) == (2, "derived", "groups.auto")
    assert s.source.origin is not None  # the user wrote "auto" there


@pytest.mark.parametrize(
    ("slots", "stages", "groups"), [(4, 2, 2), (3, 2, 1), (6, 4, 3), (8, 4, 4), (5, 8, 5)]
)
def test_groups_auto_function(slots, stages, groups):
    assert auto_groups(slots, stages) == groups


def test_groups_batch_mtp_yield_keeps_one_group_and_says_why():
    plan = plan_of(rule_file("groups.batch-mtp-yield"))
    assert (plan.batch.groups, plan.batch.mode, plan.batch.mtp) == (1, "serial", True)
    d = decision(plan, "groups.batch-mtp-yield")
    assert not d.requested
    assert "one group of 2 slots" in d.message and "batch.groups = 2" in d.message


def test_groups_no_split_warns_and_uses_one_group():
    plan = plan_of(rule_file("groups.no-split"))
    assert plan.batch.groups == 1 and plan.batch.mode == "serial"
    d = decision(plan, "groups.no-split")
    assert d.severity == "warn" and d.requested


def test_groups_not_divisor_warns_and_uses_one_group():
    plan = plan_of(rule_file("groups.not-divisor"))
    assert plan.batch.groups == 1 and plan.batch.slots == 3
    assert "do not divide 3 slots" in decision(plan, "groups.not-divisor").message


def test_batch_mtp_pipelined_groups():
    message = _batch_mtp_off("batch-mtp.pipelined-groups")
    plan = plan_of(rule_file("batch-mtp.pipelined-groups"))
    assert (plan.batch.groups, plan.batch.mode) == (2, "pipelined")
    assert "pipelined slot groups" in message


@pytest.mark.parametrize(
    ("rule_id", "sets"),
    [
        ("batch-mtp.needs-mtp-weights", ["split.layers=[2]"]),
        ("batch-mtp.spec-ngram", ["split.layers=[2]"]),
        ("batch-mtp.needs-spec", ["split.layers=[2]"]),
        ("batch-mtp.needs-serve", ["split.layers=[2]"]),
        ("batch-mtp.helper-caches", []),
        ("batch-mtp.remote-opt", []),
    ],
)
def test_batch_mtp_refused_before_groups_leaves_the_split_its_pipelined_groups(rule_id, sets):
    # Groups fall to 1 only while batch MTP is still on. Every reason of step 3 turns it off first, so the
    # defaulted groups pipeline (2 groups of 1 on 2 stages) and no note claims that batch MTP runs. Resolving
    # groups before step 3 gives 1 serial group and a false groups.batch-mtp-yield note.
    plan = plan_of(rule_file(rule_id), sets)
    assert len(plan.stages) == 2
    b = plan.batch
    assert (b.slots, b.groups, b.mode, b.mtp, b.slots_per_window, b.rows_per_slot) == (
        2,
        2,
        "pipelined",
        False,
        1,
        1,
    )
    assert [d.rule for d in plan.decisions] == [rule_id, "groups.auto"]
    assert plan.settings["batch.groups"].source.rule == "groups.auto"


def test_batch_mtp_refused_by_pipelined_groups_keeps_the_explicit_groups():
    plan = plan_of(rule_file("batch-mtp.pipelined-groups"))
    b = plan.batch
    assert (b.slots, b.groups, b.mode, b.mtp, b.slots_per_window, b.rows_per_slot) == (
        2,
        2,
        "pipelined",
        False,
        1,
        1,
    )
    assert [d.rule for d in plan.decisions] == ["batch-mtp.pipelined-groups"]
    assert plan.settings["batch.groups"].source.kind == "user"


def test_batch_mtp_refused_for_one_slot_on_a_split_runs_solo():
    plan = plan_of(rule_file("batch-mtp.needs-batching"), ["split.layers=[2]"])
    assert (plan.batch.slots, plan.batch.groups, plan.batch.mode, plan.batch.mtp) == (1, 1, "solo", False)
    assert [d.rule for d in plan.decisions] == ["batch.single-slot", "batch-mtp.needs-batching"]


def test_batch_mtp_in_groups_runs_batch_mtp_inside_each_pipelined_group():
    plan = plan_of(rule_file("batch-mtp.in-groups"))
    b = plan.batch
    assert (b.slots, b.groups, b.mode, b.mtp, b.mtp_in_groups) == (4, 2, "pipelined", True, True)
    assert (b.slots_per_window, b.rows_per_slot, plan.windows.batch_rows) == (2, 2, 4)
    assert plan.stages[-1].drafters == (0, 1, 2, 3) and plan.gpus[1].budget.drafters > 0
    d = decision(plan, "batch-mtp.in-groups")
    assert d.key == "batch.mtp" and set(d.because) == {"batch.groups", "batch.mtp_in_groups"}
    assert "2 slots (4 rows) per group window" in d.message
    assert not any(d.severity == "off" for d in plan.decisions)
    assert plan.settings["batch.mtp"].gates[-1] == "batch-mtp.pipelined-groups"  # checked, and passed


def test_batch_mtp_in_groups_too_many_slots_is_refused_by_name():
    path = rule_file("batch-mtp.in-groups-too-many-slots")
    p = problem(problems_of(path), "batch-mtp.in-groups-too-many-slots")
    assert (p.key, p.line) == ("batch.groups", line_of(path, "groups = 2"))
    assert "10 slots in 2 groups is 5 per group" in p.message and "set batch.groups = 5" in p.message


def test_batch_mtp_in_groups_leaves_the_defaulted_case_as_written():
    # groups unset with batch MTP on: still one group, so plain batch MTP runs; only the note's sentence
    # says what writing groups = 2 would now do
    plan = plan_of(rule_file("groups.batch-mtp-yield"), ["batch.mtp_in_groups=true"])
    b = plan.batch
    assert (b.groups, b.mode, b.mtp, b.mtp_in_groups) == (1, "serial", True, False)
    assert [d.rule for d in plan.decisions] == ["groups.batch-mtp-yield", "batch-mtp.all-experts-resident"]
    d = decision(plan, "groups.batch-mtp-yield")
    assert "batch.groups = 2 would run batch MTP inside 2 pipelined groups" in d.message


def test_batch_mtp_in_groups_off_keeps_turning_batch_mtp_off_for_explicit_groups():
    plan = plan_of(rule_file("batch-mtp.in-groups"), ["batch.mtp_in_groups=false"])
    assert (plan.batch.groups, plan.batch.mode, plan.batch.mtp, plan.batch.mtp_in_groups) == (
        2,
        "pipelined",
        False,
        False,
    )
    assert [d.rule for d in plan.decisions] == ["batch-mtp.pipelined-groups"]


# ---- step 5 -------------------------------------------------------------------------------------


def _windows_off(rule_id: str) -> str:
    plan = plan_of(rule_file(rule_id))
    assert plan.spec.pipeline_windows == 0
    off = [d for d in plan.decisions if d.key == "split.pipeline_windows"]
    assert [d.rule for d in off] == [rule_id]
    assert off[0].requested
    return off[0].message


def test_pipeline_windows_needs_split():
    assert "no layer split" in _windows_off("pipeline-windows.needs-split")


def test_pipeline_windows_shared_gpu():
    assert "test split" in _windows_off("pipeline-windows.shared-gpu")


def test_pipeline_windows_two_stages():
    assert "3 stages" in _windows_off("pipeline-windows.two-stages")


def test_pipeline_windows_needs_mtp():
    assert "MTP" in _windows_off("pipeline-windows.needs-mtp")


def test_pipeline_windows_needs_mtp_names_spec_method_under_ngram_lookup():
    plan = plan_of(rule_file("pipeline-windows.needs-mtp"), ["spec.draft_tokens=4", *NGRAM])
    assert plan.spec.ngram and plan.spec.pipeline_windows == 0
    d = decision(plan, "pipeline-windows.needs-mtp")
    assert "n-gram lookup" in d.message and d.because == ("spec.method",)


def test_pipeline_windows_batch():
    assert "batch slots" in _windows_off("pipeline-windows.batch")


def test_pipeline_windows_peer_device_is_a_reason_on_a_two_stage_split():
    led = Ledger()
    led.take("split.pipeline_windows", 1, 0)
    led.take("spec.draft_tokens", 4, 4)
    led.take("spec.method", None, "mtp")
    led.take("batch.slots", None, 1)
    led.take("experts.peer_device", 3, None)
    led.take("experts.helper_devices", None, ())
    led.take("split.test_shared_gpu", None, False)
    topo = Topology(
        n_stages=2,
        devices=(0, 1),
        hosts=("local", "local"),
        auto=False,
        boundaries=(2,),
        usable=(0, 1, 2),
        devices_given=False,
    )
    model = plan_of(rule_file("batch-mtp.needs-serve")).model.facts
    pipeline_windows_gate(model, topo, led)
    assert led["split.pipeline_windows"] == 0
    assert [d.rule for d in led.decisions] == ["pipeline-windows.peer-device"]


def test_pipeline_windows_helper_caches():
    assert "helper" in _windows_off("pipeline-windows.helper-caches")


def test_pipeline_windows_stay_on_when_every_reason_passes():
    plan = plan_of(rule_file("pipeline-windows.batch"), ["batch.slots=1"])
    assert plan.spec.pipeline_windows == 1


# ---- step 6 -------------------------------------------------------------------------------------


def test_split_auto_balances_and_records_the_boundaries():
    plan = plan_of(rule_file("split.auto"))
    s = plan.settings["split.layers"]
    assert s.source.kind == "derived" and s.source.rule == "split.auto"
    assert [st.layers[0] for st in plan.stages[1:]] == s.value
    assert "predicted decode step" in decision(plan, "split.auto").message


def test_split_auto_order_puts_the_faster_gpu_last():
    plan = plan_of(rule_file("split.auto-order"))
    assert [s.gpu for s in plan.stages] == [1, 0]
    assert plan.machine.gpus[plan.stages[-1].gpu].name == "fast virtual device"
    assert plan.settings["split.devices"].value == [1, 0]
    assert not decision(plan, "split.auto-order").requested


def test_split_auto_no_fit_is_refused():
    p = problem(problems_of(rule_file("split.auto-no-fit")), "split.auto-no-fit")
    assert p.key == "split.layers" and "fits" in p.message


# ---- step 7 -------------------------------------------------------------------------------------


def test_budget_overflow_prints_the_whole_breakdown():
    p = problem(problems_of(rule_file("budget.overflow")), "budget.overflow")
    for term in ("weights", "kv", "drafters", "workspace", "reserve", "MiB short"):
        assert term in p.message
    assert p.line == line_of(rule_file("budget.overflow"), "[memory]")


def test_experts_cache_too_small_is_refused():
    p = problem(problems_of(rule_file("experts.cache-too-small")), "experts.cache-too-small")
    assert "room for 7 experts" in p.message and "8 one window" in p.message


def test_experts_cache_holds_what_fits():
    plan = plan_of(rule_file("experts.cache"))
    g0 = plan.gpus[0]
    assert g0.experts_resident < g0.experts_total
    assert g0.budget.experts == g0.experts_resident * plan.model.facts.expert_bytes()
    assert g0.budget.free < plan.model.facts.expert_bytes()  # nothing that could hold one more expert
    assert plan.experts.cache == g0.experts_resident == plan.settings["experts.cache"].value
    assert f"holds {g0.experts_resident} of its {g0.experts_total}" in decision(plan, "experts.cache").message


def test_batch_mtp_all_experts_resident_notes_the_measurement():
    plan = plan_of(rule_file("batch-mtp.all-experts-resident"))
    assert plan.batch.mtp and all(g.experts_resident == g.experts_total for g in plan.gpus)
    assert "slower" in decision(plan, "batch-mtp.all-experts-resident").message
    assert plan.experts.cache is None


def test_batch_mtp_all_experts_resident_keeps_its_text_until_our_own_measurement_replaces_it():
    # The sentence cites the reference engine's measurement; it changes only when this project's bench
    # has measured the same trade-off (docs/PERFORMANCE.md), and then on purpose.
    d = decision(plan_of(rule_file("batch-mtp.all-experts-resident")), "batch-mtp.all-experts-resident")
    assert (d.key, d.severity, d.message) == (
        "batch.mtp",
        "note",
        "every expert is resident in VRAM: batch MTP pays when experts do not all fit; with all resident it "
        "measured slower than pipelined groups (set batch.mtp = false to pipeline)",
    )


def test_batch_mtp_all_experts_resident_is_silent_when_experts_stream():
    sets = ["batch.slots=2", "batch.mtp=true", "serve.port=8000", "memory.context=900"]
    plan = plan_of(rule_file("experts.cache"), sets)
    assert plan.gpus[0].experts_resident < plan.gpus[0].experts_total
    assert plan.batch.mtp
    assert not any(d.rule == "batch-mtp.all-experts-resident" for d in plan.decisions)


def test_host_ram_overflow_names_the_key_its_line_and_the_mib():
    path = rule_file("host.ram-overflow")
    p = problem(problems_of(path), "host.ram-overflow")
    assert (p.key, p.line) == ("machine.host_ram_mib", line_of(path, "host_ram_mib"))
    assert "need 0.8 MiB of pinned host memory" in p.message and "machine.host_ram_mib is 1 MiB" in p.message
    assert "memory.host_reserve_mib = 1 MiB" in p.message


# ---- steps 8 and 9 ------------------------------------------------------------------------------


def test_windows_batch_mtp_rotation_over_more_than_four_slots():
    plan = plan_of(rule_file("windows.batch-mtp-rotation"))
    assert (plan.batch.slots, plan.batch.slots_per_window, plan.windows.batch_rows) == (6, 4, 8)
    assert plan.windows.handoff_rows == 8
    assert plan.gpus[0].all_experts_resident
    assert "serial windows carry them all" in decision(plan, "windows.batch-mtp-rotation").message
    streaming = plan_of(rule_file("windows.batch-mtp-rotation"), ["experts.cache=6"])
    assert not streaming.gpus[0].all_experts_resident
    assert "take turns" in decision(streaming, "windows.batch-mtp-rotation").message


def test_windows_adaptive_depth_inert_where_solo_windows_do_not_draft():
    plan = plan_of(rule_file("windows.adaptive-depth-inert"))
    d = decision(plan, "windows.adaptive-depth-inert")
    assert d.requested and d.key == "spec.adaptive_depth" and "spec.draft_tokens = 0" in d.message
    assert plan.windows.solo_rows == 1 and plan.settings["spec.adaptive_depth"].value is True
    assert not plan.spec.adaptive_depth  # the plan says what runs: nothing drafts, so nothing adapts
    drafting = plan_of(rule_file("windows.adaptive-depth-inert"), ["spec.draft_tokens=3"])
    assert "windows.adaptive-depth-inert" not in [x.rule for x in drafting.decisions]
    [p] = problems_of(rule_file("windows.adaptive-depth-inert"), strict=True)
    assert p.key == "spec.adaptive_depth" and p.file.endswith("windows.adaptive-depth-inert.toml")
    assert p.line == line_of(rule_file("windows.adaptive-depth-inert"), "adaptive_depth")


def test_windows_prefix_reuse_calibrated_says_only_a_repeated_prompt_reuses_a_slot():
    from strata_cfg.report.plan_text import plan_text

    plan = plan_of(rule_file("windows.prefix-reuse-calibrated"))
    d = decision(plan, "windows.prefix-reuse-calibrated")
    assert d.key == "memory.prefix_reuse" and not d.requested and "model.routing" in d.because
    assert plan.memory.prefix_reuse and plan.model.routing == "calibrated"  # a note: reuse stays on
    assert "prefix reuse on" in plan_text(plan)
    off = plan_of(rule_file("windows.prefix-reuse-calibrated"), ["memory.prefix_reuse=false"])
    assert "windows.prefix-reuse-calibrated" not in [x.rule for x in off.decisions]
    assert not off.memory.prefix_reuse and "prefix reuse off" in plan_text(off)
    assert off.settings["memory.prefix_reuse"].source.kind != "default"
    uniform = plan_of(rule_file("windows.prefix-reuse-calibrated"), ['model.routing="uniform"'])
    assert "windows.prefix-reuse-calibrated" not in [x.rule for x in uniform.decisions]
    assert uniform.memory.prefix_reuse and uniform.settings["memory.prefix_reuse"].source.kind == "default"
    assert plan_of(rule_file("windows.prefix-reuse-calibrated"), strict=True).memory.prefix_reuse  # a note


def test_windows_prompt_graph_rows_sends_prompts_past_one_window_to_the_prefill_graphs():
    """With the prefill path's chunks replayed as graphs, one 16-row graph reads faster than two windows;
    launched layer by layer (``memory.prefill_graph_rows = 0``), two windows still cost less."""
    path = rule_file("windows.prompt-graph-rows")
    plan = plan_of(path)
    assert plan.memory.prompt_graph_rows == 8 and plan.memory.prefill_graph_rows == 512
    d = decision(plan, "windows.prompt-graph-rows")
    assert d.severity == "note" and d.key == "memory.prompt_graph_rows"
    assert "up to 8 rows" in d.message and "1 window " in d.message and "16-row graph" in d.message
    s = plan.settings["memory.prompt_graph_rows"]
    assert (s.value, s.source.kind, s.source.rule) == (8, "derived", "windows.prompt-graph-rows")
    from strata_cfg.report.plan_text import plan_text

    text = plan_text(plan)
    assert "prefill chunk 512, graph windows up to 8 rows, prefill graphs up to 512 rows\n" in text
    launched = plan_of(path, ["memory.prefill_graph_rows=0"])
    assert launched.memory.prompt_graph_rows == 16
    d = decision(launched, "windows.prompt-graph-rows")
    assert "up to 16 rows" in d.message and "2 windows" in d.message and "49 layers" in d.message
    assert "prefill chunk 512, graph windows up to 16 rows\n" in plan_text(launched)
    # A number is taken as written, with no note.
    written = plan_of(path, ["memory.prompt_graph_rows=40"])
    assert (
        written.memory.prompt_graph_rows == 40
        and written.settings["memory.prompt_graph_rows"].source.kind == "user"
    )
    assert "windows.prompt-graph-rows" not in [x.rule for x in written.decisions]
    # Virtual CPU devices have no prefill path: all 64 rows, quietly.
    cpu = plan_of(path, ["machine.backend=cpu"])
    assert cpu.memory.prompt_graph_rows == 64
    assert "windows.prompt-graph-rows" not in [x.rule for x in cpu.decisions]


def test_windows_prompt_graph_rows_sends_chunks_past_one_window_to_the_prefill_path_under_an_expert_cache():
    """Under a cache the prefill path reads each expert a chunk routes to once, where graph windows read it
    again in every window, over the host link for the experts in host memory: one window's rows at most,
    with a note that says why; a number is still taken as written."""
    path = PROFILES / "emulate" / "h200-24g.toml"
    plan = plan_of(path)
    assert plan.experts.cache is not None and plan.memory.prompt_graph_rows == 8
    d = decision(plan, "windows.prompt-graph-rows")
    assert d.severity == "note" and "under an expert cache" in d.message and "host link" in d.message
    s = plan.settings["memory.prompt_graph_rows"]
    assert (s.value, s.source.kind) == (8, "derived")
    assert plan_of(path, ["memory.prompt_graph_rows=64"]).memory.prompt_graph_rows == 64
    whole = plan_of(path, ['machine.gpus=[{name="H200", vram_mib=143771, bandwidth_gbs=4800}]'])
    assert (
        whole.experts.cache is None
        and "under an expert cache" not in decision(whole, "windows.prompt-graph-rows").message
    )


@pytest.mark.parametrize(
    ("value", "says"),
    [("4", "greater than or equal to 8"), ("65", "less than or equal to 64"), ('"some"', "a valid integer")],
)
def test_windows_prompt_graph_rows_refuses_values_outside_8_to_64(tmp_path, value, says):
    p = _memory_refusal(tmp_path, "windows.prompt-graph-rows", "prompt_graph_rows", value)
    assert says in p.message and "'auto'" in p.message and value.strip('"') in p.message


def _memory_refusal(tmp_path, rule_id: str, key: str, value: str):
    """The one problem of rule ``rule_id``'s profile with ``memory.<key> = value`` added, which must name
    that key, its line and the file."""
    path = tmp_path / "p.toml"
    path.write_text(rule_file(rule_id).read_text() + f"[memory]\n{key} = {value}\n")
    [p] = problems_of(path)
    assert p.key == f"memory.{key}" and p.line == line_of(path, key) and p.file.endswith("p.toml")
    return p


def test_windows_prefill_graph_rows_replays_chunks_up_to_512_rows_on_a_gpu():
    path = rule_file("windows.prefill-graph-rows")
    plan = plan_of(path)
    assert plan.memory.prefill_graph_rows == 512
    d = decision(plan, "windows.prefill-graph-rows")
    assert d.severity == "note" and d.key == "memory.prefill_graph_rows" and "up to 512 rows" in d.message
    s = plan.settings["memory.prefill_graph_rows"]
    assert (s.value, s.source.kind, s.source.rule) == (512, "derived", "windows.prefill-graph-rows")
    from strata_cfg.report.plan_text import plan_text

    assert ", prefill graphs up to 512 rows\n" in plan_text(plan)
    # The workspace keeps a 512-row graph's temporaries and every graph size's inputs on the stage, and a
    # set of its own for the MTP head where it drafts.
    from strata_cfg.resolve.sizes import prefill_graph_bytes

    stage, mtp = (prefill_graph_bytes(plan.model.facts, 512, mtp=flag) for flag in (False, True))
    mib = f"keep {stage / (1 << 20):.1f} MiB of workspace a stage (and {mtp / (1 << 20):.1f} MiB"
    assert mib in d.message
    off = plan_of(path, ["memory.prefill_graph_rows=0"])
    drafting = plan.spec.mtp or plan.batch.mtp
    assert drafting and plan.gpus[0].budget.workspace - off.gpus[0].budget.workspace == stage + mtp
    # The graph of the longest chunk, where it is smaller; a number is taken as written.
    short = plan_of(path, ["memory.prefill_chunk=100", "memory.prefill_chunk_alone=100"])
    assert short.memory.prefill_graph_rows == 128
    written = plan_of(path, ["memory.prefill_graph_rows=64"])
    assert written.settings["memory.prefill_graph_rows"].source.kind == "user"
    assert written.memory.prefill_graph_rows == 64
    assert "windows.prefill-graph-rows" not in [x.rule for x in written.decisions]
    # Virtual CPU devices have no prefill path: none, quietly.
    cpu = plan_of(path, ["machine.backend=cpu"])
    assert cpu.memory.prefill_graph_rows == 0 and "prefill graphs" not in plan_text(cpu)
    assert "windows.prefill-graph-rows" not in [x.rule for x in cpu.decisions]


@pytest.mark.parametrize(
    ("value", "says"), [("-1", "greater than or equal to 0"), ('"all"', "a valid integer")]
)
def test_windows_prefill_graph_rows_refuses_what_is_not_a_row_count(tmp_path, value, says):
    p = _memory_refusal(tmp_path, "windows.prefill-graph-rows", "prefill_graph_rows", value)
    assert says in p.message and "'auto'" in p.message


def test_memory_prefill_graphs_cpu_sets_a_number_to_0_and_keeps_no_workspace_for_it():
    path = rule_file("memory.prefill-graphs-cpu")
    plan = plan_of(path)
    assert plan.memory.prefill_graph_rows == 0
    d = decision(plan, "memory.prefill-graphs-cpu")
    assert (
        d.severity == "note" and d.requested and d.key == "memory.prefill_graph_rows" and "256" in d.message
    )
    assert d.origin is not None and d.origin.line == line_of(path, "prefill_graph_rows")
    unset = plan_of(path, ["memory.prefill_graph_rows=0"])
    assert [g.budget for g in plan.gpus] == [g.budget for g in unset.gpus]
    assert "memory.prefill-graphs-cpu" not in [x.rule for x in unset.decisions]


def test_windows_prefill_graphs_cached_turns_them_off_and_keeps_no_workspace_for_them():
    """Under an expert cache a chunk copies host experts as it runs: no graphs, and the budget keeps no
    graph workspace, so the cache holds as many experts as with prefill graphs off."""
    path = rule_file("windows.prefill-graphs-cached")
    plan = plan_of(path)
    assert plan.experts.cache is not None and plan.memory.prefill_graph_rows == 0
    d = decision(plan, "windows.prefill-graphs-cached")
    assert d.severity == "note" and d.key == "memory.prefill_graph_rows" and "512 rows" in d.message
    assert "windows.prefill-graph-rows" not in [x.rule for x in plan.decisions]  # no graphs to note
    off = plan_of(path, ["memory.prefill_graph_rows=0"])
    assert plan.gpus[0].budget == off.gpus[0].budget
    assert plan.gpus[0].experts_resident == off.gpus[0].experts_resident


def test_windows_prefill_graphs_some_cached_names_the_gpus_that_launch_their_chunks():
    plan = plan_of(rule_file("windows.prefill-graphs-some-cached"))
    big, small = plan.gpus
    assert big.experts_resident == big.experts_total and small.experts_resident < small.experts_total
    assert plan.memory.prefill_graph_rows == 512
    d = decision(plan, "windows.prefill-graphs-some-cached")
    assert d.severity == "note" and "GPU 1" in d.message and "GPU 0" not in d.message
    assert "up to 512 rows" in decision(plan, "windows.prefill-graph-rows").message
    # The workspace of the prefill graphs is kept on the H200 only.
    off = plan_of(rule_file("windows.prefill-graphs-some-cached"), ["memory.prefill_graph_rows=0"])
    assert big.budget.workspace > off.gpus[0].budget.workspace
    assert small.budget.workspace == off.gpus[1].budget.workspace


def test_serve_exposed_warns_and_strict_refuses():
    plan = plan_of(rule_file("serve.exposed"))
    assert decision(plan, "serve.exposed").severity == "warn"
    p = problem(problems_of(rule_file("serve.exposed"), strict=True), "serve.exposed")
    assert p.key == "serve.host" and "strict" in p.message


def test_serve_exposed_is_quiet_with_an_api_key_env():
    plan = plan_of(rule_file("serve.exposed"), ["serve.api_key_env=STRATA_KEY"])
    assert not any(d.rule == "serve.exposed" for d in plan.decisions)
    assert plan.serve is not None and plan.serve.api_key_env == "STRATA_KEY"


# ---- strict mode --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rule_id",
    [
        "batch-mtp.pipelined-groups",
        "batch-mtp.needs-serve",
        "memory.context-cap",
        "groups.no-split",
        "model.cpu-float32",
    ],
)
def test_strict_refuses_what_overrode_an_explicit_ask(rule_id):
    p = problem(problems_of(rule_file(rule_id), strict=True), rule_id)
    assert p.message.startswith("strict: ") and p.line is not None


def test_strict_accepts_notes_that_override_nothing():
    plan = plan_of(rule_file("groups.batch-mtp-yield"), strict=True)
    assert plan.strict and plan.batch.mtp


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


def test_serve_max_queued_reaches_the_plan_and_its_text_and_a_negative_one_is_refused():
    from strata_cfg.report.plan_text import plan_text

    plan = plan_of(rule_file("serve.exposed"), ["serve.max_queued=6"])
    assert plan.serve is not None and plan.serve.max_queued == 6
    assert ", at most 6 waiting for a slot" in plan_text(plan)
    unbounded = plan_of(rule_file("serve.exposed"))
    assert unbounded.serve is not None and unbounded.serve.max_queued is None
    assert "waiting for a slot" not in plan_text(unbounded) and "warm-up" not in plan_text(unbounded)
    assert ", no warm-up" in plan_text(plan_of(rule_file("serve.exposed"), ["serve.warm_up=false"]))
    [p] = problems_of(rule_file("serve.exposed"), sets=["serve.max_queued=-1"])
    assert p.key == "serve.max_queued" and "greater than or equal to 0" in p.message


def test_serve_recoveries_and_step_timeout_reach_the_plan_and_its_text_and_negatives_are_refused():
    from strata_cfg.report.plan_text import plan_text

    default = plan_of(rule_file("serve.exposed"))
    assert default.serve is not None
    assert (default.serve.recoveries, default.serve.step_timeout_s) == (3, 300.0)
    serve_line = next(line for line in plan_text(default).splitlines() if "http://" in line)
    assert "recover" not in serve_line and "step" not in serve_line
    plan = plan_of(rule_file("serve.exposed"), ["serve.recoveries=5", "serve.step_timeout_s=45"])
    assert plan.serve is not None and (plan.serve.recoveries, plan.serve.step_timeout_s) == (5, 45.0)
    assert ", recovers from 5 failed steps in 10 min, a step hung after 45 s" in plan_text(plan)
    off = plan_of(rule_file("serve.exposed"), ["serve.recoveries=0", "serve.step_timeout_s=0"])
    assert ", exits at a failed step, no step timeout" in plan_text(off)
    for key in ("serve.recoveries", "serve.step_timeout_s"):
        [p] = problems_of(rule_file("serve.exposed"), sets=[f"{key}=-1"])
        assert p.key == key and "greater than or equal to 0" in p.message


def test_the_launch_summary_says_how_many_requests_may_wait():
    from strata_cfg.launch.summary import summary

    capped = plan_of(rule_file("serve.exposed"), ["serve.max_queued=4"])
    [line] = [x for x in summary(capped) if x.startswith("  serve:")]
    assert line.endswith("; at most 4 request(s) waiting for a slot, then 429")
    [line] = [x for x in summary(plan_of(rule_file("serve.exposed"))) if x.startswith("  serve:")]
    assert "waiting" not in line and "browsers" not in line
    pages = plan_of(rule_file("serve.exposed"), ['serve.allowed_origins=["http://localhost:3000"]'])
    [line] = [x for x in summary(pages) if x.startswith("  serve:")]
    assert line.endswith("; browsers from http://localhost:3000")


def test_serve_allowed_origins_reach_the_plan_and_a_path_is_refused_naming_the_key():
    from strata_cfg.report.plan_text import plan_text

    plan = plan_of(rule_file("serve.exposed"), ['serve.allowed_origins=["http://localhost:3000", "*"]'])
    assert plan.serve is not None and plan.serve.allowed_origins == ("http://localhost:3000", "*")
    assert ", browsers from http://localhost:3000, *" in plan_text(plan)
    none = plan_of(rule_file("serve.exposed"))
    assert none.serve is not None and none.serve.allowed_origins == ()
    [p] = problems_of(rule_file("serve.exposed"), sets=['serve.allowed_origins=["http://localhost:3000/"]'])
    assert (
        p.key.startswith("serve.allowed_origins") and "'http://localhost:3000/' is not an origin" in p.message
    )


def test_experts_policy_inert_where_no_cache_adapts():
    """A policy key written where every expert is resident is noted (strict mode refuses it, naming its
    line); under a cache it is taken, and with experts.adapt = false only the adaptation's keys are inert."""
    path = rule_file("experts.policy-inert")
    plan = plan_of(path)
    d = decision(plan, "experts.policy-inert")
    assert d.key == "experts.max_swaps" and "every expert is resident" in d.message
    [p] = problems_of(path, strict=True)
    assert p.key == "experts.max_swaps" and p.line == line_of(path, "max_swaps")
    cached = rule_file("experts.cache")
    taken = plan_of(cached, ["experts.max_swaps=64"])
    assert taken.experts.cache is not None and taken.experts.max_swaps == 64
    assert "experts.policy-inert" not in [x.rule for x in taken.decisions]
    frozen = plan_of(cached, ["experts.max_swaps=64", "experts.adapt=false"])
    notes = [x for x in frozen.decisions if x.rule == "experts.policy-inert"]
    assert [x.key for x in notes] == ["experts.max_swaps"] and "experts.adapt = false" in notes[0].message
    # experts.recall_stored is the cache's too, and also does nothing without a prefix store to copy from.
    stored = plan_of(cached, ["experts.recall_stored=false", "memory.prefix_store_mib=256"])
    assert stored.experts.recall_stored is False
    assert "experts.policy-inert" not in [x.rule for x in stored.decisions]
    alone = plan_of(cached, ["experts.recall_stored=false"])
    [note] = [x for x in alone.decisions if x.rule == "experts.policy-inert"]
    assert note.key == "experts.recall_stored" and "without a prefix store" in note.message
    resident = plan_of(path, ["experts.recall_stored=true", "memory.prefix_store_mib=256"])
    notes = [x.key for x in resident.decisions if x.rule == "experts.policy-inert"]
    assert "experts.recall_stored" in notes


@pytest.mark.parametrize("most", [512, 64])
def test_the_cache_note_states_the_most_a_rebalance_copies_and_the_pause_it_brings(most):
    """The policy note of a cache that swaps gives the largest rebalance in bytes (``experts.max_swaps``
    experts of the model's size) and what the windows queued after it wait for over each named host link;
    that of a cache that keeps its misses (the default) the victims it queues, and that nothing waits."""
    from strata_cfg.resolve.budget import HOST_LINKS_GBS

    plan = plan_of(rule_file("experts.cache"), [f"experts.max_swaps={most}", "experts.keep_misses=false"])
    [note] = [d for d in plan.decisions if d.rule == "experts.cache" and d.key == "experts.adapt"]
    gb = most * plan.model.facts.expert_bytes() / 1e9
    assert f"at most {most} at a time: up to {gb:.1f} GB from host memory" in note.message
    for link, rate in HOST_LINKS_GBS:
        assert f"{1000 * gb / rate:.0f} ms over {link}" in note.message
    keeping = plan_of(rule_file("experts.cache"), [f"experts.max_swaps={most}"])
    [note] = [d for d in keeping.decisions if d.rule == "experts.cache" and d.key == "experts.adapt"]
    assert f"queues its {most} least used experts" in note.message and "no window waits" in note.message


def test_spec_draft_head_inert_where_the_mtp_head_does_not_draft():
    path = rule_file("spec.draft-head-inert")
    plan = plan_of(path)
    d = decision(plan, "spec.draft-head-inert")
    assert d.requested and d.key == "spec.draft_head" and "n-gram lookup" in d.message
    assert plan.spec.draft_head == "shared"  # the plan says what runs: nothing drafts through a head
    [p] = problems_of(path, strict=True)
    assert p.key == "spec.draft_head" and p.line == line_of(path, "draft_head")
    # Where the MTP head drafts, the 8-bit head runs, and the last GPU's weights hold its bytes.
    mtp = plan_of(path, ['spec.method="mtp"'])  # written int8: taken on CPU devices too
    shared = plan_of(path, ['spec.method="mtp"', 'spec.draft_head="shared"'])
    assert "spec.draft-head-inert" not in [x.rule for x in mtp.decisions]
    assert (mtp.spec.draft_head, shared.spec.draft_head) == ("int8", "shared")
    last = [g for g in mtp.gpus if g.role == "stage"][-1].index
    grew = {g.index: g.budget.weights - s.budget.weights for g, s in zip(mtp.gpus, shared.gpus, strict=True)}
    assert grew == {g.index: mtp.model.facts.int8_head_bytes() if g.index == last else 0 for g in mtp.gpus}
    assert mtp.model.facts.int8_head_bytes() > 0
    off = plan_of(path, ['spec.method="mtp"', "spec.draft_tokens=0"])
    assert "spec.draft_tokens = 0" in decision(off, "spec.draft-head-inert").message
    assert off.spec.draft_head == "shared"


def test_plan_text_says_the_mtp_head_drafts_through_the_8bit_head():
    from strata_cfg.report.plan_text import plan_text

    path = rule_file("spec.draft-head-inert")
    assert "8-bit copy of the LM head" in plan_text(plan_of(path, ['spec.method="mtp"']))
    assert "8-bit" not in plan_text(plan_of(path, ['spec.method="mtp"', 'spec.draft_head="shared"']))
    assert "8-bit" not in plan_text(plan_of(path))  # inert: nothing drafts through a head


def test_experts_mtp_whole_keeps_the_heads_experts_where_they_take_at_most_an_eighth_of_the_slots():
    """Under a cache of about 2,000 slots the MTP head's 128 experts are held whole, and the note says how
    many of the GPU's slots they take; with the head not drafting, with every expert resident, or with a
    cache under 8 x 128 slots, the head's layer gets no such place and the note is absent."""
    path = rule_file("experts.mtp-whole")
    plan = plan_of(path)
    g = plan.gpus[0]
    assert g.experts_whole == 128 and 8 * 128 <= g.experts_resident < g.experts_total
    d = decision(plan, "experts.mtp-whole")
    assert f"all 128 routed experts of the MTP head's layer among the {g.experts_resident}" in d.message
    off = plan_of(path, ["spec.draft_tokens=0", "batch.mtp=false"])
    assert off.gpus[0].experts_whole == 0 and "experts.mtp-whole" not in [x.rule for x in off.decisions]
    assert off.gpus[0].experts_total == g.experts_total - 128  # no head loaded: its experts are not counted
    small = plan_of(path, ["experts.cache=1023"])
    assert small.gpus[0].experts_whole == 0 and "experts.mtp-whole" not in [x.rule for x in small.decisions]
    assert plan_of(path, ["experts.cache=1024"]).gpus[0].experts_whole == 128
    roomy = plan_of(path, ['machine.gpus=[{name="GPU", vram_mib=143771, bandwidth_gbs=4800}]'])
    assert roomy.gpus[0].all_experts_resident and roomy.gpus[0].experts_whole == 0


def test_spec_draft_head_auto_takes_the_8bit_head_where_it_displaces_no_expert():
    """``spec.draft_head = "auto"`` on one H200 holding every expert: the 8-bit copy, counted in the last
    GPU's weights. Capped at 24 GiB, where an expert cache holds what fits, the model's own head, and the
    note says the copy would have held fewer experts. On virtual CPU devices the shared head, silently."""
    path = rule_file("spec.draft-head-auto")
    plan = plan_of(path)
    d = decision(plan, "spec.draft-head-auto")
    assert plan.spec.draft_head == "int8" and "8-bit copy" in d.message and not d.requested
    assert plan.settings["spec.draft_head"].value == "int8"
    shared = plan_of(path, ['spec.draft_head="shared"'])
    assert plan.gpus[0].budget.weights - shared.gpus[0].budget.weights == plan.model.facts.int8_head_bytes()
    assert "spec.draft-head-auto" not in [x.rule for x in shared.decisions]  # written: no rule decides
    assert plan.gpus[0].experts_resident == plan.gpus[0].experts_total
    capped = plan_of(path, ['machine.gpus=[{name="GPU", vram_mib=24576, bandwidth_gbs=4800}]'])
    d = decision(capped, "spec.draft-head-auto")
    assert capped.spec.draft_head == "shared" and "fewer" in d.message
    assert capped.gpus[0].experts_resident < capped.gpus[0].experts_total
    asked = plan_of(
        path, ['machine.gpus=[{name="GPU", vram_mib=24576, bandwidth_gbs=4800}]', 'spec.draft_head="int8"']
    )
    assert asked.spec.draft_head == "int8"  # written, it is taken: the cache holds fewer experts
    assert asked.gpus[0].experts_resident < capped.gpus[0].experts_resident
    cpu = plan_of(rule_file("spec.draft-head-inert"), ['spec.method="mtp"', 'spec.draft_head="auto"'])
    assert cpu.spec.draft_head == "shared" and "spec.draft-head-auto" not in [x.rule for x in cpu.decisions]


def test_experts_keep_misses_small_cache_swaps_where_a_layer_has_fewer_than_twice_top_k_slots():
    """Under twice top-k slots a layer, keeping misses is off by default, with the slots of each small GPU
    in the reason and the swapping policy's own decay; written true, it stays on with a note that it may
    move more; a cache of twice top-k slots a layer or more keeps its misses."""
    path = rule_file("experts.keep-misses-small-cache")
    plan = plan_of(path)
    assert plan.experts.cache is not None and plan.experts.keep_misses is False
    d = decision(plan, "experts.keep-misses-small-cache")
    assert d.key == "experts.keep_misses" and not d.requested
    assert "GPU 0 3.0, GPU 1 2.0" in d.message and "2 x the 2 experts" in d.message
    assert plan.settings["experts.score_decay"].value == 0.9  # the swapping default, not keeping's 0.95
    asked = plan_of(path, ["experts.keep_misses=true"])
    assert asked.experts.keep_misses is True
    note = decision(asked, "experts.keep-misses-small-cache")
    assert note.requested and "may move more" in note.message
    assert asked.settings["experts.score_decay"].value == 0.95
    roomy = plan_of(path, ["experts.cache=12"])  # 6 slots a layer on GPU 0, 4 on GPU 1 (with the MTP layer)
    assert roomy.experts.keep_misses is True
    assert "experts.keep-misses-small-cache" not in [x.rule for x in roomy.decisions]
    one_short = plan_of(path, ["experts.cache=11"])  # GPU 1: 11 slots over 3 layers, under 4 a layer
    assert one_short.experts.keep_misses is False
    assert "GPU 1 3.7" in decision(one_short, "experts.keep-misses-small-cache").message


def test_experts_keep_misses_tiers_turns_keeping_off_beside_a_helper_tier(tmp_path):
    """Asked for with a helper GPU, keeping misses is turned off (the helper tier adapts by swaps) and the
    decision says it overrode the profile; left to its default there, it is off with the same reason, not
    marked as overriding anything; without the helper GPU it stays on."""
    path = rule_file("experts.keep-misses-tiers")
    plan = plan_of(path)
    assert plan.experts.cache is not None and plan.experts.keep_misses is False
    d = decision(plan, "experts.keep-misses-tiers")
    assert d.key == "experts.keep_misses" and d.requested and "helper tier" in d.message
    unwritten = tmp_path / "unwritten.toml"
    text = path.read_text().replace("keep_misses = true\n", "")
    unwritten.write_text(text.replace('"../base-cpu4.toml"', f'"{RULES_DIR.parent / "base-cpu4.toml"}"'))
    quiet = plan_of(unwritten)
    assert quiet.experts.keep_misses is False and not decision(quiet, "experts.keep-misses-tiers").requested
    alone = plan_of(path, ["experts.helper_devices=[]"])
    assert alone.experts.keep_misses is True
    assert "experts.keep-misses-tiers" not in [x.rule for x in alone.decisions]
