"""`strata generate` and `strata bench` as a new user runs them, on the embedded demo profile."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


def strata(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "strata_cfg", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_prints_json_with_tokens_text_and_accepted_proposals() -> None:
    out = strata(
        "generate", "profiles/demo.toml", "--prompt", "Hello", "--max-tokens", "24", "--json", "--quiet"
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert len(res["token_ids"]) == 24 and res["finish_reason"] == "length"
    assert res["text"] and res["accepted_proposals"] > 0


def test_generate_prints_each_tokens_logprobs_in_json_and_as_lines() -> None:
    """--logprobs N reaches the request through both generate commands: one entry per generated token, with
    N alternatives, most likely first (greedy: the token itself)."""
    args = ["generate", "profiles/demo.toml", "--prompt", "Hello", "--max-tokens", "8", "--quiet"]
    out = strata(*args, "--logprobs", "3", "--json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert [e["token"] for e in res["logprobs"]] == res["token_ids"]
    for e in res["logprobs"]:
        assert len(e["top"]) == 3 and e["top"][0]["token"] == e["token"] and e["logprob"] <= 0
    assert "logprobs" not in json.loads(strata(*args, "--json").stdout)
    lines = strata(*args, "--logprobs", "1").stdout.splitlines()
    assert len([line for line in lines if "(likeliest: " in line]) == len(res["token_ids"])


def test_generate_from_prompt_ids_streams_text() -> None:
    out = strata("generate", "--prompt-ids", "72,101,108", "--max-tokens", "12")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "proposals accepted" in out.stderr and "drafters: slots" in out.stderr


def test_generate_with_penalties_repeats_fewer_tokens() -> None:
    """--presence-penalty and --frequency-penalty reach the engine: greedy text with the largest penalties
    uses more distinct tokens than without them."""
    runs = {}
    for penalties in ((), ("--presence-penalty", "2", "--frequency-penalty", "2")):
        out = strata(
            "generate", "--prompt-ids", "72,101,108,108,111", "--max-tokens", "24", "--json", *penalties
        )
        assert out.returncode == 0, out.stderr
        runs[bool(penalties)] = json.loads(out.stdout)["token_ids"]
    assert len(set(runs[True])) > len(set(runs[False]))


def test_generate_replies_in_json_that_follows_a_schema_file_or_in_any_json_object(tmp_path) -> None:
    """--json-schema FILE and --json-object reach the request through both generate commands: the reply
    follows the schema and ends with `stop` once complete; any object starts as one (the demo model's
    strings run on, so it may end by length)."""
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 10},
            "year": {"type": "integer", "minimum": 1700, "maximum": 1900},
        },
        "required": ["title", "year"],
        "additionalProperties": False,
    }
    path = tmp_path / "book.json"
    path.write_text(json.dumps(schema))
    args = [
        "generate",
        "profiles/demo.toml",
        "--prompt",
        "A novel: ",
        "--max-tokens",
        "60",
        "--json",
        "--quiet",
    ]
    out = strata(*args, "--json-schema", str(path))
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    book = json.loads(res["text"])
    assert res["finish_reason"] == "stop" and list(book) == ["title", "year"]
    assert len(book["title"]) <= 10 and 1700 <= book["year"] <= 1900
    free = json.loads(strata(*args, "--json-object").stdout)
    assert free["text"].startswith("{") and free["error"] is None
    both = strata(*args, "--json-object", "--json-schema", str(path))
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_generate_replies_with_one_of_the_choices_or_text_that_matches_a_regex() -> None:
    args = ["generate", "profiles/demo.toml", "--prompt", "Is it fine? ", "--json", "--quiet"]
    for temperature in ("0", "1"):
        sampled = ["--temperature", temperature, "--seed", "2"]
        chose = json.loads(strata(*args, *sampled, "--choice", "yes", "--choice", "not at all").stdout)
        assert chose["text"] in ("yes", "not at all") and chose["finish_reason"] == "stop"
        year = json.loads(strata(*args, *sampled, "--regex", "1[78][0-9]{2}").stdout)
        assert re.fullmatch("1[78][0-9]{2}", year["text"]) and year["finish_reason"] == "stop"
    empty = strata(*args, "--choice", "")
    assert empty.returncode == 2 and "--choice must not be empty" in empty.stderr


def test_bench_holds_every_reply_to_a_shape_in_every_arm_with_equal_text() -> None:
    """--choice (like --json-schema, --json-object and --regex) reaches every request of every arm: a
    two-letter choice ends each reply after its two tokens, where a free reply runs to its 24, in an arm
    that drafts and one that does not, with the same text; the table says what the replies were held to."""
    args = ["bench", "profiles/demo.toml", "--workload", "solo", "--arms", "solo", "--tokens", "24"]
    out = strata(*args, "--repeats", "1", "--choice", "ab", "--vary", "spec.draft_tokens=0,4", "--json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["held_to"] == "one of 'ab'" and len(res["arms"]) == 2
    for arm in res["arms"].values():
        kinds = arm["solo"]["windows_by_kind"].values()
        assert sum(k["windows"] * k["tokens_per_window"] for k in kinds) == 2
        assert all(v for k, v in arm["solo"].items() if k.startswith("text_equal_to_"))
    table = strata(*args, "--repeats", "1", "--regex", "[a-z]{1,8}").stdout
    assert "every reply held to the regex '[a-z]{1,8}'" in table
    for refused in ([*args, "--peer", "llama.cpp"], [*args[:2], "--workload", "step"]):
        out = strata(*refused, "--json-object")
        assert out.returncode == 2 and "are not measured by" in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("option", "needle"),
    [
        (("--json-schema", "/nonexistent/s.json"), "--json-schema /nonexistent/s.json: cannot read it"),
        (("--temperature", "0.5", "--top-p", "1.5"), "--top-p must be in (0, 1], not 1.5"),
        (("--top-k", "-1"), "--top-k must be at least 0"),
        (("--presence-penalty", "3"), "--presence-penalty must be in [-2, 2], as OpenAI defines it, not 3.0"),
        (("--frequency-penalty", "-2.5"), "--frequency-penalty must be in [-2, 2]"),
        (("--min-p", "1.5"), "--min-p must be in [0, 1] (0: no cut), not 1.5"),
        (("--repetition-penalty", "0"), "--repetition-penalty must be in [0.001, 1000] (1: none), not 0.0"),
        (("--max-tokens", "0"), "--max-tokens must be at least 1, not 0"),
        (("--seed", "-1"), "--seed must be in [0, 2^63), not -1"),
        (("--logprobs", "21"), "--logprobs must be in [0, 20]"),
        (("--logprobs", "-1"), "--logprobs must be in [0, 20]"),
        (("--stop", ""), "--stop must not be empty"),
        (("--bad-word", " "), "--bad-word must not be blank"),
    ],
)
def test_generate_refuses_bad_sampling_options_naming_them(option, needle) -> None:
    out = strata("generate", "--prompt", "Hello", "--max-tokens", "4", *option)
    assert out.returncode == 2 and needle in out.stderr, out.stderr


def test_generate_takes_min_p_the_repetition_penalty_and_bad_words() -> None:
    """``--min-p 1`` leaves a hot sample the greedy text; ``--repetition-penalty`` changes the greedy
    reply; ``--bad-word`` keeps a word of the greedy reply out of it."""
    greedy = strata("generate", "--prompt", "Hello", "--max-tokens", "12", "--json")
    pinned = strata(
        "generate",
        "--prompt",
        "Hello",
        "--max-tokens",
        "12",
        "--json",
        "--temperature",
        "1.5",
        "--min-p",
        "1",
    )
    repeats = strata(
        "generate", "--prompt", "Hello", "--max-tokens", "12", "--json", "--repetition-penalty", "5"
    )
    assert greedy.returncode == pinned.returncode == repeats.returncode == 0, pinned.stderr + repeats.stderr
    text = [json.loads(out.stdout)["text"] for out in (greedy, pinned, repeats)]
    assert text[0] == text[1] != text[2]
    word = next(w for w in text[0].split() if len(w) >= 2)  # a word of the greedy reply, which it bans
    banned = strata("generate", "--prompt", "Hello", "--max-tokens", "12", "--json", "--bad-word", word)
    assert banned.returncode == 0, banned.stderr
    assert word not in json.loads(banned.stdout)["text"]


def test_a_schema_file_that_is_not_a_json_object_is_refused_naming_the_file_and_place(tmp_path) -> None:
    bad, listed = tmp_path / "bad.json", tmp_path / "list.json"
    bad.write_text('{\n  "type": "object",\n  "properties": {,}\n}\n')
    listed.write_text("[1, 2]")
    out = strata("generate", "--prompt", "x", "--json-schema", str(bad))
    assert out.returncode == 2 and f"--json-schema {bad}: not JSON at line 3, column 18" in out.stderr
    out = strata("generate", "--prompt", "x", "--json-schema", str(listed))
    assert out.returncode == 2 and "a JSON schema is an object, not a list" in out.stderr
    schema = tmp_path / "nonsense.json"
    schema.write_text('{"type": "nonsense"}')
    args = ["generate", "--prompt", "x", "--json-schema", str(schema), "--json", "--quiet"]
    res = json.loads(strata(*args).stdout)  # JSON, but not a schema: the request ends at once, saying why
    assert (
        res["finish_reason"] == "error"
        and res["error"].startswith("grammar: ")
        and "nonsense" in res["error"]
    )


def test_the_runtime_generate_refuses_bad_sampling_options_itself(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "strata_runtime", "generate", "--plan", str(tmp_path / "p.json")]
        + ["--presence-penalty", "9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "--presence-penalty must be in [-2, 2]" in out.stderr, out.stderr


@pytest.mark.parametrize("workload", ["two-decodes", "read-beside-decode"])
def test_bench_runs_every_arm_with_equal_text(workload) -> None:
    # spec.adaptive_depth off: every arm drafts as its plan says, whatever this machine's window times are
    # (with it on, batch MTP gives way to serial windows wherever they measure faster, as on a busy 2-core
    # runner, and then nothing is drafted to count).
    out = strata(
        *("bench", "profiles/demo.toml", "--workload", workload, "--tokens", "16", "--repeats", "2"),
        *("--set", "spec.adaptive_depth=false", "--json"),
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert set(res["arms"]) == {"serial", "pipelined", "batch-mtp", "solo"}
    for name, arm in res["arms"].items():
        case = arm[workload]
        assert case["repeats"] == 2 and case["median"]["tok_s"] > 0
        if name != "serial":
            assert case["text_equal_to_serial"] and "gain_ci95" in case
    assert res["arms"]["batch-mtp"]["plan"]["batch_mtp"] and res["arms"]["pipelined"]["plan"]["groups"] == 2
    if workload == "two-decodes":
        assert res["arms"]["batch-mtp"][workload]["median"]["accepted_pct"] > 0
        assert (
            res["arms"]["pipelined"][workload]["median"]["accepted_pct"] == 0
        )  # pipelined groups draft nothing
        # Batch MTP sends two rows per slot: its windows are wider than the pipelined groups' one row each.
        assert (
            res["arms"]["batch-mtp"][workload]["median"]["rows_per_window"]
            > res["arms"]["pipelined"][workload]["median"]["rows_per_window"]
        )


def test_bench_table_says_when_an_arm_is_forced() -> None:
    out = strata(
        "bench",
        "profiles/demo.toml",
        "--set",
        "spec.draft_tokens=0",
        "--arms",
        "serial,batch-mtp",
        "--tokens",
        "8",
        "--repeats",
        "1",
    )
    assert "arm batch-mtp forced: runs as serial, 1 group(s), batch MTP off" in out.stderr
    assert "gain vs serial" in out.stdout
    assert "workload two-decodes: 8 tokens per request, greedy, medians of 1" in out.stdout


def test_generate_passes_ignore_eos_to_the_runtimes_request() -> None:
    """`strata generate --ignore-eos` reaches the runtime command, which puts it on its request (what the
    flag does to a request: tests/test_rt_stop_strings.py)."""
    import argparse

    from strata_cfg.commands import generate as cfg_generate
    from strata_runtime.commands import generate as rt_generate

    parser = argparse.ArgumentParser()
    cfg_generate.add_arguments(parser)
    forwarded = cfg_generate.runtime_args(parser.parse_args(["profiles/demo.toml", "--ignore-eos"]))
    assert "--ignore-eos" in forwarded
    assert "--ignore-eos" not in cfg_generate.runtime_args(parser.parse_args(["profiles/demo.toml"]))
    runtime = argparse.ArgumentParser()
    rt_generate.add_arguments(runtime)
    assert runtime.parse_args(["--plan", "p.json", *forwarded]).ignore_eos is True


def chat(lines: list[str], *args: str) -> tuple[list[dict], str]:
    """`strata chat` on the demo with ``lines`` as its input, greedy: each turn's JSON object, and stderr."""
    out = subprocess.run(
        [sys.executable, "-m", "strata_cfg", "chat", "profiles/demo.toml", "--json", "--quiet"]
        + ["--temperature", "0", *args],
        input="".join(line + "\n" for line in lines),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()], out.stderr


def test_chat_sends_the_whole_conversation_each_turn_and_reuses_the_kept_history() -> None:
    """Each turn's prompt is the conversation so far through the chat template: the second holds the first
    turn and its reply, and reads only what is new (the slot kept the rest); `/reset` starts again, so the
    same first message gets the same prompt and (greedy) the same reply, which is `strata generate
    --chat`'s for that message."""
    turns, _ = chat(
        ["Tell me about Emma.", "And her father?", "/reset", "Tell me about Emma."], "--max-tokens", "24"
    )
    first, second, again = turns
    assert len(turns) == 3
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]
    assert second["cached_tokens"] >= first["prompt_tokens"] + first["completion_tokens"] - 2
    assert (again["prompt_tokens"], again["reply"]) == (first["prompt_tokens"], first["reply"])
    one = strata(
        "generate", "profiles/demo.toml", "--chat", "--prompt", "Tell me about Emma.", "--max-tokens", "24"
    )
    assert one.returncode == 0 and one.stdout.rstrip("\n") == first["reply"]


def test_chat_leaves_the_oldest_turns_out_where_the_conversation_outgrows_the_context() -> None:
    """With a 256-token context and 40-token replies, long messages soon do not fit with all the turns
    before them: the oldest are left out (in pairs of a message and its reply, the system message kept),
    every prompt leaves room for a reply, and a message that cannot fit even alone is not sent."""
    long = [f"Message {i}: " + "the quick brown fox jumps over the lazy dog " * 2 for i in range(6)]
    turns, err = chat(
        [*long, "x" * 400, "short"],
        "--max-tokens",
        "40",
        "--set",
        "memory.context=256",
        "--system",
        "Be brief.",
    )
    assert len(turns) == 7 and "(not sent:" in err
    assert all(t["prompt_tokens"] + 16 <= 256 for t in turns)
    dropped = [t["dropped_messages"] for t in turns]
    assert dropped[0] == 0 and sum(dropped) > 0 and all(d % 2 == 0 for d in dropped)
    assert sum(dropped) <= 2 * len(turns)  # each message is left out once, for good


@pytest.mark.parametrize(
    ("option", "needle"),
    [
        (("--max-tokens", "0"), "--max-tokens must be at least 1"),
        (("--top-p", "0"), "--top-p must be in (0, 1]"),
        (("--seed", "-1"), "--seed"),
        (("--thinking-budget", "0"), "--thinking-budget must be at least 1"),
        (("--thinking-budget", "9", "--no-think"), "give one of them"),
    ],
)
def test_chat_refuses_bad_options_naming_them(option, needle) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "strata_cfg", "chat", "profiles/demo.toml", *option],
        input="hi\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and needle in out.stderr, out.stderr


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory):
    """The demo launched with a 256-token context and an API key (in ``STRATA_TEST_KEY``)."""
    from srv_helpers import launch

    launched = launch(tmp_path_factory.mktemp("chat-url"), "memory.context=256", key="chat-url-key")
    yield launched
    launched.stop()


def chat_url(server, lines: list[str], *args: str) -> tuple[list[dict], str]:
    """`strata chat --url` with ``lines`` as its input, greedy: each turn's JSON object, and stderr."""
    out = subprocess.run(
        [sys.executable, "-m", "strata_cfg", "chat", "--url", server.url, "--api-key-env", "STRATA_TEST_KEY"]
        + ["--json", "--quiet", "--temperature", "0", *args],
        input="".join(line + "\n" for line in lines),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "STRATA_TEST_KEY": server.key},
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()], out.stderr


def test_chat_with_a_launched_engine_over_http_is_the_chat_run_here(small_server) -> None:
    """`strata chat --url`: each turn sends the conversation to the engine's chat endpoint and streams the
    reply back; greedy, the replies and prompts are those of the chat run here on the same profile, and the
    second turn reuses the first's kept tokens."""
    lines = ["Tell me about Emma.", "And her father?"]
    over_http, _ = chat_url(small_server, lines, "--max-tokens", "24")
    here, _ = chat(lines, "--max-tokens", "24", "--set", "memory.context=256")
    assert [(t["reply"], t["prompt_tokens"]) for t in over_http] == [
        (t["reply"], t["prompt_tokens"]) for t in here
    ]
    assert over_http[1]["cached_tokens"] > 0 and over_http[0]["finish_reason"] in ("length", "stop")


def test_chat_over_http_leaves_the_oldest_turns_out_where_the_engine_says_they_do_not_fit(
    small_server,
) -> None:
    """With a 256-token context and 40-token replies, the engine refuses a history that leaves no room
    (``context_length_exceeded``): the oldest turns are left out, a message and its reply together, until
    it fits; a message that cannot fit alone is not sent, and the conversation goes on after it."""
    long = [f"Message {i}: " + "the quick brown fox jumps over the lazy dog " * 2 for i in range(6)]
    turns, err = chat_url(
        small_server, [*long, "x" * 400, "short"], "--max-tokens", "40", "--system", "Be brief."
    )
    assert len(turns) == 7 and "(not sent:" in err and "context" in err
    assert all(t["prompt_tokens"] + 40 <= 256 for t in turns)
    dropped = [t["dropped_messages"] for t in turns]
    assert dropped[0] == 0 and sum(dropped) > 0 and all(d % 2 == 0 for d in dropped)


def test_chat_refuses_a_url_beside_a_profile_or_a_key_without_one() -> None:
    for argv, needle in (
        (["profiles/demo.toml", "--url", "http://127.0.0.1:9"], "one of them"),
        (["--api-key-env", "X"], "goes with --url"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "strata_cfg", "chat", *argv],
            input="",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and needle in out.stderr, out.stderr
