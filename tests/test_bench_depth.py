"""`strata bench --depth N`: decoding requests read a prompt of N fresh ids first, so they decode from KV
that deep; in process, over HTTP and for the llama.cpp peer alike, and refused where it cannot run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from strata_cfg.schema.workloads import DEPTH_WORKLOADS, depth_problem, depth_prompt


def strata(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "strata_cfg", *args], capture_output=True, text=True, timeout=300
    )


def test_each_decoding_request_reads_its_own_seeded_prompt_of_the_depth() -> None:
    from strata_runtime.bench.harness import mean_prompt_tokens, workload_arrivals
    from strata_runtime.weights.tokenizer import ByteTokenizer

    tok = ByteTokenizer(259)
    for workload, streams in (("solo", 1), ("two-decodes", 2), ("clients", 4)):
        arrivals = workload_arrivals(workload, tok, 8, 1024, 4, vocab=259, depth=300)
        prompts = [a.request.prompt_ids for a in arrivals]
        assert len(prompts) == streams and all(len(p) == 300 for p in prompts)
        assert prompts == [depth_prompt(300, 259, i) for i in range(streams)]
        assert len(set(prompts)) == streams  # each stream its own text
        assert all(a.request.max_tokens == 8 for a in arrivals)
        assert mean_prompt_tokens(workload, tok, 8, 1024, 4, depth=300, vocab=259) == 300
    # Without a depth, the short text prompts as before.
    (short,) = workload_arrivals("solo", tok, 8, 1024, vocab=259)
    assert len(short.request.prompt_ids) < 40 and short.request.prompt_ids != depth_prompt(
        len(short.request.prompt_ids), 259, 0
    )
    # The same prompt in every repeat and arm (the harness seeds repeats by `seed`, not the depth's).
    again = workload_arrivals("solo", tok, 8, 1024, vocab=259, depth=300, seed=5)
    assert again[0].request.prompt_ids == depth_prompt(300, 259, 0)


def test_depth_problems_name_the_flag_and_the_setting_to_change() -> None:
    assert depth_problem("solo", 0, 300, 10) is None  # no depth: nothing to check
    assert "at least 0" in str(depth_problem("solo", -1, 8, None))
    assert "not prompt" in str(depth_problem("prompt", 100, 8, None))
    assert set(DEPTH_WORKLOADS) == {"solo", "two-decodes", "clients", "step"}
    assert depth_problem("solo", 1000, 24, 1024) is None  # 1000 + 24 fits exactly
    text = str(depth_problem("solo", 1001, 24, 1024))
    assert "a prompt of 1001 tokens and 24 generated after it need a context of 1025" in text
    assert "pass --set memory.context=1025" in text
    assert depth_problem("step", 1023, 300, 1024) is None  # a row at the last position
    assert "position 1024 needs a context of 1025" in str(depth_problem("step", 1024, 300, 1024))
    launched = str(depth_problem("two-decodes", 1001, 24, 1024, launched=True))
    assert "engine's memory.context is 1024" in launched and "--set" not in launched


def test_the_bench_refuses_a_depth_it_cannot_run() -> None:
    out = strata("bench", "profiles/demo.toml", "--workload", "prompt", "--depth", "100")
    assert out.returncode == 2 and "--depth applies to the" in out.stderr and out.stdout == ""
    out = strata("bench", "profiles/demo.toml", "--workload", "solo", "--arms", "solo", "--depth", "1000")
    assert out.returncode == 2
    assert "pass --set memory.context=1300" in out.stderr and out.stdout == ""


def test_a_solo_run_at_a_depth_reads_it_and_says_so() -> None:
    out = strata(
        *("bench", "profiles/demo.toml", "--workload", "solo", "--arms", "solo,serial"),
        *("--repeats", "1", "--tokens", "12", "--depth", "400", "--json"),
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["depth"] == 400
    for arm in ("solo", "serial"):
        case = res["arms"][arm]["solo"]
        m = case["median"]
        assert m["generation_tok_s"] > 0
        # Every row the windows ran: the 400 of the prompt, then one or a few a token.
        windows = sum(k["windows"] for k in case["windows_by_kind"].values())
        assert 400 <= m["rows_per_window"] * windows < 400 + 4 * 12
    table = strata(
        *("bench", "profiles/demo.toml", "--workload", "solo", "--arms", "solo"),
        *("--repeats", "1", "--tokens", "12", "--depth", "400"),
    )
    assert table.returncode == 0, table.stderr
    assert "each after a prompt of 400 tokens" in table.stdout


def test_the_llama_cpp_peer_decodes_at_the_same_depth() -> None:
    from strata_runtime.bench import llamacpp

    tools = {"llama-bench": "lb", "llama-batched-bench": "lbb"}
    solo = llamacpp.Workload("solo", 64, 0, 2, (), depth=8000)
    ((_, cmd),) = llamacpp.commands(tools, "m.gguf", solo)
    assert cmd[cmd.index("-d") + 1] == "8000" and cmd[cmd.index("-n") + 1] == "64"
    flat = llamacpp.Workload("solo", 64, 0, 2, ())
    ((_, cmd),) = llamacpp.commands(tools, "m.gguf", flat)
    assert "-d" not in cmd
    deep = llamacpp.Workload("clients", 64, 0, 2, (1, 2), stream_prompt=8000, depth=8000)
    _, many = [c for _, c in llamacpp.commands(tools, "m.gguf", deep)]
    assert many[many.index("-npp") + 1] == "8000"
    text = json.dumps(
        [
            {"n_prompt": 0, "n_gen": 64, "n_depth": 8000, "avg_ts": 150.0},
            {"n_prompt": 0, "n_gen": 64, "avg_ts": 1},
        ]
    )
    deep_fig, flat_fig = llamacpp.parse_llama_bench(text)
    assert (deep_fig.case, deep_fig.what, deep_fig.tok_s) == ("solo", "tg64 @ d8000", 150.0)
    assert flat_fig.what == "tg64"


def test_over_http_each_decoding_request_sends_the_depths_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    import strata_cfg.bench.http_workloads as hw

    sent: list[dict] = []

    def fake_stream(client, body, t0, stream, watch) -> None:
        sent.append(body)
        stream.tokens, stream.first, stream.done = 1, 0.0, 0.0

    monkeypatch.setattr(hw, "_stream", fake_stream)
    monkeypatch.setattr(hw, "served_model", lambda url, key: "m")
    hw.http_run(
        "http://x",
        "two-decodes",
        clients=1,
        tokens=8,
        context=4096,
        vocab=300,
        api_key=None,
        depth=500,
        windows=False,
    )
    assert [b["prompt"] for b in sent] == [list(depth_prompt(500, 300, i)) for i in range(2)]
    sent.clear()
    hw.http_run("http://x", "solo", clients=1, tokens=8, context=4096, vocab=300, api_key=None, windows=False)
    assert isinstance(sent[0]["prompt"], str)  # the short text prompt without a depth


def test_the_step_workload_takes_the_depth_as_its_rows_position() -> None:
    import argparse

    from strata_cfg.commands import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    step = bench.bench_argv(
        parser.parse_args(["profiles/h200.toml", "--workload", "step", "--depth", "8000"])
    )
    assert step[step.index("--position") + 1] == "8000" and "--depth" not in step
    solo = bench.bench_argv(
        parser.parse_args(["profiles/h200.toml", "--workload", "solo", "--depth", "8000"])
    )
    assert solo[solo.index("--depth") + 1] == "8000" and "--position" not in solo
    flat = bench.bench_argv(parser.parse_args(["profiles/h200.toml", "--workload", "step"]))
    assert "--position" not in flat and "--depth" not in flat  # the runtime's position 300
