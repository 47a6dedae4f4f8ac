"""The bench's expert-cache figures: the share of expert work served from VRAM, the host-link bytes per
generated token, and the ceiling those allow, with the arithmetic checked by hand."""

from __future__ import annotations

import numpy as np
import pytest
from rt_engine_helpers import mode_plan

from strata_cfg.schema.facts import ModelFacts
from strata_cfg.schema.presets import preset_config
from strata_runtime.api import Request
from strata_runtime.bench.ceilings import decode_step_bytes
from strata_runtime.bench.harness import Arrival, InProcessDriver, cache_figures, measure
from strata_runtime.bench.versus_ceilings import cache_ceiling
from strata_runtime.engine import Engine


def test_a_cached_engines_run_reports_vram_share_and_link_bytes_per_token():
    """The decode windows' share and bytes per generated token, apart from the prompt chunks': their
    assignments and bytes are the prompt's own figures, per prompt token."""
    eng = Engine(mode_plan("serial", 2, preset="small", context=96, prefill_chunk=16, expert_cache=4))
    arrivals = [Arrival(Request(tuple(range(40, 60)), 12)), Arrival(Request(tuple(range(70, 75)), 12))]
    results, stats = InProcessDriver(eng).run(arrivals)
    traffic = stats["experts"]
    caches = [s.experts.stats for s in eng.model.stages]
    assert traffic["hits"] == sum(c.hits for c in caches) > 0
    assert traffic["misses"] == sum(c.misses for c in caches) > 0
    assert traffic["host_bytes"] == sum(c.miss_bytes + c.swap_bytes for c in caches)
    assert traffic["prompt_hits"] + traffic["prompt_misses"] > 0  # the 20-token prompt's chunks
    fig = measure("two-decodes", results, stats, wall=1.0)
    decode = [v for kind, v in stats["windows_by_kind"].items() if kind != "prefill"]
    assert decode and len(decode) < len(stats["windows_by_kind"])  # the prompts' windows are left out
    assert fig["decode_window_ms"] == pytest.approx(sum(v[1] for v in decode) / sum(v[0] for v in decode))
    assert fig["decode_window_tokens"] == pytest.approx(sum(v[2] for v in decode) / sum(v[0] for v in decode))
    d_hits = traffic["hits"] - traffic["prompt_hits"]
    d_served = traffic["hits"] + traffic["misses"] - traffic["prompt_hits"] - traffic["prompt_misses"]
    assert fig["expert_vram_pct"] == pytest.approx(100 * d_hits / d_served)
    tokens = sum(len(r.token_ids) for r in results)
    decode_bytes = traffic["host_bytes"] - traffic["prompt_host_bytes"]
    assert fig["host_mb_per_token"] == pytest.approx(decode_bytes / tokens / 1e6)
    p_served = traffic["prompt_hits"] + traffic["prompt_misses"]
    assert fig["prompt_expert_vram_pct"] == pytest.approx(100 * traffic["prompt_hits"] / p_served)
    assert fig["prompt_host_mb_per_token"] == pytest.approx(traffic["prompt_host_bytes"] / 25 / 1e6)
    # A prompt alone: the prompt chunks' share, and the link's bytes per prompt token.
    prompt, stats = InProcessDriver(eng).run([Arrival(Request(tuple(range(30, 90)), 1))])
    traffic = stats["experts"]
    assert traffic["prompt_host_bytes"] > 0
    fig = measure("prompt", prompt, stats, wall=1.0)
    moved = traffic["prompt_host_bytes"] + traffic["swap_bytes"]
    assert fig["host_mb_per_token"] == pytest.approx(moved / 60 / 1e6)
    p_served = traffic["prompt_hits"] + traffic["prompt_misses"]
    assert fig["expert_vram_pct"] == pytest.approx(100 * traffic["prompt_hits"] / p_served)
    # An engine with every expert resident reports no cache figures.
    resident = Engine(mode_plan("serial", 2, preset="small", context=96, prefill_chunk=16))
    results, stats = InProcessDriver(resident).run(arrivals[:1])
    assert "experts" not in stats and "expert_vram_pct" not in measure("two-decodes", results, stats, 1.0)


def test_a_prompt_chunk_reads_an_expert_in_host_memory_once_a_tile_and_a_decode_miss_reads_it_whole():
    """The link bytes by hand: a prompt chunk routing 300 rows to an expert held in host memory reads it in
    3 tiles of at most 128 rows, 1 row in 1; a decode hand-over's 5 host assignments read 5 experts whole."""
    from strata_cfg.schema.windows import PREFILL_EXPERT_TILE_ROWS
    from strata_runtime.experts.cache import Policy, Reads, Residency

    assert PREFILL_EXPERT_TILE_ROWS == 128
    r = Residency(2, 4, 4, expert_bytes=10, policy=Policy(adapt=False))  # experts 0 and 1 of each layer
    counts = np.zeros((2, 4))
    counts[0, 0], counts[0, 3], counts[1, 2] = 500, 300, 1  # one resident, two in host memory
    r.observe(counts, prompt=True)
    s = r.stats
    assert (s.prompt_hits, s.prompt_misses, s.hits, s.misses) == (500, 301, 500, 301)
    assert s.prompt_miss_bytes == s.miss_bytes == (3 + 1) * 10
    decode = np.zeros((2, 4))
    decode[0, 2], decode[1, 1] = 5, 2
    r.observe(decode, reads=Reads(0, 5))
    assert (s.prompt_hits, s.prompt_misses, s.hits, s.misses) == (500, 301, 502, 306)
    assert s.miss_bytes == 40 + 5 * 10 and s.prompt_miss_bytes == 40
    # The tables send 5 of those 7 decode assignments to host memory: the kernels' 5 reads are on time;
    # 7 counted (expert 1 of layer 1 read from host, as a window before a swap's landing does) are 2 late.
    assert s.late_reads == 0
    r.observe(decode, reads=Reads(0, 7))
    assert s.late_reads == 2
    r.observe(counts, reads=Reads(0, 400), prompt=True)  # a prompt's hand-over is not judged
    assert s.late_reads == 2


def test_the_cache_figures_split_decode_from_prompts_by_hand():
    traffic = {
        "hits": 900,
        "misses": 300,
        "swaps": 4,
        "kept": 2,
        "miss_bytes": 5_000_000,
        "swap_bytes": 1_000_000,
    }
    traffic |= {"prompt_hits": 600, "prompt_misses": 200, "prompt_host_bytes": 3_000_000, "late_reads": 25}
    decode = cache_figures(traffic, generated=10, prompt_tokens=100, prompt=False)
    assert decode["expert_vram_pct"] == pytest.approx(75.0)  # 300 of 400 decode assignments
    assert decode["late_read_pct"] == pytest.approx(25.0)  # 25 of the 100 decode misses
    assert decode["host_mb_per_token"] == pytest.approx(0.3)  # (2 MB of misses + 1 MB of swaps) / 10
    assert decode["swap_mb_per_token"] == pytest.approx(0.1)  # the swaps' share
    assert decode["expert_swaps"] == 4 and decode["expert_kept"] == 2
    assert (
        decode["prompt_expert_vram_pct"] == pytest.approx(75.0) and decode["prompt_host_mb_per_token"] == 0.03
    )
    prompt = cache_figures(traffic, generated=1, prompt_tokens=100, prompt=True)
    assert prompt["expert_vram_pct"] == pytest.approx(75.0) and prompt["host_mb_per_token"] == pytest.approx(
        0.04
    )
    unmarked = traffic | {"prompt_hits": 0, "prompt_misses": 0, "prompt_host_bytes": 0, "late_reads": 0}
    prompt = cache_figures(unmarked, generated=1, prompt_tokens=100, prompt=True)  # read in graph windows
    assert prompt["expert_vram_pct"] == pytest.approx(75.0) and prompt["host_mb_per_token"] == pytest.approx(
        0.06
    )
    assert {"prompt_expert_vram_pct", "late_read_pct"}.isdisjoint(cache_figures(unmarked, 10, 100, False))


@pytest.mark.parametrize(("link_bound", "hit_pct"), [(True, 50.0), (False, 99.5)])
def test_the_cache_ceiling_is_the_slower_link_for_the_window(link_bound, hit_pct):
    facts = ModelFacts.from_config(preset_config("qwen3-30b-a3b"), source="synthetic", dtype="float16")
    m = {"rows_per_window": 2.0, "tok_s": 100.0, "ms_per_window": 20.0, "expert_vram_pct": hit_pct}
    m["host_mb_per_token"] = 100.0 if link_bound else 0.01
    copy, link = 4e12, 50e9
    out = cache_ceiling(facts, m, positions=300, kv_dtype="float16", copy=copy, link=link)
    step = decode_step_bytes(facts, rows=2, positions=300, kv_dtype="float16")
    tokens = 100.0 * 20.0 / 1000  # 2 tokens per window
    vram = step.total - (1 - hit_pct / 100) * step.experts
    host = m["host_mb_per_token"] * 1e6 * tokens
    assert (host / link > vram / copy) == link_bound
    assert out["cache_ceiling_tok_s"] == pytest.approx(tokens / max(vram / copy, host / link))
    assert out["of_cache_ceiling"] == pytest.approx(100.0 / out["cache_ceiling_tok_s"])
    assert "ceiling" in out["line"] and f"{hit_pct:.1f}%" in out["line"] and "prompts" not in out["line"]
    m |= {"prompt_expert_vram_pct": 41.25, "prompt_host_mb_per_token": 12.5, "late_read_pct": 21.0}
    out = cache_ceiling(facts, m, positions=300, kv_dtype="float16", copy=copy, link=link)
    assert "the prompts' chunks: 41.2% from VRAM, 12.5 MB a prompt token" in out["line"]
    assert "21% of the decode windows' misses read experts a rebalance had already sent for" in out["line"]
    assert out["prompt_expert_vram_pct"] == 41.25 and out["cache_ceiling_tok_s"] == pytest.approx(
        tokens / max(vram / copy, host / link)
    )
    # With the decode windows' own figures (a run's windows by kind): 3 tokens in 25 ms a window, 120 tok/s.
    m |= {"decode_window_ms": 25.0, "decode_window_tokens": 3.0}
    out = cache_ceiling(facts, m, positions=300, kv_dtype="float16", copy=copy, link=link)
    host = m["host_mb_per_token"] * 1e6 * 3.0
    assert out["cache_ceiling_tok_s"] == pytest.approx(3.0 / max(vram / copy, host / link))
    assert out["of_cache_ceiling"] == pytest.approx(120.0 / out["cache_ceiling_tok_s"])
    assert "measured 120.0 (the decode windows')" in out["line"]


def _phrase(salt: int) -> tuple[int, ...]:
    return tuple(32 + (11 * i + 17 * salt) % 90 for i in range(6)) * 3


@pytest.mark.parametrize("keep", [False, True])
def test_settling_runs_warm_up_requests_until_the_caches_could_have_turned_over(keep):
    """Each warm-up request is the k-th of the caller's, its figures what the caches served during it; the
    requests stop at the first that leaves the caches `settled` (as many experts brought in as they hold
    slots, or none by the last), or after ``most``. A cache that keeps its misses brings them in by keeping
    them, not by swaps."""
    from strata_runtime.bench.harness import adaptive_caches, settle_experts, settled

    policy = {"keep_misses": keep}
    plan = mode_plan(
        "serial", 2, preset="small", context=96, prefill_chunk=16, expert_cache=4, cache_policy=policy
    )
    eng = Engine(plan)
    slots = sum(c.slots for c in adaptive_caches(eng))
    assert slots == 8  # 4 slots on each of the two stages
    asked: list[int] = []

    def arrivals(k: int) -> list[Arrival]:
        asked.append(k)
        return [Arrival(Request(_phrase(k), 10))]

    def served() -> tuple[int, int]:
        stats = [s.experts.stats for s in eng.model.stages]
        return sum(s.hits for s in stats), sum(s.misses for s in stats)

    before = served()
    steps = settle_experts(eng, arrivals, most=6)
    assert asked == list(range(len(steps))) and 1 <= len(steps) <= 6
    assert all(not settled(steps[:k], slots) for k in range(len(steps)))
    assert settled(steps, slots) or len(steps) == 6
    assert steps[0].moved > 0  # the first request teaches the caches what it uses
    after = served()
    assert after[0] > before[0] and after[1] > before[1]
    assert all(0.0 <= x.from_vram <= 1.0 for x in steps)


def test_caches_have_settled_once_they_could_have_turned_over_or_stopped_moving():
    from strata_runtime.bench.harness import Settling, settled

    assert not settled([], 10)
    assert not settled([Settling(0.5, 4), Settling(0.6, 5)], 10)
    assert settled([Settling(0.5, 4), Settling(0.6, 6)], 10)
    assert settled([Settling(0.5, 4), Settling(0.6, 0)], 10)


@pytest.mark.parametrize("keep", [False, True])
def test_every_repeat_starts_from_the_caches_the_run_began_with(keep):
    """The same request in two repeats is served hit for hit alike: the second repeat does not start from
    what the first taught the cache, whether the cache swaps or keeps its misses."""
    from strata_runtime.bench.harness import run_bench

    policy = {"keep_misses": keep}
    plan = mode_plan(
        "serial", 2, preset="small", context=96, prefill_chunk=16, expert_cache=4, cache_policy=policy
    )
    eng = Engine(plan)
    runs = run_bench({"serial": eng}, "solo", tokens=16, repeats=3, context=96)["serial"].runs["solo"]
    shares = [r["expert_vram_pct"] for r in runs]
    assert len(shares) == 3 and shares[0] == shares[1] == shares[2], shares


def test_settling_runs_nothing_where_no_cache_adapts():
    from strata_runtime.bench.harness import settle_experts

    called: list[int] = []

    def arrivals(k: int) -> list[Arrival]:
        called.append(k)
        return [Arrival(Request(_phrase(k), 4))]

    for kw in ({"expert_cache": 4, "adapt": False}, {}):  # frozen; every expert resident
        eng = Engine(mode_plan("serial", 2, preset="small", context=96, prefill_chunk=16, **kw))
        assert settle_experts(eng, arrivals) == [] and called == []


def test_the_bench_settles_the_cache_before_the_first_repeat_unless_told_not_to(tmp_path):
    """Arms of one layout share their caches, so they settle once, under the first arm's name; the line and
    the JSON say how; ``--cold-experts`` leaves the first repeat a cold cache."""
    from rt_engine_helpers import bench_with_and_without
    from rt_plans import profile_text

    profile = tmp_path / "cached.toml"
    profile.write_text(profile_text(preset="small", stages=2, slots=2, context=96, expert_cache=4))
    argv = ["--workload", "two-decodes", "--arms", "serial,batch-mtp", "--repeats", "1", "--tokens", "8"]
    runs = bench_with_and_without(profile, argv, "--cold-experts")
    res, err = runs[False]
    assert list(res["settling"]) == ["serial"]  # batch-mtp shares serial's caches
    steps = res["settling"]["serial"]
    assert 1 <= len(steps) <= 6 and steps[0]["moved"] > 0
    assert "[serial] expert cache " in err and "warm-up request(s) of 8 tokens" in err
    res, err = runs[True]
    assert res["settling"] == {} and "expert cache settled" not in err and "still learning" not in err


def test_the_cache_ceiling_prices_misses_at_the_kernels_read_rate_and_swaps_at_the_copy_rate():
    """With the rate kernels read pinned host memory at (a miss's) and the swaps' share measured, the link's
    time is the misses' bytes at that rate plus the swaps' at the copy engine's; without either, all of it
    at the copy engine's, as before."""
    facts = ModelFacts.from_config(preset_config("qwen3-30b-a3b"), source="synthetic", dtype="float16")
    m = {"rows_per_window": 1.0, "tok_s": 60.0, "ms_per_window": 1000 / 60.0, "expert_vram_pct": 83.4}
    m |= {"host_mb_per_token": 665.8, "swap_mb_per_token": 37.0}
    copy, link, read = 3e12, 55e9, 49.5e9
    out = cache_ceiling(facts, m, positions=100, kv_dtype="float16", copy=copy, link=link, read=read)
    host_s = (665.8 - 37.0) * 1e6 / read + 37.0e6 / link
    assert out["cache_ceiling_tok_s"] == pytest.approx(1.0 / host_s)  # bound by the link
    assert "misses 629 MB at the kernels' read rate, swaps 37 MB copied" in out["line"]
    slower = cache_ceiling(facts, m, positions=100, kv_dtype="float16", copy=copy, link=link)
    assert slower["cache_ceiling_tok_s"] == pytest.approx(1.0 / (665.8e6 / link))
    assert slower["cache_ceiling_tok_s"] > out["cache_ceiling_tok_s"] and "read rate" not in slower["line"]
    del m["swap_mb_per_token"]  # an older run's figures: no split to price
    assert cache_ceiling(facts, m, 100, "float16", copy, link, read)["cache_ceiling_tok_s"] == pytest.approx(
        slower["cache_ceiling_tok_s"]
    )
