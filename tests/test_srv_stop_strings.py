"""`strata generate --stop` and the HTTP API give the same reply: both go through the engine's one cutter.

The demo profile's greedy text is generated once; stop strings are then taken from it so that a short stop
string completes inside a longer one that started earlier (the case where "first" is ambiguous), and the
reply is read back through the command line and through ``/v1/completions`` (whole and streamed).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import aiohttp
import pytest
from srv_helpers import DEMO, REPO
from test_rt_stop_strings import cut_char_by_char

from strata_cfg.plan.from_profile import resolve_profile
from strata_runtime.engine import Engine
from strata_runtime.server import ServeOptions, Server

PROMPT, TOKENS = "Once upon a time", 32


def generate(*stops: str) -> dict[str, Any]:
    flags = [a for s in stops for a in ("--stop", s)]
    out = subprocess.run(
        [sys.executable, "-m", "strata_cfg", "generate", str(DEMO), "--prompt", PROMPT]
        + ["--max-tokens", str(TOKENS), "--json", "--quiet", *flags],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def nested_stops(text: str) -> tuple[str, str]:
    """A longer stop string starting at i and a one-character one inside it at j > i, chosen so that the
    two rules differ: cutting where the first complete stop string begins gives text[:j], cutting at the
    occurrence that starts earliest would give text[:i]."""
    for j in range(2, len(text) - 2):
        short = text[j]
        if short in text[:j] or short.isspace():
            continue
        for i in range(max(0, j - 3), j):
            long = text[i : j + 2]
            if long not in text[: j + 1]:
                return long, short
    raise AssertionError(f"no nested stop strings in {text!r}")


def http_replies(plan: Any, stops: list[str], keep: bool = False) -> tuple[str, str, str | None]:
    """The reply to the same request over HTTP: whole, streamed (chunks joined), and its finish reason;
    ``keep``: with vLLM's ``include_stop_str_in_output``."""

    async def scenario() -> tuple[str, str, str | None]:
        options = ServeOptions(host="127.0.0.1", port=0, model_name="demo", api_key=None)
        server, stop = (
            Server(plan, lambda progress: Engine(plan, progress=progress), options),
            asyncio.Event(),
        )
        task = asyncio.create_task(server.serve(stop))
        while server.port is None or server.engine is None or server.engine.state != "ready":
            assert not task.done(), "the server stopped before it was ready"
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{server.port}/v1/completions"
        body = {"model": "demo", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "stop": stops}
        if keep:
            body["include_stop_str_in_output"] = True
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json=body) as r:
                assert r.status == 200, await r.text()
                whole = await r.json()
            streamed = ""
            async with s.post(url, json={**body, "stream": True}) as r:
                async for line in r.content:
                    data = line.decode().strip().removeprefix("data: ")
                    if data and data != "[DONE]":
                        streamed += json.loads(data)["choices"][0]["text"]
        stop.set()
        assert await task == 0
        choice = whole["choices"][0]
        return choice["text"], streamed, choice["finish_reason"]

    return asyncio.run(scenario())


@pytest.mark.slow
def test_generate_and_the_http_api_cut_stop_strings_the_same():
    text = generate()["text"]
    long, short = nested_stops(text)
    expected, hit = cut_char_by_char(text, (long, short))
    assert hit and expected == text[: text.index(short)] and len(expected) > text.index(long)

    cli = generate(long, short)
    whole, streamed, finish = http_replies(resolve_profile(DEMO), [long, short])
    assert cli["text"] == whole == streamed == expected
    assert cli["finish_reason"] == finish == "stop"
    # include_stop_str_in_output: the reply ends with the stop string it was cut at
    whole, streamed, finish = http_replies(resolve_profile(DEMO), [long, short], keep=True)
    assert whole == streamed == expected + short and finish == "stop"
