"""Batch MTP against serial windows at the byte roofline (`strata_runtime.bench.window_roofline`), and the
lines `strata bench --workload two-decodes` prints from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata_cfg.plan.from_profile import resolve_profile
from strata_cfg.schema.facts import expected_distinct_experts
from strata_runtime.bench.ceilings import decode_step_bytes
from strata_runtime.bench.versus_ceilings import batch_mtp_roofline
from strata_runtime.bench.window_roofline import (
    Window,
    calibrated_distinct,
    drafting_bytes,
    gain_at_roofline,
    table,
    window,
)

ROOT = Path(__file__).resolve().parents[1]
PROFILE = str(ROOT / "profiles" / "h200.toml")
COPY = 4.25e12


@pytest.fixture(scope="module")
def facts():
    return resolve_profile(PROFILE).model.facts


def test_uniform_windows_read_the_experts_of_random_rows(facts):
    for streams in (1, 2, 4):
        serial = window(facts, "serial", streams, "uniform", seed=0, positions=300, copy=COPY, samples=4)
        batch = window(facts, "batch-mtp", streams, "uniform", seed=0, positions=300, copy=COPY, samples=4)
        e, k = facts.num_experts, facts.num_experts_per_tok
        assert serial.rows == streams and batch.rows == 2 * streams
        assert serial.distinct_experts == pytest.approx(expected_distinct_experts(e, k, streams))
        assert batch.distinct_experts == pytest.approx(expected_distinct_experts(e, k, 2 * streams))
        step = decode_step_bytes(facts, rows=streams, positions=300, distinct_experts=serial.distinct_experts)
        assert serial.gbytes * 1e9 == pytest.approx(step.total)
        assert serial.ms == pytest.approx(step.total / COPY * 1e3)


def test_a_batch_mtp_window_reads_the_drafting_head_as_well(facts):
    batch = window(facts, "batch-mtp", 2, "uniform", seed=0, positions=300, copy=COPY, samples=4)
    step = decode_step_bytes(facts, rows=4, positions=300, distinct_experts=batch.distinct_experts).total
    extra = batch.gbytes * 1e9 - step
    assert extra == pytest.approx(drafting_bytes(facts, batch.distinct_experts))
    lm_head = facts.vocab_size * facts.hidden_size * facts.weight_bytes
    # the LM head once more, and the head's layer with as many experts as the window's own layers read
    assert extra > lm_head + batch.distinct_experts * facts.expert_bytes()
    # Drafting through the 8-bit head reads its bytes instead of the fp16 head's, and nothing else changes.
    int8 = window(
        facts, "batch-mtp", 2, "uniform", seed=0, positions=300, copy=COPY, samples=4, int8_head=True
    )
    assert int8.distinct_experts == batch.distinct_experts
    assert (batch.gbytes - int8.gbytes) * 1e9 == pytest.approx(lm_head - facts.int8_head_bytes())


def test_calibrated_routing_shares_experts_between_a_streams_positions(facts):
    one = calibrated_distinct(facts, 0, 1, 1, samples=4)
    assert one == facts.num_experts_per_tok  # one row routes to k distinct experts
    batch = calibrated_distinct(facts, 0, 2, 2, samples=8)  # two streams, two consecutive positions each
    four = calibrated_distinct(facts, 0, 4, 1, samples=8)  # four streams, one position each
    uniform = expected_distinct_experts(facts.num_experts, facts.num_experts_per_tok, 4)
    two = calibrated_distinct(facts, 0, 2, 1, samples=8)  # the same two streams' token rows alone
    assert two < batch < four < uniform + 1
    assert batch < 0.85 * uniform
    assert calibrated_distinct(facts, 0, 2, 2, samples=8) == batch  # seeded: the figure repeats


def test_the_gain_is_tokens_over_byte_time():
    serial = Window("serial", 2, 2, 15.0, 9.0, 2.0)
    batch = Window("batch-mtp", 2, 4, 28.0, 15.0, 3.0)
    assert gain_at_roofline(serial, batch, 0.5) == pytest.approx((2 * 1.5 / 3.0) / (2 / 2.0) - 1)
    assert gain_at_roofline(serial, batch, 0.9) > gain_at_roofline(serial, batch, 0.5)


def _two_decodes(accepted_pct: float, serial_ms: float | None, batch_ms: float | None) -> dict:
    def arm(kind: str, ms: float | None, pct: float) -> dict:
        by_kind = {kind: {"windows": 10, "ms_per_window": ms, "tokens_per_window": 2.0}} if ms else {}
        return {"two-decodes": {"median": {"accepted_pct": pct}, "windows_by_kind": by_kind}}

    return {"serial": arm("serial", serial_ms, 0.0), "batch-mtp": arm("batch-mtp", batch_ms, accepted_pct)}


def test_the_bench_sets_the_measured_windows_beside_their_byte_time():
    plans = {
        "serial": resolve_profile(PROFILE, [("batch.mtp", False)]),
        "batch-mtp": resolve_profile(PROFILE, [("batch.mtp", True)]),
    }
    out = batch_mtp_roofline(plans, _two_decodes(76.0, 3.8, 5.4), positions=300, copy=COPY)
    assert out["accepted"] == pytest.approx(0.76)
    uniform, calibrated = out["routings"]["uniform"], out["routings"]["calibrated"]
    assert plans["batch-mtp"].spec.draft_head == "int8"  # on this GPU profile the drafts read the 8-bit head
    again, shared = (
        table(
            plans["serial"].model.facts,
            seed=0,
            streams=[2],
            acceptances=[0.76],
            positions=300,
            copy=COPY,
            samples=16,
            int8_head=int8,
        )
        for int8 in (True, False)
    )
    assert uniform["gain"]["0.76"] == pytest.approx(again[0]["gain"]["0.76"])
    assert uniform["gain"]["0.76"] > shared[0]["gain"]["0.76"]
    assert calibrated["gain"]["0.76"] > uniform["gain"]["0.76"]
    text = "\n".join(out["lines"])
    assert "76.0% accepted" in text and "uniform routing, this plan's" in text and "under calibrated" in text
    serial_share = uniform["serial"]["ms"] / 3.8
    assert f"serial windows 3.80 ms = {serial_share:.0%} of their byte time" in text
    # the arms' windows not measured by kind: the byte times without the measured line
    bare = batch_mtp_roofline(plans, _two_decodes(60.0, None, None), positions=300, copy=COPY)
    assert bare["accepted"] == pytest.approx(0.6) and not any("measured:" in x for x in bare["lines"])
    # without a batch-MTP arm there is nothing to compare
    assert batch_mtp_roofline({"serial": plans["serial"]}, _two_decodes(0, 3.8, None), 300, COPY) == {}


def test_under_a_routing_sweep_each_batch_mtp_arm_is_set_beside_the_serial_arm_on_its_routing():
    """`--vary model.routing=uniform,calibrated` runs two models: each batch-MTP arm's byte rooflines are
    those of its own routing, at its own acceptance, beside the serial windows measured on that routing."""
    plans, summary = {}, {}
    for mtp, routing, pct, ms in (
        (False, "uniform", 0.0, 3.8),
        (False, "calibrated", 0.0, 4.2),
        (True, "uniform", 71.0, 5.4),
        (True, "calibrated", 83.0, 5.9),
    ):
        name = f"{'batch-mtp' if mtp else 'serial'}@routing:{routing}"
        plans[name] = resolve_profile(PROFILE, [("batch.mtp", mtp), ("model.routing", routing)])
        kind = "batch-mtp" if mtp else "serial"
        by_kind = {kind: {"windows": 10, "ms_per_window": ms, "tokens_per_window": 2.0}}
        summary[name] = {"two-decodes": {"median": {"accepted_pct": pct}, "windows_by_kind": by_kind}}
    out = batch_mtp_roofline(plans, summary, positions=300, copy=COPY)
    uniform, calibrated = (out["by_arm"][f"batch-mtp@routing:{r}"] for r in ("uniform", "calibrated"))
    assert out["accepted"] == uniform["accepted"] == pytest.approx(0.71)
    assert calibrated["accepted"] == pytest.approx(0.83)
    assert uniform["measured_ms"] == {"serial": 3.8, "batch-mtp": 5.4}
    assert calibrated["measured_ms"] == {"serial": 4.2, "batch-mtp": 5.9}
    text = "\n".join(out["lines"])
    assert (
        "(batch-mtp@routing:calibrated against serial@routing:calibrated), two streams, 83.0% accepted"
        in text
    )
    assert "(calibrated routing, this plan's)" in text and "(uniform routing, this plan's)" in text
    # one model, one pair: the lines name no arms
    one = {n: plans[n] for n in ("serial@routing:uniform", "batch-mtp@routing:uniform")}
    single = batch_mtp_roofline(one, summary, positions=300, copy=COPY)
    assert "by_arm" not in single and " against " not in single["lines"][0]


def test_the_two_decodes_ceiling_carries_the_rooflines_and_other_workloads_do_not():
    import argparse

    from strata_runtime.bench.versus_ceilings import ceiling_report
    from strata_runtime.weights.tokenizer import ByteTokenizer

    plans = {
        "serial": resolve_profile(PROFILE, [("batch.mtp", False)]),
        "batch-mtp": resolve_profile(PROFILE, [("batch.mtp", True)]),
    }
    summary = _two_decodes(76.0, 3.8, 5.4)
    for arm, rate in (("serial", 514.0), ("batch-mtp", 623.0)):
        summary[arm]["two-decodes"]["median"].update(tok_s=rate, rows_per_window=2.0, ms_per_window=4.0)
    args, tok = argparse.Namespace(tokens=300), ByteTokenizer(259)
    out = ceiling_report("two-decodes", plans, summary, {"copy_bytes_s": COPY}, args, tok)
    assert out["batch_mtp_roofline"]["accepted"] == pytest.approx(0.76)
    assert any(line.startswith("batch MTP at the byte rooflines") for line in out["lines"])
    solo = {"solo": {"solo": summary["serial"]["two-decodes"]}}
    out = ceiling_report("solo", {"solo": plans["serial"]}, solo, {"copy_bytes_s": COPY}, args, tok)
    assert "batch_mtp_roofline" not in out and not any("byte rooflines" in x for x in out["lines"])


def test_a_model_beyond_calibrated_routing_is_compared_under_uniform_routing_only(facts):
    wide = facts.model_copy(update={"num_experts_per_tok": 40, "num_experts": 256})  # top-k over 32
    rows = table(wide, seed=0, streams=[2], acceptances=[0.7], positions=300, copy=COPY, samples=2)
    assert [r["routing"] for r in rows] == ["uniform"]
    assert rows[0]["batch_mtp"]["distinct_experts"] == pytest.approx(expected_distinct_experts(256, 40, 4))


def test_at_a_depth_the_solo_ceiling_reads_that_deep_kv_and_compares_the_generating_rate():
    import argparse

    from strata_runtime.bench.ceilings import decode_step_bytes
    from strata_runtime.bench.versus_ceilings import ceiling_report
    from strata_runtime.weights.tokenizer import ByteTokenizer

    plan = resolve_profile(PROFILE, [("memory.context", 16384)])
    solo = {"solo": {"solo": {"median": {"tok_s": 200.0, "generation_tok_s": 370.0}}}}
    tok = ByteTokenizer(259)
    flat = ceiling_report(
        "solo", {"solo": plan}, solo, {"copy_bytes_s": COPY}, argparse.Namespace(tokens=128), tok
    )
    deep = ceiling_report(
        "solo", {"solo": plan}, solo, {"copy_bytes_s": COPY}, argparse.Namespace(tokens=128, depth=8000), tok
    )
    kv = plan.memory.kv_dtype
    step = decode_step_bytes(plan.model.facts, rows=1, positions=8000 + 64, kv_dtype=kv)
    assert deep["roofline_tok_s"] == pytest.approx(COPY / step.total)
    assert deep["roofline_tok_s"] < flat["roofline_tok_s"]  # the deep KV's bytes count
    assert deep["arms"]["solo"]["tok_s"] == 370.0 and flat["arms"]["solo"]["tok_s"] == 200.0
    assert any("370.0 tok/s generating" in line for line in deep["lines"])


def test_the_solo_ceiling_prices_a_caches_misses_at_the_measured_kernel_read_rate():
    """With the host link and the kernels' read rate among the measured rates, the cache line splits the
    link's time into misses at the read rate and swaps at the copy rate, and names both rates; without the
    read rate it prices every byte at the copy rate."""
    import argparse

    from strata_runtime.bench.versus_ceilings import ceiling_report
    from strata_runtime.weights.tokenizer import ByteTokenizer

    plan = resolve_profile(PROFILE, [])
    median = {"tok_s": 60.0, "rows_per_window": 1.0, "ms_per_window": 1000 / 60.0, "expert_vram_pct": 83.4}
    median |= {"host_mb_per_token": 665.8, "swap_mb_per_token": 37.0}
    solo = {"solo": {"solo": {"median": median}}}
    args, tok = argparse.Namespace(tokens=128), ByteTokenizer(259)
    rates = {"copy_bytes_s": COPY, "host_link_bytes_s": 55e9, "host_read_bytes_s": 49.5e9}
    priced = ceiling_report("solo", {"solo": plan}, solo, rates, args, tok)
    text = "\n".join(priced["lines"])
    assert "misses 629 MB at the kernels' read rate, swaps 37 MB copied" in text
    assert "55 GB/s by the copy engine, 49.5 GB/s read by kernels in place" in text
    del rates["host_read_bytes_s"]
    plain = ceiling_report("solo", {"solo": plan}, solo, rates, args, tok)
    assert plain["arms"]["solo"]["cache_ceiling_tok_s"] > priced["arms"]["solo"]["cache_ceiling_tok_s"]
    assert "read rate" not in "\n".join(plain["lines"])
