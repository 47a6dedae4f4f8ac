"""When a streamed tool call reaches the client: a profile's engine served in process (the demo on the CPU by
default), a required call to a tool that takes one long string, greedy; the times from the request to its
first ``tool_calls`` delta and to its last, with the number of such deltas, and the time of the same
request answered whole, the two alternated (medians of the repeats after a warm-up of each).

A call is said as it comes (docs/SERVING.md, "Tool calling"): its first delta carries its name as soon as the
model has written it, and its arguments follow as they are written. Served as a whole call at its end, the
first delta and the last arrive together; the whole reply's time is the same request without streaming.
Usage: ``python scripts/bench_call_stream.py [PROFILE] [--repeats N] [--set KEY=VALUE ...]`` (default: the
demo profile, 5 repeats).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

import aiohttp

from strata_cfg.plan.from_profile import resolve_path
from strata_runtime.chat import CALL_CLOSE, CALL_OPEN
from strata_runtime.engine import Engine
from strata_runtime.server import ServeOptions, Server
from strata_runtime.weights.tokenizer import ByteTokenizer

DEMO = Path(__file__).resolve().parent.parent / "profiles" / "demo.toml"
NOTE = {
    "type": "function",
    "function": {
        "name": "write_note",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "maxLength": 300}},
            "required": ["text"],
            "additionalProperties": False,
        },
    },
}


class CallingBytes(ByteTokenizer):
    """The demo's byte tokenizer with Qwen's call tags as tokens of their own, as a Qwen vocabulary holds
    them."""

    SPECIALS = MappingProxyType({**ByteTokenizer.SPECIALS, CALL_OPEN: 261, CALL_CLOSE: 262})


async def measure(profile: str, sets: tuple[str, ...], repeats: int) -> dict[str, float]:
    plan = resolve_path(profile, sets).plan

    def factory(progress: Any) -> Engine:
        engine = Engine(plan, progress=progress)
        engine.tokenizer = CallingBytes(engine.model.args.vocab_size)
        return engine

    server, stop = Server(plan, factory, ServeOptions("127.0.0.1", 0, "demo", None)), asyncio.Event()
    task = asyncio.create_task(server.serve(stop))
    while server.port is None or server.engine is None or server.engine.state != "ready":
        await asyncio.sleep(0.05)
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Write a note."}],
        "max_tokens": 440,
        "temperature": 0,
        "tools": [NOTE],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "stream": True,
    }
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    firsts, lasts, counts, wholes = [], [], [], []
    async with aiohttp.ClientSession() as session:
        for repeat in range(repeats + 1):
            start, first, last, deltas = time.perf_counter(), 0.0, 0.0, 0
            async with session.post(url, json=body) as r:
                async for line in r.content:
                    data = line.decode().strip()
                    if not data.startswith("data: {"):
                        continue
                    chunk = json.loads(data.removeprefix("data: "))
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("tool_calls"):
                        last = time.perf_counter() - start
                        first, deltas = first or last, deltas + 1
            start = time.perf_counter()
            async with session.post(url, json={**body, "stream": False}) as r:
                await r.read()
            whole = time.perf_counter() - start
            if repeat:  # the first of each is the warm-up
                firsts.append(first)
                lasts.append(last)
                counts.append(deltas)
                wholes.append(whole)
    stop.set()
    await task
    return {
        "first": statistics.median(firsts),
        "last": statistics.median(lasts),
        "deltas": statistics.median(counts),
        "whole": statistics.median(wholes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", nargs="?", default=str(DEMO))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a profile override")
    args = parser.parse_args()
    got = asyncio.run(measure(args.profile, tuple(args.set), args.repeats))
    print(
        f"streamed: first tool_calls delta {1000 * got['first']:.0f} ms, last {1000 * got['last']:.0f} ms, "
        f"{got['deltas']:.0f} deltas; whole: {1000 * got['whole']:.0f} ms (medians)"
    )


if __name__ == "__main__":
    main()
