"""`strata bench --url` against several servers: interleaved case by case and repeat by repeat, each compared
with the first, a server other than strata measured without window statistics, and the options that name
them. The servers are stood in for here (`tests/test_srv_openai.py` runs a launched engine beside a stand-in
OpenAI-compatible server end to end)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from strata_cfg.bench import http_workloads
from strata_cfg.commands.bench import _url_item

STATUS = {
    "plan": {
        "memory": {"context": 1024},
        "model": {"facts": {"vocab_size": 384}},
        "batch": {"mode": "serial", "groups": 1, "mtp": True, "slots": 2},
    },
    "engine": {"totals": {}},
}


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every http_run call in order; server A (a strata engine) runs at 100 tok/s, B (another server) at
    150 and C (another strata engine) at 50."""
    made: list[dict[str, Any]] = []
    rates = {"http://a": 100.0, "http://b": 150.0, "http://c": 50.0}

    def status(url: str, api_key: str | None = None) -> dict[str, Any] | None:
        return None if url == "http://b" else STATUS

    def run(url: str, workload: str, **kw: Any) -> dict[str, float]:
        made.append({"url": url, "workload": workload, **kw})
        out = {"tok_s": rates[url] + kw["seed"]}  # each repeat a little faster
        if kw["windows"]:
            out |= {"ms_per_window": 2.0, "rows_per_window": 1.5, "accepted_pct": 50.0}
        return out

    monkeypatch.setattr(http_workloads, "engine_status", status)
    monkeypatch.setattr(http_workloads, "http_run", run)
    return made


def test_servers_run_interleaved_and_each_is_compared_with_the_first(calls) -> None:
    seen: list[tuple[str, str, int, float]] = []
    res = http_workloads.bench_urls(
        {"a": "http://a", "b": "http://b", "c": "http://c"},
        "clients",
        tokens=8,
        repeats=3,
        on_run=lambda name, case, r, fig: seen.append((name, case, r, fig["tok_s"])),
    )
    # Each run reported as it ends (the command's progress lines), in the order it ran.
    assert seen[:4] == [
        ("a", "1 clients", 0, 100.0),
        ("b", "1 clients", 0, 150.0),
        ("c", "1 clients", 0, 50.0),
        ("a", "2 clients", 0, 100.0),
    ]
    assert len(seen) == 3 * 4 * 3
    # Repeat by repeat, case by case, every server in turn.
    order = [(c["seed"], c["clients"], c["url"]) for c in calls]
    assert order == [
        (r, n, u) for r in range(3) for n in (1, 2, 4, 8) for u in ("http://a", "http://b", "http://c")
    ]
    assert res["base"] == "a" and list(res["arms"]) == ["a", "b", "c"]
    a, b, c = (res["arms"][n] for n in "abc")
    assert (a["server"], b["server"], c["server"]) == ("strata", "openai-compatible", "strata")
    assert b["plan"] is None and a["plan"] == {"mode": "serial", "groups": 1, "batch_mtp": True, "slots": 2}
    case = b["cases"]["4 clients"]
    assert len(case["runs"]) == 3 and case["median"]["tok_s"] == 151.0
    assert case["ratio"] == pytest.approx(151.0 / 101.0)
    lo, hi = case["ratio_ci95"]
    assert 150.0 / 102.0 <= lo <= case["ratio"] <= hi <= 152.0 / 100.0
    assert c["cases"]["1 clients"]["ratio"] == pytest.approx(51.0 / 101.0)
    assert "ratio" not in a["cases"]["1 clients"]  # the base
    # Window statistics only from strata engines; every server gets the same prompt ids (bytes, as one
    # of them is another server).
    assert "ms_per_window" not in case["median"] and a["cases"]["1 clients"]["median"]["ms_per_window"] == 2.0
    assert {c["vocab"] for c in calls} == {256} and {c["context"] for c in calls} == {1024}
    assert [c["windows"] for c in calls[:3]] == [True, False, True]
    lines = http_workloads.bench_lines(res)
    row = next(ln for ln in lines if ln.startswith("4 clients b"))
    assert "151.0" in row and "1.50x" in row and row.split()[4:7] == ["-", "-", "-"]
    assert any("b: http://b: an OpenAI-compatible server other than strata" in ln for ln in lines)


def test_ignore_eos_reaches_every_request_of_every_server(calls) -> None:
    http_workloads.bench_urls({"a": "http://a", "b": "http://b"}, "two-decodes", repeats=1, ignore_eos=True)
    assert [c["ignore_eos"] for c in calls] == [True, True]
    body = http_workloads.request_body("m", "hi", 8, None, 0, ignore_eos=True)
    assert body["ignore_eos"] is True and "ignore_eos" not in http_workloads.request_body(
        "m", "hi", 8, None, 0
    )


def test_only_strata_engines_give_the_prompt_ids_their_vocabulary(calls) -> None:
    http_workloads.bench_urls({"a": "http://a", "c": "http://c"}, "prompt", repeats=1, prompt_tokens=100)
    assert {c["vocab"] for c in calls} == {384}
    with pytest.raises(ValueError, match="at most 1023"):
        http_workloads.bench_urls({"a": "http://a"}, "prompt", repeats=1, prompt_tokens=1024)
    with pytest.raises(ValueError, match="none of the URLs is a strata engine"):
        http_workloads.bench_urls({"b": "http://b"}, "read-beside-decode", repeats=1)


def test_conversations_outnumber_the_most_slots_a_strata_server_has_and_need_one(calls) -> None:
    """Every server gets one conversation more than the strata servers' most slots (2 here, so 3), a
    server other than strata too; without a strata server among the URLs nothing counts the slots."""
    res = http_workloads.bench_urls(
        {"a": "http://a", "b": "http://b"}, "conversations", repeats=1, prompt_tokens=100, tokens=8
    )
    assert [(c["url"], c["clients"]) for c in calls] == [("http://a", 3), ("http://b", 3)]
    assert res["conversations"] == 3
    assert "3 conversations of 4 turns (one more than the most slots" in http_workloads.bench_lines(res)[0]
    with pytest.raises(ValueError, match="conversations sends one conversation more than a strata engine"):
        http_workloads.bench_urls({"b": "http://b"}, "conversations", repeats=1, prompt_tokens=100)


def test_one_server_keeps_the_one_server_layout(calls) -> None:
    res = http_workloads.bench_url("http://b", "two-decodes", tokens=8, repeats=2)
    assert res["url"] == "http://b" and res["server"] == "openai-compatible" and res["plan"] is None
    assert list(res["cases"]) == ["two-decodes"] and len(res["cases"]["two-decodes"]["runs"]) == 2
    lines = http_workloads.bench_lines(res)
    assert lines[1] == "an OpenAI-compatible server other than strata (no window statistics)"


def test_a_url_is_named_by_the_user_or_by_its_host_and_port() -> None:
    assert _url_item("llama=http://127.0.0.1:8080") == ("llama", "http://127.0.0.1:8080")
    assert _url_item("http://127.0.0.1:8000/v1") == ("127.0.0.1:8000", "http://127.0.0.1:8000/v1")
    assert _url_item("http://h:1/x?a=b") == ("h:1", "http://h:1/x?a=b")  # "=" after the scheme: no name
    with pytest.raises(argparse.ArgumentTypeError, match=r"\[NAME=\]http://HOST:PORT"):
        _url_item("vllm=localhost:8000")


def test_ignore_eos_is_for_launched_servers() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "strata_cfg", "bench", "profiles/demo.toml", "--ignore-eos"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--ignore-eos asks launched servers (--url)" in out.stderr, out.stderr


@pytest.mark.parametrize(
    "extra",
    [
        ["profiles/demo.toml"],
        ["--arms", "serial"],
        ["--peer", "llama.cpp"],
        ["--set", "batch.slots=4"],
        ["--cold-experts"],
        ["--cold-drafting"],
    ],
)
def test_options_that_shape_in_process_arms_are_refused_with_url(extra: list[str]) -> None:
    """A launched server runs as it was started: what would shape an in-process arm is a usage error with
    --url, not silently ignored."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "strata_cfg", "bench", "--url", "http://127.0.0.1:9", *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--url measures launched servers as they run" in out.stderr, out.stderr


@pytest.mark.parametrize("flag", ["--cold-experts", "--cold-drafting"])
def test_a_cold_start_flag_with_url_is_named_in_its_refusal(flag: str) -> None:
    """A launched server's expert caches and drafting are measured as they are: the refusal names the flag
    that does not apply."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "strata_cfg", "bench", "--url", "http://127.0.0.1:9", flag],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and f"{flag} does not apply" in out.stderr, out.stderr


def test_two_urls_with_one_name_are_a_usage_error() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata_cfg",
            "bench",
            "--url",
            "a=http://127.0.0.1:9",
            "--url",
            "a=http://h:1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "two --url share a name; name them NAME=URL" in out.stderr, out.stderr


def test_a_streams_longest_gap_is_its_longest_wait_between_two_chunks_after_the_first(monkeypatch) -> None:
    """Over HTTP the longest gap is timed as the chunks of the stream arrive, the wait for the first chunk
    left out, as the in-process harness times deliveries."""
    import time

    waits = [0.25, 0.0, 0.15, 0.0]  # before each chunk: the first's wait is not a gap

    class Response:
        status = 200

        def read(self, *a: Any) -> bytes:
            return b""

    class FakeClient:
        def post_completion(self, body: dict[str, Any]) -> Response:
            return Response()

        def close(self) -> None:
            pass

    def chunks(r: Any):
        for w in waits:
            time.sleep(w)
            yield {"choices": [{"text": "x"}]}
        yield {"usage": {"completion_tokens": len(waits), "prompt_tokens": 3}}
        yield None

    monkeypatch.setattr(http_workloads, "sse_chunks", chunks)
    out = http_workloads.Stream(sent=0.0)
    http_workloads._stream(FakeClient(), {}, time.perf_counter(), out, None)  # type: ignore[arg-type]
    assert out.error is None and out.tokens == len(waits)
    assert out.longest_gap is not None and 0.15 <= out.longest_gap < 0.25


def test_windows_with_url_is_refused_and_says_where_a_servers_windows_are(tmp_path) -> None:
    """--windows lists the windows of arms run in process: with --url it is a usage error naming
    /v1/status, where a launched engine lists its last windows."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "strata_cfg", "bench", "--url", "http://127.0.0.1:9"]
    out = subprocess.run([*argv, "--windows", str(tmp_path / "w.jsonl")], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert "--windows lists the windows of arms run in process, not over --url" in out.stderr
    assert "/v1/status" in out.stderr and not (tmp_path / "w.jsonl").exists()
