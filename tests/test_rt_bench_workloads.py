"""`strata bench`'s prompt, turns, step and vram workloads on the CPU: what runs, and what is refused and
why."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from strata_cfg.schema.workloads import (
    SHARED_REQUESTS,
    TURN_MESSAGE,
    TURNS,
    prompt_ids,
    shared_prompts,
    turn_prompts,
    turns_context_problem,
    turns_figures,
)


def strata(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "strata_cfg", *args], capture_output=True, text=True, timeout=300
    )


def test_prompt_ids_are_fresh_ids_spread_over_the_vocabulary() -> None:
    seed = 12345
    ids = prompt_ids(2000, 384, seed)
    assert len(ids) == 2000 and min(ids) >= 1 and max(ids) < 384
    assert len(set(ids)) > 300  # not a repeated letter
    assert prompt_ids(2000, 384, seed) == ids and prompt_ids(2000, 384, seed + 1) != ids


def test_prompt_workload_reads_the_whole_prompt_with_a_raised_context() -> None:
    out = strata(
        *("bench", "profiles/demo.toml", "--workload", "prompt", "--prompt-tokens", "1100"),
        *("--set", "memory.context=1101", "--repeats", "2", "--json"),
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert set(res["arms"]) == {"serial"} and res["prompt_tokens"] == 1100
    case = res["arms"]["serial"]["prompt"]
    assert case["repeats"] == 2 and case["median"]["prompt_tokens"] == 1100
    assert len(case["tok_s_repeats"]) == 2 and min(case["tok_s_repeats"]) > 0
    assert case["median"]["tok_s"] == pytest.approx(float(np.median(case["tok_s_repeats"])))
    ceiling = res["ceiling"]
    assert ceiling["flops_per_token"] > 0 and ceiling["matrix_flop_s"] is None  # no GPU, no matrix rate
    assert ceiling["arms"]["serial"]["flop_s"] == pytest.approx(
        case["median"]["tok_s"] * ceiling["flops_per_token"]
    )


def test_prompt_workload_rate_is_the_prompt_over_the_time_to_its_first_token() -> None:
    """One repeat: its rate is exactly prompt tokens over the seconds until the first token, and the time
    per window times the windows (the prompt's chunks plus the one decode step) is no more than that."""
    out = strata(
        *("bench", "profiles/demo.toml", "--workload", "prompt", "--prompt-tokens", "300"),
        *("--repeats", "1", "--json"),
    )
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout)["arms"]["serial"]["prompt"]["median"]
    assert m["tok_s"] == pytest.approx(300 / m["prompt_read_s"])
    assert m["rows_per_window"] > 1  # prompt chunks, not one row at a time
    assert m["accepted_pct"] == 0.0  # one generated token: nothing drafted is verified


def test_prompt_workload_interleaves_arms_and_prints_its_arithmetic() -> None:
    out = strata(
        *("bench", "profiles/demo.toml", "--workload", "prompt", "--prompt-tokens", "200"),
        *("--arms", "serial,pipelined", "--repeats", "1"),
    )
    assert out.returncode == 0, out.stderr
    assert "one prompt of 200 tokens alone on the engine" in out.stdout
    assert "FLOP per token (weights" in out.stdout and "average context of 100" in out.stdout
    assert "pipelined: " in out.stdout and "= serial" in out.stdout


def test_each_turn_sends_everything_sent_before_and_a_new_message() -> None:
    turns = turn_prompts(100, 384, seed=3)
    assert [len(t) for t in turns] == [100 + (k + 1) * TURN_MESSAGE for k in range(TURNS)]
    assert all(later[: len(t)] == t for t, later in zip(turns, turns[1:], strict=False))
    assert min(min(t) for t in turns) >= 1 and max(max(t) for t in turns) < 384
    assert turn_prompts(100, 384, seed=3) == turns and turn_prompts(100, 384, seed=4)[0] != turns[0]
    assert turns[0] != prompt_ids(100 + TURN_MESSAGE, 384, 3)  # apart from the prompt workload's prompts


def test_the_turns_workload_sends_each_turn_after_the_last_and_measures_what_reuse_saves() -> None:
    """One conversation, interleaved with reuse off and on: with it, every later turn reads only its new
    message and the token before it (the slot kept the turn before, less the drafter's last row); without
    it, every prompt is read whole. The text is the same."""
    out = strata(
        *("bench", "profiles/demo.toml", "--workload", "turns", "--prompt-tokens", "200", "--tokens", "16"),
        *("--vary", "memory.prefix_reuse=false,true", "--repeats", "2", "--json"),
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    off, on = (res["arms"][f"serial@prefix_reuse:{v}"]["turns"] for v in ("false", "true"))
    sent = [200 + (k + 1) * TURN_MESSAGE for k in range(TURNS)]
    reused = sum(n - 1 for n in sent[:-1])  # each later turn keeps the one before, less one position
    assert on["median"]["reused_pct"] == pytest.approx(100 * reused / sum(sent[1:]))
    assert off["median"]["reused_pct"] == 0.0
    assert on["text_equal_to_serial@prefix_reuse:false"] is True
    for case in (on, off):
        m = case["median"]
        assert m["first_turn_ttft_s"] > 0 and m["later_ttft_s"] > 0 and m["tok_s"] > 0


def test_a_turn_arrives_only_once_the_turn_before_has_finished() -> None:
    from rt_plans import make_plan

    from strata_runtime.bench.harness import InProcessDriver, workload_arrivals
    from strata_runtime.engine import Engine

    eng = Engine(make_plan(slots=2, context=256, prefill_chunk=16))
    arrivals = workload_arrivals("turns", eng.tokenizer, 6, 256, prompt_tokens=40, vocab=256, seed=1)
    assert [a.after for a in arrivals] == [None, 0, 1, 2]
    results, _ = InProcessDriver(eng).run(arrivals)
    assert all(later.submitted >= r.finished for r, later in zip(results, results[1:], strict=False))
    assert [r.cached for r in results] == [0] + [len(a.request.prompt_ids) for a in arrivals[:-1]]


def test_turns_figures_are_the_conversations_rate_the_waits_and_the_share_reused() -> None:
    # (sent, first token, done, tokens, prompt tokens, reused); the third turn's first token never came
    turns = [(0.0, 0.5, 1.0, 10, 100, 0), (1.0, 1.1, 2.0, 10, 120, 99), (2.0, None, 2.5, 0, 140, 119)]
    figures = turns_figures(turns)
    assert figures["tok_s"] == pytest.approx(20 / 2.5)
    assert figures["first_turn_ttft_s"] == pytest.approx(0.5)
    assert figures["later_ttft_s"] == pytest.approx((0.1 + 0.5) / 2)  # the median of 0.1 and 0.5
    assert figures["reused_pct"] == pytest.approx(100 * (99 + 119) / (120 + 140))


def test_conversations_take_turns_each_on_its_own_context_and_the_store_keeps_their_history() -> None:
    """The ``conversations`` workload: one conversation more than the plan's slots, turn by turn (every
    conversation's first turn, then every second ...), each request after the one before. On the demo (two
    slots) with a prefix store every later turn reuses its conversation's sent prompt, less a drafter's row;
    without one, each finds its slot taken and reads its whole prompt. The text is the same."""
    from strata_cfg.schema.workloads import conversation_prompts

    convs = conversation_prompts(100, 384, seed=2, conversations=3)
    assert len(convs) == 3 and all(len(c) == TURNS for c in convs)
    assert len({c[0][:100] for c in convs}) == 3  # each conversation its own context
    for c in convs:
        assert all(
            b[: len(a)] == a and len(b) == len(a) + TURN_MESSAGE for a, b in zip(c, c[1:], strict=False)
        )
    assert conversation_prompts(100, 384, seed=3, conversations=3)[0][0] != convs[0][0]
    out = strata(
        *("bench", "profiles/demo.toml", "--workload", "conversations", "--prompt-tokens", "150"),
        *("--tokens", "12", "--vary", "memory.prefix_store_mib=0,64", "--repeats", "2", "--json"),
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    off, on = (res["arms"][f"serial@prefix_store_mib:{v}"]["conversations"] for v in (0, 64))
    sent = [150 + (k + 1) * TURN_MESSAGE for k in range(TURNS)]
    # A stored history lends its turn's prompt, less a drafter's row, where the drafter had read it.
    most = 100 * sum(n - 1 for n in sent[:-1]) / sum(sent[1:])
    assert off["median"]["reused_pct"] == 0.0 and 0.8 * most < on["median"]["reused_pct"] <= most
    assert on["text_equal_to_serial@prefix_store_mib:0"] is True
    assert on["median"]["later_ttft_s"] < off["median"]["later_ttft_s"]


def test_the_first_turns_of_several_conversations_are_the_first_figure() -> None:
    # (sent, first token, done, tokens, prompt tokens, reused): two conversations' first turns, then theirs
    rows = [(0.0, 0.4, 1.0, 8, 100, 0), (1.0, 1.2, 2.0, 8, 100, 0), (2.0, 2.1, 3.0, 8, 140, 99)]
    rows.append((3.0, 3.3, 4.0, 8, 140, 0))
    figures = turns_figures(rows, firsts=2)
    assert figures["first_turn_ttft_s"] == pytest.approx((0.4 + 0.2) / 2)
    assert figures["later_ttft_s"] == pytest.approx((0.1 + 0.3) / 2)
    assert figures["reused_pct"] == pytest.approx(100 * 99 / 280)


def test_requests_sent_at_once_count_the_one_that_reused_least_as_the_reader_whatever_their_order() -> None:
    """The shared workload's requests reach the engine in any order: the one that read the context (reused
    the least; of equals, the first sent) is its first, the others are the later ones."""
    # (sent, first token, done, tokens, prompt tokens, reused): the second sent read the context
    rows = [(0.0, 0.3, 1.0, 8, 132, 99), (0.001, 0.1, 0.9, 8, 132, 0), (0.002, 0.4, 1.2, 8, 132, 99)]
    figures = turns_figures(rows, at_once=True)
    assert figures["first_turn_ttft_s"] == pytest.approx(0.099)
    assert figures["later_ttft_s"] == pytest.approx((0.3 + 0.398) / 2)
    assert figures["reused_pct"] == pytest.approx(100 * 99 / 132)
    assert turns_figures(rows)["reused_pct"] == pytest.approx(100 * 99 / 264)  # a conversation: in order
    none = [(0.0, 0.5, 1.0, 8, 132, 0), (0.001, 0.2, 1.0, 8, 132, 0)]
    assert turns_figures(none, at_once=True)["first_turn_ttft_s"] == pytest.approx(0.5)  # the first sent


def test_the_shared_workload_sends_one_context_with_a_question_each_and_measures_the_copied_prefix() -> None:
    """Four requests with one context, sent at once. With prefix reuse the second waits for the first's slot
    to read the context and copies it (the demo drafts: a position less), and the third and fourth, queued
    for the demo's two slots, reuse a freed slot's; without it every prompt is read whole. The text is the
    same."""
    prompts = shared_prompts(100, 384, seed=3)
    assert len(prompts) == SHARED_REQUESTS and all(p[:100] == prompts[0][:100] for p in prompts)
    assert len({p[100:] for p in prompts}) == SHARED_REQUESTS and all(
        len(p) == 100 + TURN_MESSAGE for p in prompts
    )
    assert shared_prompts(100, 384, seed=3) == prompts and shared_prompts(100, 384, seed=4)[0] != prompts[0]
    out = strata(
        *("bench", "profiles/demo.toml", "--workload", "shared", "--prompt-tokens", "200", "--tokens", "16"),
        *("--vary", "memory.prefix_reuse=false,true", "--repeats", "2", "--json"),
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    off, on = (res["arms"][f"serial@prefix_reuse:{v}"]["shared"] for v in ("false", "true"))
    sent = (SHARED_REQUESTS - 1) * (200 + TURN_MESSAGE)
    assert on["median"]["reused_pct"] == pytest.approx(100 * (SHARED_REQUESTS - 1) * 199 / sent)
    assert off["median"]["reused_pct"] == 0.0 and on["text_equal_to_serial@prefix_reuse:false"] is True
    for case in (on, off):
        m = case["median"]
        assert m["first_turn_ttft_s"] > 0 and m["later_ttft_s"] > 0 and m["tok_s"] > 0


def test_a_conversation_with_no_context_or_too_long_for_a_launched_engine_is_refused() -> None:
    assert turns_context_problem(0, 16, 1024) == "--prompt-tokens must be at least 1, not 0"
    need = 1000 + TURNS * TURN_MESSAGE + 16
    assert turns_context_problem(1000, 16, need) is None
    text = turns_context_problem(1000, 16, 1024, launched=True)
    assert text is not None and f"a context of {need}" in text
    assert text.endswith(f"engine's memory.context is 1024, so at most --prompt-tokens {1024 - need + 1000}")


def test_a_shared_context_that_does_not_fit_is_refused_naming_one_question_and_the_tokens_after_it() -> None:
    from strata_cfg.schema.workloads import context_problem, turns_text

    need = 1000 + TURN_MESSAGE + 16
    assert context_problem("shared", 1000, 0, 16, need) is None
    text = context_problem("shared", 1000, 0, 16, 1024, launched=True)
    assert text == (
        f"--prompt-tokens 1000: a context of that many tokens, a question of {TURN_MESSAGE} and 16 generated "
        f"after it need a context of {need}, but the engine's memory.context is 1024, so at most "
        f"--prompt-tokens {1024 - TURN_MESSAGE - 16}"
    )
    out = strata("bench", "profiles/demo.toml", "--workload", "shared", "--prompt-tokens", "1000")
    assert out.returncode == 2 and f"pass --set memory.context={1000 + TURN_MESSAGE + 300}" in out.stderr
    m = {"first_turn_ttft_s": 0.1, "later_ttft_s": 0.02, "reused_pct": 96.0}
    assert (
        turns_text(m, "shared")
        == "  first token: the reader 100.0 ms, the others 20.0 ms (96.0% of their prompts reused)"
    )
    assert turns_text(m, "turns").startswith("  first token: turn 1 100.0 ms, later turns 20.0 ms")


def test_a_conversation_that_does_not_fit_the_context_is_refused_with_the_setting_to_change() -> None:
    out = strata("bench", "profiles/demo.toml", "--workload", "turns", "--prompt-tokens", "1000")
    assert out.returncode == 2
    need = 1000 + TURNS * TURN_MESSAGE + 300
    assert f"memory.context is 1024; pass --set memory.context={need}" in out.stderr and out.stdout == ""


def test_a_prompt_that_does_not_fit_the_context_is_refused_with_the_setting_to_change() -> None:
    out = strata("bench", "profiles/demo.toml", "--workload", "prompt", "--prompt-tokens", "1024")
    assert out.returncode == 2
    assert "the plan's memory.context is 1024; pass --set memory.context=1025" in out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize("workload", ["step", "vram", "handoff"])
def test_gpu_workloads_refuse_virtual_cpu_devices_in_one_line(workload: str) -> None:
    out = strata("bench", "profiles/demo.toml", "--workload", workload)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"strata bench: --workload {workload} needs a CUDA GPU, but the plan's devices are virtual CPU "
        'devices (cpu:0, cpu:1); use a profile with machine.backend = "cuda"'
    ]


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_gpu_workloads_refuse_a_cuda_plan_without_cupy() -> None:
    out = strata("bench", "profiles/demo.toml", "--workload", "step", "--set", 'machine.backend="cuda"')
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--workload step needs a CUDA GPU" in lines[0] and "CuPy" in lines[0]


@pytest.mark.parametrize("workload", ["step", "vram", "handoff"])
def test_in_process_workloads_are_refused_over_url(workload: str) -> None:
    out = strata("bench", "--url", "http://127.0.0.1:9", "--workload", workload)
    assert out.returncode == 2
    assert f"--workload {workload} runs in the engine's own process" in out.stderr
    assert "over HTTP: two-decodes, clients, read-beside-decode, solo, prompt" in out.stderr


@pytest.mark.parametrize(
    ("workload", "extra", "refusal"),
    [
        ("step", ("--arms", "serial"), "--arms and --peer do not apply"),
        ("step", ("--peer", "llama.cpp"), "--arms and --peer do not apply"),
        (
            "vram",
            ("--vary", "model.decode_attention=auto,cuda_cores"),
            "--arms, --vary and --peer do not apply",
        ),
        ("handoff", ("--arms", "serial"), "--arms, --vary and --peer do not apply"),
        (
            "step",
            ("--vary", "spec.draft_tokens=2,3"),
            "--workload step varies only model.decode_attention, which it switches in one model on the same "
            "weights, not spec.draft_tokens",
        ),
    ],
)
def test_gpu_workloads_take_no_arms_peers_or_variants_they_cannot_time(workload, extra, refusal) -> None:
    """They time one plan: an option they would ignore is refused, not silently dropped. The step workload
    takes --vary of model.decode_attention alone, whose kernels it switches in one model."""
    out = strata("bench", "profiles/demo.toml", "--workload", workload, *extra)
    assert out.returncode == 2 and refusal in out.stderr, out.stderr


def test_the_step_workload_gets_a_plan_for_each_value_of_decode_attention(monkeypatch, tmp_path) -> None:
    """``strata bench --workload step --vary model.decode_attention=auto,cuda_cores`` runs the runtime's
    step once with both plans as named arms, each resolved with its value, in the order given."""
    import argparse
    import types

    from strata_cfg.commands import bench
    from strata_cfg.schema.plan_file import read_plan

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    vary = ["--vary", "model.decode_attention=auto,cuda_cores"]
    args = parser.parse_args(["profiles/h200.toml", "--workload", "step", *vary, "--run-dir", str(tmp_path)])
    calls: list[list[str]] = []

    def run(argv: list[str], check: bool) -> types.SimpleNamespace:
        calls.append(argv)
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(bench.subprocess, "run", run)
    assert bench.run(args) == 0
    [argv] = calls
    arms = [argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--arm"]
    assert [name for name, _ in arms] == [
        "profile@decode_attention:auto",
        "profile@decode_attention:cuda_cores",
    ]
    plans = [read_plan(path) for _, path in arms]
    assert [p.model.decode_attention for p in plans] == ["tensor_cores", "cuda_cores"]
    assert plans[0].model.facts == plans[1].model.facts and plans[0].memory == plans[1].memory


def test_the_step_workload_takes_a_variant_of_decode_attention_for_each_value() -> None:
    """--vary model.decode_attention passes the usage checks and reaches the runtime with a plan a value,
    which on virtual CPU devices refuses for want of a GPU, in one line."""
    out = strata(
        "bench",
        "profiles/demo.toml",
        "--workload",
        "step",
        "--vary",
        "model.decode_attention=auto,cuda_cores",
    )
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [
        "strata bench: --workload step needs a CUDA GPU, but the plan's devices are virtual CPU devices "
        '(cpu:0, cpu:1); use a profile with machine.backend = "cuda"'
    ]


def test_sampled_bench_requests_draw_with_the_options_and_the_same_seed_in_every_arm() -> None:
    """The decoding requests of a workload sample with --temperature/--top-p/--top-k, each seeded by its
    index; arms that choose tokens the same way (serial windows and solo here) give the same text."""
    from strata_runtime.api import SamplingParams
    from strata_runtime.bench.harness import workload_arrivals
    from strata_runtime.engine import Engine
    from strata_runtime.engine.sampling import Sampler

    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40)
    from rt_plans import make_plan

    tokenizer = Engine(make_plan(preset="tiny")).tokenizer
    arrivals = workload_arrivals("clients", tokenizer, 12, 128, clients=3, sampling=sampled)
    params = [a.request.sampling for a in arrivals]
    assert [p.seed for p in params] == [0, 1, 2]
    assert all((p.temperature, p.top_p, p.top_k) == (0.8, 0.9, 40) for p in params)
    assert not any(Sampler(p, 0).adjusts for p in params)
    greedy = workload_arrivals("solo", tokenizer, 12, 128)
    assert greedy[0].request.sampling.temperature == 0 and greedy[0].request.sampling.seed is None

    out = strata(
        *("bench", "profiles/demo.toml", "--workload", "two-decodes", "--arms", "serial,batch-mtp"),
        *("--repeats", "1", "--tokens", "24", "--temperature", "0.9", "--top-p", "0.95", "--json"),
    )
    assert out.returncode == 0, out.stderr  # sampled arms that verify drafts may differ: not an error
    res = json.loads(out.stdout)
    assert res["sampling"] == {
        "temperature": 0.9,
        "top_p": 0.95,
        "top_k": 0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    assert res["seeded"]
    assert res["arms"]["batch-mtp"]["two-decodes"]["text_equal_to_serial"] is None
    assert res["arms"]["serial"]["two-decodes"]["median"]["tok_s"] > 0


@pytest.mark.parametrize(
    ("option", "needle"),
    [
        (("--temperature", "-1"), "--temperature must be at least 0"),
        (("--temperature", "nan"), "--temperature must be at least 0"),
        (("--temperature", "2.5"), "--temperature must be at least 0 and at most 2, as OpenAI defines it"),
        (("--temperature", "0.7", "--top-p", "0"), "--top-p must be in (0, 1]"),
        (("--top-k", "-2"), "--top-k must be at least 0"),
        (("--temperature", "0.7", "--peer", "transformers"), "--peer runs greedy decoding only"),
        (
            ("--presence-penalty", "2.5"),
            "--presence-penalty must be in [-2, 2], as OpenAI defines it, not 2.5",
        ),
        (("--frequency-penalty", "nan"), "--frequency-penalty must be in [-2, 2]"),
        (("--min-p", "-0.1"), "--min-p must be in [0, 1]"),
        (("--repetition-penalty", "nan"), "--repetition-penalty must be in [0.001, 1000]"),
        (("--frequency-penalty", "0.5", "--peer", "transformers"), "--peer runs greedy decoding only"),
        (("--tokens", "0"), "--tokens must be at least 1, not 0"),
        (("--repeats", "0"), "--repeats must be at least 1, not 0"),
    ],
)
def test_bad_sampling_options_are_usage_errors(option, needle) -> None:
    out = strata("bench", "profiles/demo.toml", "--workload", "solo", *option)
    assert out.returncode == 2 and needle in out.stderr, out.stderr


def test_penalised_requests_reach_every_arm_and_batch_mtp_keeps_their_text() -> None:
    """--presence-penalty / --frequency-penalty reach every request; greedy with penalties is still exact
    under drafting, so batch MTP's text must equal serial windows'."""
    from rt_plans import make_plan

    from strata_runtime.api import SamplingParams
    from strata_runtime.bench.harness import workload_arrivals
    from strata_runtime.engine import Engine
    from strata_runtime.engine.sampling import Sampler

    penalised = SamplingParams(presence_penalty=1.5, frequency_penalty=0.5)
    tokenizer = Engine(make_plan(preset="tiny")).tokenizer
    arrivals = workload_arrivals("two-decodes", tokenizer, 12, 128, sampling=penalised)
    assert all(Sampler(a.request.sampling, 0).adjusts for a in arrivals)
    assert all(a.request.sampling.presence_penalty == 1.5 for a in arrivals)

    import argparse

    from strata_runtime.commands.bench import add_arguments, sampling_params

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--arm", "a=p.json", "--presence-penalty", "1.5", "--frequency-penalty", "0.5"])
    assert sampling_params(args) == penalised

    out = strata(
        *("bench", "profiles/demo.toml", "--workload", "two-decodes", "--arms", "serial,batch-mtp"),
        *("--repeats", "1", "--tokens", "24", "--presence-penalty", "1.5", "--frequency-penalty", "0.5"),
        "--json",
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["sampling"]["presence_penalty"] == 1.5 and res["sampling"]["frequency_penalty"] == 0.5
    assert res["arms"]["batch-mtp"]["two-decodes"]["text_equal_to_serial"] is True


def test_the_runtime_bench_refuses_bad_sampling_options_itself() -> None:
    """`python -m strata_runtime bench` is also run directly on plan files: it checks the options too."""
    out = subprocess.run(
        [sys.executable, "-m", "strata_runtime", "bench", "--arm", "a=plan.json", "--top-p", "1.5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "--top-p must be in (0, 1], not 1.5" in out.stderr, out.stderr


def test_repeats_far_apart_are_named_under_the_table() -> None:
    from strata_runtime.bench.table import SPREAD, spread_notes

    def case(*rates: float) -> dict:
        return {"median": {"tok_s": sorted(rates)[len(rates) // 2]}, "tok_s_repeats": list(rates)}

    summary = {
        "serial": {"2 clients": case(400.0, 410.0), "8 clients": case(690.0, 700.0)},
        "batch-mtp": {"2 clients": case(120.0, 480.0), "8 clients": case(660.0, 670.0)},
    }
    notes = spread_notes(summary)
    assert notes[0] == "" and len(notes) == 2
    assert "batch-mtp 2 clients: repeats of 120.0, 480.0 tok/s, 4.0x apart" in notes[1]
    at_edge = {"serial": {"solo": case(100.0, 100.0 * SPREAD * 0.99)}}
    assert spread_notes(at_edge) == []
    assert spread_notes({"serial": {"solo": case(250.0)}}) == []


def test_solo_fixed_arm_runs_beside_solo_whose_depth_is_chosen_per_window(tmp_path) -> None:
    """``--arms solo-fixed,solo`` compares the fixed and the (default) adaptive solo depth in one run; a
    sampled bench says that its seeded requests draft every proposal either way."""
    out = strata(
        *("bench", "profiles/demo.toml", "--workload", "solo", "--arms", "solo-fixed,solo"),
        *("--repeats", "1", "--tokens", "40", "--json", "--run-dir", str(tmp_path)),
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    arms = res["arms"]
    assert set(arms) == {"solo", "solo-fixed"} and res["base"] == "solo-fixed"  # no serial arm: the first
    adaptive = arms["solo"]["solo"]
    assert "gain_ci95" in adaptive and adaptive["text_equal_to_solo-fixed"] is True  # greedy: the same text
    assert all(arms[a]["solo"]["median"]["tok_s"] > 0 for a in arms)
    plans = {a: json.loads((tmp_path / f"{a}.json").read_text()) for a in arms}
    assert plans["solo"]["spec"]["adaptive_depth"] and not plans["solo-fixed"]["spec"]["adaptive_depth"]
    assert arms["solo"]["plan"]["adaptive_depth"] and not arms["solo-fixed"]["plan"]["adaptive_depth"]
    # Each arm's windows by kind: the fixed arm's solo windows draft all 3 proposals or none; the prompt's
    # window gives the first token and solo windows the rest, none more than its proposals and one.
    for arm in arms.values():
        mix = arm["solo"]["windows_by_kind"]
        assert sum(m["windows"] * m["tokens_per_window"] for m in mix.values()) == pytest.approx(40)
        assert mix["prefill"]["windows"] * mix["prefill"]["tokens_per_window"] == pytest.approx(1)
        for kind, m in mix.items():
            assert kind == "prefill" or 0 < m["tokens_per_window"] <= int(kind.split()[1]) + 1
            assert m["ms_per_window"] > 0
        both = "solo 0" in mix and any(k.startswith("solo ") and k != "solo 0" for k in mix)
        assert ("drafting" in arm["solo"]) == both  # what drafting saved, where it both ran and paused
    assert set(arms["solo-fixed"]["solo"]["windows_by_kind"]) <= {"prefill", "solo 0", "solo 3"}
    table = strata(
        *("bench", "profiles/demo.toml", "--workload", "solo", "--arms", "solo-fixed"),
        *("--repeats", "1", "--tokens", "12"),
    )
    assert table.returncode == 0, table.stderr
    assert (
        "solo-fixed solo windows (all repeats): prefill: 1 x " in table.stdout
        and "; solo 3: " in table.stdout
    )
    sampled = strata(
        *("bench", "profiles/demo.toml", "--workload", "solo", "--arms", "solo-adaptive"),
        *("--repeats", "1", "--tokens", "8", "--temperature", "0.7"),
    )
    assert sampled.returncode == 0, sampled.stderr
    assert "arm solo-adaptive sampled bench requests are seeded" in sampled.stderr
    unseeded = strata(
        *("bench", "profiles/demo.toml", "--workload", "solo", "--arms", "solo-adaptive"),
        *("--repeats", "1", "--tokens", "8", "--temperature", "0.7", "--unseeded"),
    )
    assert unseeded.returncode == 0, unseeded.stderr
    assert "seeded" not in unseeded.stderr
    assert "temperature 0.7, unseeded, medians of 1" in unseeded.stdout
    assert "gain vs solo-adaptive [95% CI]" in unseeded.stdout  # the only arm is the base


def test_unseeded_sampled_requests_carry_no_seed() -> None:
    from strata_runtime.api import SamplingParams
    from strata_runtime.bench.harness import workload_arrivals
    from strata_runtime.weights.tokenizer import ByteTokenizer

    sampled = SamplingParams(temperature=0.7)
    seeded = workload_arrivals("two-decodes", ByteTokenizer(259), 8, 128, sampling=sampled)
    unseeded = workload_arrivals("two-decodes", ByteTokenizer(259), 8, 128, sampling=sampled, seeded=False)
    assert [a.request.sampling.seed for a in seeded] == [0, 1]
    assert [a.request.sampling.seed for a in unseeded] == [None, None]


def test_over_http_unseeded_sampled_requests_carry_no_seed() -> None:
    from strata_cfg.bench.http_workloads import request_body

    sampled = {"temperature": 0.7, "top_p": 0.9}
    assert request_body("m", "hi", 8, sampled, 3)["seed"] == 3
    assert "seed" not in request_body("m", "hi", 8, sampled, 3, seeded=False)
    assert "seed" not in request_body("m", "hi", 8, None, 3)  # greedy
    assert request_body("m", "hi", 8, sampled, 3)["temperature"] == 0.7


def test_vary_reads_one_variant_per_value() -> None:
    from strata_cfg.commands.bench import parse_vary

    assert parse_vary("spec.draft_tokens=2, 3,4") == [("spec.draft_tokens", v) for v in (2, 3, 4)]
    assert parse_vary("split.layers=[20, 30]") == [("split.layers", [20, 30])]  # one TOML value
    assert parse_vary("spec.adaptive_depth=true,false") == [
        ("spec.adaptive_depth", True),
        ("spec.adaptive_depth", False),
    ]
    for bad, says in (("nokey", "--vary wants KEY="), ("spec.draft_tokens=2,,3", "an empty value")):
        with pytest.raises(ValueError, match=says):
            parse_vary(bad)


def test_a_bad_vary_value_is_named_as_the_vary_options_not_as_a_set() -> None:
    """A value of ``--vary`` the profile's schema refuses is reported against ``--vary`` (where the user wrote
    it) with its key and what was expected; the step workload refuses the run, and a decode workload the
    arm of that value."""
    vary = ("--vary", "model.decode_attention=auto,fast")
    step = strata("bench", "profiles/h200.toml", "--workload", "step", *vary)
    assert step.returncode == 1
    assert "--vary: model.decode_attention: expected 'auto' or 'cuda_cores'" in step.stderr
    assert "--set" not in step.stderr
    solo = strata(
        *("bench", "profiles/demo.toml", "--workload", "solo", "--arms", "solo", "--repeats", "1"),
        *("--tokens", "2", "--vary", "model.prefill_q=fp8", "--set", "model.decode_attention=oops"),
    )
    assert "strata bench: arm solo@prefill_q:fp8 refused:" in solo.stderr
    assert "  --vary: model.prefill_q: expected 'split' or 'fp16' (got \"fp8\")" in solo.stderr
    assert "  --set: model.decode_attention: expected" in solo.stderr  # what --set wrote stays --set's


def test_vary_runs_each_arm_once_per_value_interleaved(tmp_path) -> None:
    """A sweep of the solo depth in one run: one arm per value, each plan as the value says, the first the
    base (the gain of the others over it, and their greedy text equal to it). The arms' expert caches
    differ in shape (the plan without drafting has no MTP layer), and each still starts every repeat from
    a cache it can hold."""
    out = strata(
        *("bench", "profiles/demo.toml", "--workload", "solo", "--arms", "solo", "--repeats", "2"),
        *("--tokens", "24", "--vary", "spec.draft_tokens=0,2,4", "--json", "--run-dir", str(tmp_path)),
        *("--set", "spec.adaptive_depth=false"),  # each depth drafts as set, whatever the window times
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    names = ["solo@draft_tokens:0", "solo@draft_tokens:2", "solo@draft_tokens:4"]
    assert list(res["arms"]) == names and res["base"] == names[0]
    for name, tokens in zip(names, (0, 2, 4), strict=True):
        assert res["arms"][name]["plan"]["draft_tokens"] == tokens
        assert json.loads((tmp_path / f"{name}.json").read_text())["spec"]["draft_tokens"] == tokens
    for name in names[1:]:
        case = res["arms"][name]["solo"]
        assert case["text_equal_to_" + names[0]] is True and "gain_ci95" in case
        assert case["median"]["accepted_pct"] > 0  # these draft


TINY_TWO_SLOTS = """
[machine]
backend = "cpu"
gpus = [{ name = "virtual CPU device", vram_mib = 1024, bandwidth_gbs = 20 }]

[model]
synthetic = "tiny"

[batch]
slots = 2
mtp = true

[serve]
port = 8000
"""


def test_vary_over_the_routing_compares_each_arm_with_the_arm_of_its_kind_on_the_same_routing(
    tmp_path,
) -> None:
    """Other routing is another model with other text: batch MTP under calibrated routing is measured
    against serial windows under calibrated routing, for its gain and its text, and the run succeeds. Against
    the first arm (uniform routing) its text would differ and the run would fail."""
    profile = tmp_path / "tiny.toml"
    profile.write_text(TINY_TWO_SLOTS)
    args = (
        "bench",
        str(profile),
        "--workload",
        "two-decodes",
        "--arms",
        "serial,batch-mtp",
        "--repeats",
        "2",
    )
    args += ("--tokens", "16", "--vary", "model.routing=uniform,calibrated")
    out = strata(*args, "--json")
    assert out.returncode == 0, out.stderr
    arms = json.loads(out.stdout)["arms"]
    pairs = {"uniform": "serial@routing:uniform", "calibrated": "serial@routing:calibrated"}
    assert list(arms) == [*pairs.values(), "batch-mtp@routing:uniform", "batch-mtp@routing:calibrated"]
    for routing, serial in pairs.items():
        mtp = arms[f"batch-mtp@routing:{routing}"]["two-decodes"]
        assert mtp["reference"] == serial and mtp[f"text_equal_to_{serial}"] is True
        assert mtp["median"]["accepted_pct"] > 0 and "gain_ci95" in mtp
        own = arms[serial]["two-decodes"]
        assert own["reference"] == serial and "gain" not in own  # each routing's serial arm is its own base
    table = strata(*args)
    assert table.returncode == 0, table.stderr
    assert "gain vs its reference [95% CI]" in table.stdout and "DIFFERS" not in table.stdout
    row = next(line for line in table.stdout.splitlines() if line.startswith("batch-mtp@routing:calibrated"))
    assert "= serial@routing:calibrated" in row


def test_the_window_listing_gives_each_kinds_time_a_token_and_the_arms_totals() -> None:
    """Each arm's windows by kind come with the milliseconds a token of that kind cost (a window's time over
    its tokens) and, last, the arm's windows, time and tokens together: what two arms' rates differ by."""
    from strata_runtime.bench.table import window_mix_lines

    mix = {
        "prefill": {"windows": 7, "ms_per_window": 29.5, "tokens_per_window": 1.0},
        "solo 0": {"windows": 308, "ms_per_window": 3.09, "tokens_per_window": 1.0},
        "solo 3": {"windows": 210, "ms_per_window": 5.85, "tokens_per_window": 2.77},
    }
    lines = window_mix_lines({"solo-fixed": {"solo": {"windows_by_kind": mix}}})
    assert lines[0] == "" and lines[1].startswith(
        "solo-fixed solo windows (all repeats): prefill: 7 x 29.50 ms"
    )
    assert "solo 0: 308 x 3.09 ms, 1.00 tok (3.09 ms/tok)" in lines[1]
    assert "solo 3: 210 x 5.85 ms, 2.77 tok (2.11 ms/tok)" in lines[1]
    ms = 7 * 29.5 + 308 * 3.09 + 210 * 5.85
    tokens = 7 + 308 + 210 * 2.77
    assert lines[1].endswith(f"; all: 525 windows, {ms:,.0f} ms, {tokens:,.0f} tok")
    assert window_mix_lines({"serial": {"solo": {}}}) == []


def test_the_window_listing_says_what_a_request_alones_drafting_saved_or_cost() -> None:
    """Where a request alone drafted in some windows and not in others, the listing weighs each drafting
    window's time against its tokens at the rate of the windows without proposals: saved on a resident
    model's figures, cost under an expert cache's (one H200's runs), and in `--json` as ``drafting``."""
    from strata_runtime.bench.harness import drafting_balance
    from strata_runtime.bench.table import window_mix_lines

    resident = {
        "prefill": {"windows": 3, "ms_per_window": 9.26, "tokens_per_window": 1.0},
        "solo 0": {"windows": 89, "ms_per_window": 2.60, "tokens_per_window": 1.0},
        "solo 3": {"windows": 114, "ms_per_window": 5.36, "tokens_per_window": 2.56},
    }
    cached = {
        "solo 0": {"windows": 256, "ms_per_window": 8.27, "tokens_per_window": 1.0},
        "solo 2": {"windows": 58, "ms_per_window": 25.65, "tokens_per_window": 2.16},
    }
    saved, cost = drafting_balance(resident), drafting_balance(cached)
    assert saved is not None and cost is not None
    assert saved["saved_ms"] == pytest.approx(114 * (2.56 * 2.60 - 5.36))
    assert saved["share"] == pytest.approx(saved["saved_ms"] / (3 * 9.26 + 89 * 2.60 + 114 * 5.36))
    assert cost["saved_ms"] == pytest.approx(58 * (2.16 * 8.27 - 25.65)) and cost["saved_ms"] < 0
    assert drafting_balance({"solo 0": resident["solo 0"]}) is None  # drafting never ran
    assert drafting_balance({"solo 3": resident["solo 3"]}) is None  # nothing to weigh it against
    summary = {"a": {"solo": {"windows_by_kind": resident, "drafting": saved}}}
    summary["b"] = {"solo": {"windows_by_kind": cached, "drafting": cost}}
    lines = window_mix_lines(summary)
    assert lines[2] == (
        f"  drafting saved {saved['saved_ms']:,.0f} ms ({saved['share']:.1%} of the windows' time) against "
        "its tokens at the 2.60 ms a token of the windows without proposals"
    )
    assert lines[4].startswith(f"  drafting cost {-cost['saved_ms']:,.0f} ms (")


def test_the_adaptive_depths_expectations_are_set_beside_what_its_windows_gave() -> None:
    """Where the adaptive depth chose a request's windows (their records carry ``rates``), the bench sets
    what each depth was expected to give when it was chosen beside what its windows gave: per kind, the
    mean of the chosen depth's rate, and the windows' tokens over their milliseconds (`--json`:
    ``depth_calibration``)."""
    from strata_runtime.bench.harness import ArmRuns, depth_calibration, summarise
    from strata_runtime.bench.table import window_mix_lines

    def window(rows: int, ms: float, tokens: int, rates: list[float] | None) -> dict:
        w = {"window": f"solo {rows - 1}", "rows": rows, "ms": ms, "tokens": tokens}
        return w if rates is None else {**w, "rates": rates}

    records = [
        {"window": "prefill", "rows": 19, "ms": 130.0, "tokens": 1},
        window(3, 160.0, 1, None),  # before any window time was known: nothing to set beside it
        window(3, 30.0, 2, [0.15, 0.12, 0.16]),
        window(3, 25.0, 3, [0.14, 0.12, 0.18]),
        window(1, 8.0, 1, [0.13, 0.11, 0.10]),
        window(1, 7.0, 1, [0.14, 0.11, 0.10]),
    ]
    got = depth_calibration(records)
    assert set(got) == {"solo 0", "solo 2"}
    assert got["solo 2"]["windows"] == 2 and got["solo 2"]["expected_tok_per_ms"] == pytest.approx(0.17)
    assert got["solo 2"]["tok_per_ms"] == pytest.approx(5 / 55)
    assert got["solo 0"]["expected_tok_per_ms"] == pytest.approx(0.135)
    assert got["solo 0"]["tok_per_ms"] == pytest.approx(2 / 15)
    assert depth_calibration(records[:2]) == {}
    arm = ArmRuns("solo")
    arm.runs["solo"] = [{"tok_s": 90.0}, {"tok_s": 95.0}]
    arm.tokens["solo"] = [[1], [1]]
    arm.records["solo"] = [records[:4], records[4:]]  # two repeats: pooled
    entry = summarise({"solo": arm}, base="solo")["solo"]["solo"]
    assert entry["depth_calibration"] == got
    arm.windows["solo"] = [{"solo 2": [2, 55.0, 5], "solo 0": [2, 15.0, 2]}]
    lines = window_mix_lines(summarise({"solo": arm}, base="solo"))
    assert (
        "  the adaptive depth, expected when chosen against given: solo 0: 0.135 -> 0.133 tok/ms "
        "(2 windows); solo 2: 0.170 -> 0.091 tok/ms (2 windows)" in lines
    )


def test_each_repeats_windows_are_listed_beside_their_sum() -> None:
    """``windows_by_kind_repeats`` gives every repeat's windows by kind, in order, so a slow repeat shows
    what it spent its time on; added up they are ``windows_by_kind``."""
    from strata_runtime.bench.harness import ArmRuns, summarise

    arm = ArmRuns("solo")
    arm.runs["solo"] = [{"tok_s": 300.0}, {"tok_s": 400.0}]
    arm.tokens["solo"] = [[1, 2], [1, 2]]
    arm.windows["solo"] = [
        {"prefill": [1, 30.0, 1], "solo 3": [40, 240.0, 100]},  # the first repeat: full depth, slow
        {"prefill": [1, 28.0, 1], "solo 3": [30, 168.0, 90], "solo 0": [10, 27.0, 10]},
    ]
    entry = summarise({"solo": arm}, base="solo")["solo"]["solo"]
    each = entry["windows_by_kind_repeats"]
    assert [set(m) for m in each] == [{"prefill", "solo 3"}, {"prefill", "solo 0", "solo 3"}]
    assert each[0]["solo 3"] == {"windows": 40, "ms_per_window": 6.0, "tokens_per_window": 2.5}
    assert each[1]["solo 0"] == {"windows": 10, "ms_per_window": 2.7, "tokens_per_window": 1.0}
    total = entry["windows_by_kind"]["solo 3"]
    assert total["windows"] == 70 and total["ms_per_window"] == pytest.approx(408.0 / 70)
    # Over all repeats the request both drafted and paused: what drafting saved, at 2.7 ms a token.
    assert entry["drafting"]["saved_ms"] == pytest.approx(190 * 2.7 - 408.0)


def test_a_runs_window_records_count_from_its_first_window_and_its_slowest_are_its_longest() -> None:
    """`window_records` lists a run's windows in order, each with its place in the run counted from the
    run's first window, also when the engine's record no longer holds the earliest; `slowest_windows` names
    the longest of them that decode (not its prompt's), longest first."""
    from strata_runtime.bench.harness import slowest_windows, window_records
    from strata_runtime.engine.stats import WindowStat

    def win(kind: str, rows: int, ms: float, tokens: int) -> WindowStat:
        return WindowStat(kind, rows, ms, rows - 1, 0, (0,), tokens=tokens, caught_up=rows, draft_ms=ms / 10)

    older = [win("serial", 2, 99.0, 2)]  # an earlier run's window, not this run's
    run = [
        win("prefill", 19, 130.0, 1),
        win("solo", 4, 96.5, 3),
        win("solo", 1, 2.6, 1),
        win("solo", 4, 28.0, 2),
    ]
    records = window_records(older + run, len(run))
    assert [(w["index"], w["window"], w["ms"]) for w in records] == [
        (1, "prefill", 130.0),
        (2, "solo 3", 96.5),
        (3, "solo 0", 2.6),
        (4, "solo 3", 28.0),
    ]
    assert records[1] == {
        "index": 2,
        "window": "solo 3",
        "rows": 4,
        "ms": 96.5,
        "tokens": 3,
        "proposals": 3,
        "accepted": 0,
        "caught_up": 4,
        "draft_ms": 9.65,
        "finish_ms": 0.0,
    }
    slow = slowest_windows(records)
    assert [(w["window"], w["ms"], w["index"]) for w in slow] == [
        ("solo 3", 96.5, 2),
        ("solo 3", 28.0, 4),
        ("solo 0", 2.6, 3),
    ]
    # A record of the last 3 windows of a 4-window run: places still count from the run's first window.
    assert [w["index"] for w in slowest_windows(window_records(run[1:], len(run)), n=2)] == [2, 4]
    assert window_records(run, 0) == [] and slowest_windows([]) == []


def test_an_arms_slowest_windows_are_picked_over_its_repeats_and_listed_under_the_table() -> None:
    from strata_runtime.bench.harness import ArmRuns, summarise
    from strata_runtime.bench.table import slowest_lines

    arm = ArmRuns("solo")
    arm.runs["solo"] = [{"tok_s": 100.0}, {"tok_s": 110.0}]
    arm.tokens["solo"] = [[1], [1]]
    w = {"window": "solo 3", "rows": 4, "tokens": 3, "draft_ms": 0.04, "finish_ms": 0.5}
    prompt = {**w, "window": "prefill", "ms": 500.0, "index": 1}  # slowest of all, but not a decode window
    arm.records["solo"] = [
        [prompt, {**w, "ms": 40.0, "index": 2}, {**w, "ms": 9.0, "index": 7}],
        [
            prompt,
            {**w, "ms": 96.7, "index": 2},
            {**w, "ms": 3.0, "index": 3},
            {**w, "ms": 30.0, "index": 12, "caught_up": 64, "draft_ms": 6.25},
            {**w, "ms": 20.0, "index": 13},
            {**w, "ms": 25.0, "index": 14},
        ],
    ]
    summary = summarise({"solo": arm}, base="solo")
    slow = summary["solo"]["solo"]["slowest_windows"]
    assert [(s["ms"], s["repeat"]) for s in slow] == [(96.7, 2), (40.0, 1), (30.0, 2)]
    (line,) = slowest_lines(summary)
    assert line.startswith(
        "solo solo slowest decode windows: 96.7 ms, solo 3 (4 rows, 3 tok; host: drafting 0.0 ms before "
        "launch, finishing 0.5 ms; window 2 of repeat 2); "
    )
    assert line.endswith(
        "30.0 ms, solo 3 (4 rows, 3 tok, head caught up on 64 rows; host: drafting 6.2 ms before launch, "
        "finishing 0.5 ms; window 12 of repeat 2)"
    )
    assert slowest_lines({"serial": {"solo": {}}}) == []


def test_the_draft_heads_vary_as_arms_of_one_run_with_the_same_text(tmp_path) -> None:
    """``--vary spec.draft_head=shared,int8`` runs the MTP head through the model's LM head and through its
    8-bit copy as two arms of one run: each arm's plan says which, and greedy text is the same."""
    out = strata(
        *("bench", "profiles/demo.toml", "--workload", "solo", "--arms", "solo"),
        *("--vary", "spec.draft_head=shared,int8", "--repeats", "1", "--tokens", "24", "--json"),
        *("--run-dir", str(tmp_path)),
    )
    assert out.returncode == 0, out.stderr
    arms = json.loads(out.stdout)["arms"]
    heads = {name: arm["plan"]["draft_head"] for name, arm in arms.items()}
    assert sorted(heads.values()) == ["int8", "shared"], heads
    int8 = next(name for name, head in heads.items() if head == "int8")
    shared = next(name for name, head in heads.items() if head == "shared")
    assert arms[int8]["solo"][f"text_equal_to_{shared}"] is True
    assert "8-bit copy of the LM head" in out.stderr  # the int8 arm's engine says what its drafts read
    # and each arm's JSON keeps its own engine's start-up lines, as the figures' record of what ran
    assert any("8-bit copy of the LM head" in line for line in arms[int8]["startup"])
    assert not any("8-bit copy" in line for line in arms[shared]["startup"])
    assert all(arm["startup"][0].startswith("stages: cpu:0") for arm in arms.values())
