"""The host-memory budget: which GPUs keep experts in pinned host memory and how many bytes, where the
host's RAM comes from (the profile, /proc/meminfo when probing, or unknown), and the refusal at the exact
edge where the experts and the reserve stop fitting."""

from __future__ import annotations

import pytest
from cfg_fixtures import PROFILES, RULES_DIR, line_of, plan_of, problem, problems_of

from strata_cfg.facts.machine import parse_meminfo
from strata_cfg.report.explain import explain_text
from strata_cfg.report.plan_text import host_line
from strata_cfg.schema.plan import MIB

STREAMS = RULES_DIR / "experts.cache.toml"  # GPU 0 caches 12 of its 16 experts; GPU 1 holds all of its own
H200_SMI = "0, NVIDIA H200, 143771\n1, NVIDIA H200, 143771\n"


def test_a_gpu_that_streams_keeps_every_routed_expert_of_its_stages_in_host_memory():
    plan = plan_of(STREAMS)
    g0, g1 = plan.gpus
    assert g0.experts_resident < g0.experts_total and g1.experts_resident == g1.experts_total
    eb = plan.model.facts.expert_bytes()
    t0, t1 = plan.host.tiers
    assert (t0.gpu, t0.experts, t0.bytes) == (0, g0.experts_total, g0.experts_total * eb)
    assert (t1.gpu, t1.experts, t1.bytes) == (1, 0, 0)
    assert plan.host.total == t0.bytes and plan.host.reserve == 4096 * MIB


def test_helper_gpus_add_nothing_to_host_memory(tmp_path):
    profile = tmp_path / "helper.toml"
    profile.write_text(
        f'extends = "{STREAMS}"\n[machine]\ngpus = [\n'
        '  { name = "small", vram_mib = 2, bandwidth_gbs = 20 },\n'
        '  { name = "roomy", vram_mib = 1024, bandwidth_gbs = 20 },\n'
        '  { name = "helper", vram_mib = 1024, bandwidth_gbs = 20 },\n]\n'
        "[split]\ndevices = [0, 1]\n[experts]\nhelper_devices = [2]\n"
    )
    plan = plan_of(profile)
    helper = plan.gpus[2]
    assert helper.role == "helper" and helper.experts_resident > 0
    assert [t.experts for t in plan.host.tiers] == [plan.gpus[0].experts_total, 0, 0]


def test_every_expert_in_vram_means_no_host_tier():
    plan = plan_of(PROFILES / "h200.toml")
    assert plan.host.total == 0 and all(t.bytes == 0 for t in plan.host.tiers)
    assert host_line(plan) == "host memory: no host tier (every routed expert is in VRAM), no prefix store"


def test_the_prefix_store_is_pinned_host_memory_beside_the_experts_and_refused_where_it_does_not_fit():
    plan = plan_of(PROFILES / "h200.toml", ["memory.prefix_store_mib=2048", "machine.host_ram_mib=8192"])
    assert (plan.memory.prefix_store_mib, plan.host.prefix_store) == (2048, 2048 * MIB)
    assert plan.host.total == 2048 * MIB and plan.host.free == (8192 - 2048 - 4096) * MIB
    assert host_line(plan).startswith(
        "host memory: 2048.0 MiB prefix store + 4096.0 reserve = 6144.0 of 8192.0"
    )
    both = plan_of(STREAMS, ["memory.prefix_store_mib=64"])
    assert both.host.total == both.host.tiers[0].bytes + 64 * MIB
    assert "MiB of experts pinned (GPU 0 " in host_line(both) and " + 64.0 MiB prefix store + " in host_line(
        both
    )
    p = problem(
        problems_of(PROFILES / "h200.toml", ["memory.prefix_store_mib=4097", "machine.host_ram_mib=8192"]),
        "host.ram-overflow",
    )
    assert p.key == "machine.host_ram_mib" and "memory.prefix_store_mib = 4097 MiB" in p.message
    assert "experts" not in p.message.split(";")[0] and p.message.endswith("or lower memory.prefix_store_mib")


def test_unknown_ram_is_not_checked_and_the_plan_says_so():
    plan = plan_of(STREAMS, ["memory.host_reserve_mib=1000000"])
    assert plan.host.ram is None and plan.host.free is None and plan.machine.host_ram_mib is None
    assert host_line(plan).endswith("RAM unknown, not checked (set machine.host_ram_mib)")


def test_the_refusal_starts_exactly_where_the_tier_and_the_reserve_stop_fitting():
    plan = plan_of(STREAMS)
    need_mib = -(-(plan.host.total + 8 * MIB) // MIB)  # the tier plus an 8 MiB reserve, rounded up
    fits = plan_of(STREAMS, ["memory.host_reserve_mib=8", f"machine.host_ram_mib={need_mib}"])
    assert fits.host.free == need_mib * MIB - fits.host.total - 8 * MIB >= 0
    assert fits.host.ram_source == "profile"
    short = problems_of(STREAMS, ["memory.host_reserve_mib=8", f"machine.host_ram_mib={need_mib - 1}"])
    assert problem(short, "host.ram-overflow").key == "machine.host_ram_mib"


def test_a_probed_host_that_is_too_small_is_refused_at_the_probe_line(tmp_path):
    profile = tmp_path / "probed.toml"
    profile.write_text(
        '[machine]\nprobe = true\n[model]\nsynthetic = "qwen3-30b-a3b"\n[split]\nlayers = [23]\n'
    )
    smi = "0, NVIDIA GeForce RTX 3080, 20480\n1, NVIDIA GeForce RTX 3080, 20480\n"
    meminfo = "MemTotal: 33554432 kB\nMemAvailable: 16777216 kB\n"  # 16 GiB available of 32
    p = problem(problems_of(profile, probe=lambda: smi, meminfo=lambda: meminfo), "host.ram-overflow")
    assert (p.key, p.line) == ("machine.probe", line_of(profile, "probe"))
    assert "the host has 16384 MiB available (probed from /proc/meminfo)" in p.message


def test_the_profile_key_wins_over_the_probe():
    def unread() -> str:
        raise AssertionError("meminfo is not read when the profile gives machine.host_ram_mib")

    plan = plan_of(
        RULES_DIR / "machine.host-ram-probed.toml",
        ["machine.host_ram_mib=65536"],
        probe=lambda: H200_SMI,
        meminfo=unread,
    )
    assert plan.host.ram == 65536 * MIB and plan.host.ram_source == "profile"
    assert plan.settings["machine.host_ram_mib"].source.kind == "user"


@pytest.mark.parametrize(
    ("text", "mib"),
    [
        ("MemTotal:       263808196 kB\nMemAvailable:   251658240 kB\n", 245760),
        ("MemTotal:       8388608 kB\nMemFree: 1 kB\n", 8192),  # a kernel without MemAvailable
        ("nothing useful\n", None),
    ],
)
def test_meminfo_gives_mem_available_else_mem_total(text, mib):
    assert parse_meminfo(text) == mib


def test_unreadable_meminfo_leaves_the_ram_unknown():
    def broken() -> str:
        raise OSError("no /proc here")

    plan = plan_of(RULES_DIR / "machine.host-ram-probed.toml", probe=lambda: H200_SMI, meminfo=broken)
    assert plan.host.ram is None and not any(d.rule == "machine.host-ram-probed" for d in plan.decisions)


def test_the_host_budget_is_in_the_json_and_in_explain():
    plan = plan_of(PROFILES / "rtx3080-20g-x2.toml", ["machine.host_ram_mib=131072"])
    host = plan.to_json()["host"]
    assert [t["gpu"] for t in host["tiers"]] == [0, 1]
    assert host["total"] == sum(t["bytes"] for t in host["tiers"]) > 0
    assert host["ram"] == 131072 * MIB and host["free"] == host["ram"] - host["total"] - host["reserve"]
    text = explain_text(plan, "machine.host_ram_mib")
    assert text is not None and text.startswith("machine.host_ram_mib = 131072\n")
    assert f"  GPU 0      {plan.gpus[0].experts_total} experts" in text
    assert "RAM        131072.0 MiB (machine.host_ram_mib)" in text
