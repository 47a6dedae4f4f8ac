"""How long chats that offer the same tools wait for their first token, with and without prefix reuse.

An agent sends its tools with every request, and the tools' part of the prompt is the same each time. The
demo engine is launched twice (``memory.prefix_reuse`` on, then off), and each time answers 8 chats, one
after another, with one system message, the same two tools and a different question; each streams 8
tokens, greedy. The script prints each request's prompt tokens, the tokens the server did not read again
(``usage.prompt_tokens_details.cached_tokens``) and its time to the first token, then the medians of the
requests after the first. Usage: ``python scripts/bench_tools_first_token.py [--requests N]``.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from srv_helpers import launch  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city for some days",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time"}},
]


def run(requests: int, *sets: str) -> list[tuple[int, int, float]]:
    """(prompt tokens, cached tokens, ms to the first token) of each request, on an engine with ``sets``."""
    engine = launch(Path(tempfile.mkdtemp()), *sets)
    try:
        client = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="none", max_retries=0)
        rows = []
        for i in range(requests):
            messages = [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": f"Question {i}: what should I wear in Bath on day {i}?"},
            ]
            t0, first, usage = time.perf_counter(), None, None
            stream = client.chat.completions.create(
                model="demo",
                messages=messages,
                tools=TOOLS,
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - t0
                usage = chunk.usage or usage
            assert usage is not None and first is not None
            rows.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, first * 1e3))
        return rows
    finally:
        engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    for label, sets in (("prefix reuse on", ()), ("prefix reuse off", ("memory.prefix_reuse=false",))):
        rows = run(args.requests, *sets)
        print(f"{label}: (prompt tokens, not read again, first token ms) " + ", ".join(map(str, rows)))
        later = statistics.median(r[2] for r in rows[1:])
        print(f"{label}: first request {rows[0][2]:.1f} ms, the later ones' median {later:.1f} ms")


if __name__ == "__main__":
    main()
