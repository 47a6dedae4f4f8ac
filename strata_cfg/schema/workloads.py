"""The bench workloads (docs/PERFORMANCE.md), shared by the in-process harness and the HTTP driver.

Both measure the same requests: the same workload names, client counts and prompts. Some workloads only make
sense in the engine's own process: ``step`` times the CUDA kernels without an engine, ``vram`` reads the
driver's memory counters, and ``handoff`` times the copies between two stages' GPUs. ``prompt`` runs in both;
in process it also reports against the GPU's matrix rate measured in that run, over HTTP its read rate and
time to first token only.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from itertools import pairwise
from typing import Any

from .sampling_options import options_problem

WORKLOADS = (
    "two-decodes",
    "clients",
    "read-beside-decode",
    "solo",
    "prompt",
    "turns",
    "shared",
    "conversations",
    "step",
    "vram",
    "handoff",
)
"""Workload names, as `strata bench --workload` takes them."""
GPU_WORKLOADS = ("step", "vram", "handoff")
"""Workloads that need CuPy and a CUDA GPU; they measure the profile's plan, not arms."""
HTTP_WORKLOADS = tuple(w for w in WORKLOADS if w not in GPU_WORKLOADS)
"""Workloads that also run against a launched engine (`strata bench --url`): all but the GPU's."""
CONTEXT_WORKLOADS = ("turns", "shared", "conversations")
"""Workloads whose requests begin with a context of ``--prompt-tokens`` fresh ids, and measure what prefix
reuse saves (`turns_figures`); like ``prompt``, they run the serial arm unless told otherwise."""
STEP_VARY_KEYS = ("model.decode_attention",)
"""Keys ``--workload step`` may ``--vary``: what it switches in one model on the same weights and window."""
PEERS = ("transformers", "llama.cpp")
"""Peer engines `strata bench --peer` runs on the same weights: transformers' ``generate`` as an arm, and
llama.cpp's own benchmark tools (or its server) on the model written as GGUF."""
CLIENT_COUNTS = (1, 2, 4, 8)
"""Concurrent clients of the ``clients`` workload."""
PROMPTS = (
    "The quick brown fox",
    "Once upon a time",
    "In the beginning",
    "Hello, world",
    "A long time ago",
    "Dear reader",
    "It was a dark night",
    "Call me Ishmael",
)
"""Short prompts; request i uses prompt i modulo their number."""

WARM_PROMPTS = (
    "The river ran",
    "She opened the letter",
    "Tomorrow we sail",
    "Under the old bridge",
    "The market was loud",
    "He counted the stars",
    "Snow fell on the town",
    "A door creaked open",
)
"""Short prompts the bench's warm-up decodes to settle an expert cache and teach the drafting how often
proposals hold; no repeat uses them."""


def prompt_ids(length: int, vocab: int, seed: int) -> tuple[int, ...]:
    """A prompt of fresh token ids, seeded and spread over the vocabulary (id 0 left out): the ``prompt``
    workload's, the same in process and over HTTP."""
    rng = random.Random(seed)
    return tuple(rng.randrange(1, vocab) for _ in range(length))


TURNS = 4
"""Requests of the ``turns`` workload: one conversation, each turn sent once the one before has finished."""
TURN_MESSAGE = 32
"""Fresh token ids each turn of ``turns`` adds to what was sent before."""


SHARED_REQUESTS = 4
"""Requests of the ``shared`` workload: the same instructions, each with a question of its own."""
SHARED_SEED = 30_000
"""Seeds of `shared_prompts`: repeat r's is ``SHARED_SEED + r``."""


def shared_prompts(prompt_tokens: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    """The ``shared`` workload's prompts: the same ``prompt_tokens`` fresh ids (an agent's instructions, or
    a system prompt that several clients send) and then a question of `TURN_MESSAGE` fresh ids of each
    request's own. Seeded by ``seed`` (the repeat), apart from every other workload's."""
    ids = prompt_ids(prompt_tokens + SHARED_REQUESTS * TURN_MESSAGE, vocab, SHARED_SEED + seed)
    context, questions = ids[:prompt_tokens], ids[prompt_tokens:]
    return [context + questions[k * TURN_MESSAGE : (k + 1) * TURN_MESSAGE] for k in range(SHARED_REQUESTS)]


CONVERSATION_SEED = 40_000
"""Seeds of `conversation_prompts`: repeat r's conversation c is ``CONVERSATION_SEED + 64 * r + c``."""


def conversation_prompts(
    prompt_tokens: int, vocab: int, seed: int, conversations: int
) -> list[list[tuple[int, ...]]]:
    """The ``conversations`` workload's prompts: ``conversations`` conversations, each `turn_prompts`-like
    (a context of ``prompt_tokens`` fresh ids of its own, then `TURNS` turns, each adding a message of
    `TURN_MESSAGE` fresh ids to everything sent before); one list of turns per conversation. Seeded by
    ``seed`` (the repeat), apart from every other workload's."""
    return [_turns(prompt_tokens, vocab, CONVERSATION_SEED + 64 * seed + c) for c in range(conversations)]


def turn_prompts(prompt_tokens: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    """The ``turns`` workload's prompts: a context of ``prompt_tokens`` fresh ids (a document, or an agent's
    instructions) and then, each turn, everything sent before and a new message of `TURN_MESSAGE` fresh ids.
    The replies are not sent back, so that the requests are the same in process and over HTTP (where the
    bench sees text, not token ids). Seeded by ``seed`` (the repeat), apart from every other workload's."""
    return _turns(prompt_tokens, vocab, TURN_SEED + seed)


def _turns(prompt_tokens: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    """One conversation's `TURNS` prompts from fresh ids seeded by ``seed``: a context of ``prompt_tokens``,
    then each turn everything before and a message of `TURN_MESSAGE`."""
    ids = prompt_ids(prompt_tokens + TURNS * TURN_MESSAGE, vocab, seed)
    return [ids[: prompt_tokens + (k + 1) * TURN_MESSAGE] for k in range(TURNS)]


DEPTH_WORKLOADS = ("two-decodes", "clients", "solo", "step")
"""Workloads that decode at ``--depth``: their decoding requests read a prompt of that many fresh token ids
first (`depth_prompt`), so they decode from KV that deep, as llama-bench's ``-d`` does; ``step`` puts its
rows' KV at that position."""
DEPTH_SEED = 10_000
"""Seeds of `depth_prompt`: request i's is ``DEPTH_SEED + i``, apart from the ``prompt`` workload's."""
TURN_SEED = 20_000
"""Seeds of `turn_prompts`: repeat r's is ``TURN_SEED + r``."""


def depth_prompt(depth: int, vocab: int, index: int) -> tuple[int, ...]:
    """Decoding request ``index``'s prompt at ``--depth`` ``depth``: fresh token ids (`prompt_ids`), the same
    for every arm and repeat, in process and over HTTP."""
    return prompt_ids(depth, vocab, DEPTH_SEED + index)


def depth_problem(
    workload: str, depth: int, tokens: int, context: int | None, *, launched: bool = False
) -> str | None:
    """Why ``--depth`` cannot run: a negative depth, a workload that does not decode at a depth, or (with the
    plan's ``context``, or with ``launched`` a running engine's; None where it is not known yet) a prompt of
    ``depth`` tokens and ``tokens`` generated after it (for ``step``: one row at that position) that do not
    fit."""
    if depth < 0:
        return f"--depth must be at least 0, not {depth}"
    if not depth:
        return None
    if workload not in DEPTH_WORKLOADS:
        return f"--depth applies to the {', '.join(DEPTH_WORKLOADS)} workloads, not {workload}"
    if context is None:
        return None
    need = depth + 1 if workload == "step" else depth + tokens
    if need > context:
        if workload == "step":
            what = f"a row at position {depth} needs"
        else:
            what = f"a prompt of {depth} tokens and {tokens} generated after it need"
        text = f"--depth {depth}: {what} a context of {need}, but the "
        if launched:
            return text + f"engine's memory.context is {context}"
        return text + f"plan's memory.context is {context}; pass --set memory.context={need} (or more)"
    return None


GENERATING = ("two-decodes", "clients", "solo")
"""Workloads whose figures include `generation_rate` as ``generation_tok_s``."""


def generation_rate(streams: Iterable[tuple[int, float | None, float | None]]) -> float:
    """Tokens per second that streams (tokens generated, first token's time, finish time) generated after
    their first tokens: every token but each stream's first, over the span from the earliest first token
    to the latest finish. Reading the prompts is left out, as in llama.cpp's batched benchmark's
    generation rate (its S_TG), so the two compare; 0 when no stream generated a second token."""
    spans = [
        (n, first, done) for n, first, done in streams if first is not None and done is not None and n > 1
    ]
    if not spans:
        return 0.0
    span = max(done for _, _, done in spans) - min(first for _, first, _ in spans)
    return sum(n - 1 for n, _, _ in spans) / span if span > 0 else 0.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile with linear interpolation between the closest ranks; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def delivery_gaps(deliveries: Sequence[float]) -> tuple[float, ...]:
    """The waits between consecutive deliveries of tokens to one stream (their times, in order); the wait
    for the first is not one (that is the time to the first token)."""
    return tuple(b - a for a, b in pairwise(deliveries))


def longest_gap(deliveries: Sequence[float]) -> float | None:
    """The longest of a stream's `delivery_gaps`; None with fewer than two deliveries."""
    return max(delivery_gaps(deliveries), default=None)


def gap_figures_ms(streams: Iterable[Sequence[float]]) -> dict[str, float]:
    """Over every wait of some streams (each stream's `delivery_gaps`), in milliseconds: the longest
    (``longest_gap_ms``), the median (``gap_p50_ms``) and the 99th percentile (``gap_p99_ms``), as serving
    benchmarks report inter-token latency. A drafting window delivers several tokens at once, so these are
    waits between deliveries, not per token. Empty when no stream had two deliveries."""
    gaps = [g for stream in streams for g in stream]
    if not gaps:
        return {}
    p50, p99 = percentile(gaps, 0.50), percentile(gaps, 0.99)
    assert p50 is not None and p99 is not None
    return {"longest_gap_ms": 1000.0 * max(gaps), "gap_p50_ms": 1000.0 * p50, "gap_p99_ms": 1000.0 * p99}


def gap_text(m: dict[str, float]) -> str:
    """The gap figures of `gap_figures_ms` for a results table ("" without them)."""
    if "longest_gap_ms" not in m:
        return ""
    return (
        f"  gaps p50 {m['gap_p50_ms']:.1f} / p99 {m['gap_p99_ms']:.1f} / longest {m['longest_gap_ms']:.1f} ms"
    )


def turns_figures(
    turns: Sequence[tuple[float, float | None, float, int, int, int]],
    *,
    at_once: bool = False,
    firsts: int = 1,
) -> dict[str, float]:
    """The ``turns`` workload's figures from its turns in order, each (sent, first token or None, done,
    tokens generated, prompt tokens, prompt tokens reused), in seconds from the run's start: the
    conversation's tokens over its time (reading included), the first turn's wait for its first token, the
    later turns' median wait, and the share of the later turns' prompts the engine did not read again.

    The ``shared`` workload's the same way, ``at_once``: its requests are sent together and reach the engine
    in any order, so its "first" is the request that read the context, the one that reused the least (of
    those, the first sent), and the others are the later ones. The ``conversations`` workload's with
    ``firsts``, its conversations' count: its first ``firsts`` requests are their first turns, whose median
    wait is the first turns' figure."""
    if at_once and turns:
        reader = min(range(len(turns)), key=lambda k: (turns[k][5], turns[k][0], k))
        turns = [turns[reader], *turns[:reader], *turns[reader + 1 :]]
    span = max(t[2] for t in turns) - min(t[0] for t in turns)
    waits = [(first if first is not None else done) - sent for sent, first, done, *_ in turns]
    later = turns[firsts:]
    sent_tokens = sum(t[4] for t in later)
    return {
        "tok_s": sum(t[3] for t in turns) / span if span > 0 else 0.0,
        "first_turn_ttft_s": percentile(waits[:firsts], 0.5) or 0.0,
        "later_ttft_s": percentile(waits[firsts:], 0.5) or 0.0,
        "reused_pct": 100.0 * sum(t[5] for t in later) / sent_tokens if sent_tokens else 0.0,
    }


def turns_text(m: dict[str, float], workload: str = "turns") -> str:
    """The figures of `turns_figures` for a results table of ``workload`` (``turns``, ``shared`` or
    ``conversations``, whose requests it names so); "" without them."""
    if "later_ttft_s" not in m:
        return ""
    first, later = {
        "shared": ("the reader", "the others"),
        "conversations": ("first turns", "later turns"),
    }.get(workload, ("turn 1", "later turns"))
    return (
        f"  first token: {first} {1000 * m['first_turn_ttft_s']:.1f} ms, {later} "
        f"{1000 * m['later_ttft_s']:.1f} ms ({m['reused_pct']:.1f}% of their prompts reused)"
    )


def bench_option_problem(args: Any) -> str | None:
    """Why the bench's parsed arguments cannot run: `sampling_problem`, or a count of tokens or repeats
    below 1."""
    for flag, value in (("--tokens", args.tokens), ("--repeats", args.repeats)):
        if value < 1:
            return f"{flag} must be at least 1, not {value}"
    return options_problem(args)


def prompt_context_problem(prompt_tokens: int, context: int, *, launched: bool = False) -> str | None:
    """Why a ``prompt`` run of ``prompt_tokens`` (plus its one generated token) cannot fit ``context``: the
    plan's, which ``--set`` can raise, or with ``launched`` a running engine's, which it cannot."""
    if prompt_tokens < 1:
        return f"--prompt-tokens must be at least 1, not {prompt_tokens}"
    if prompt_tokens + 1 > context:
        need = f"a prompt of {prompt_tokens} tokens and its generated token need a context of "
        need += str(prompt_tokens + 1)
        if launched:
            return (
                f"--prompt-tokens {prompt_tokens}: {need}, but the engine's memory.context is {context}, "
                f"so at most {context - 1} tokens"
            )
        return (
            f"{need}, but the plan's memory.context is {context}; "
            f"pass --set memory.context={prompt_tokens + 1} (or more)"
        )
    return None


def context_problem(
    workload: str, prompt_tokens: int, depth: int, tokens: int, context: int, *, launched: bool = False
) -> str | None:
    """Why a workload's requests do not fit ``context``: the ``prompt`` workload's prompt
    (`prompt_context_problem`), or the decoding workloads' depth and tokens after it (`depth_problem`)."""
    if workload == "prompt":
        return prompt_context_problem(prompt_tokens, context, launched=launched)
    if workload in ("turns", "conversations"):
        return turns_context_problem(prompt_tokens, tokens, context, launched=launched)
    if workload == "shared":
        return turns_context_problem(prompt_tokens, tokens, context, launched=launched, messages=1)
    return depth_problem(workload, depth, tokens, context, launched=launched)


def turns_context_problem(
    prompt_tokens: int, tokens: int, context: int, *, launched: bool = False, messages: int = TURNS
) -> str | None:
    """Why a ``turns`` conversation (a context of ``prompt_tokens``, `TURNS` messages of `TURN_MESSAGE`, and
    ``tokens`` generated after the last) cannot fit ``context``; with ``messages`` = 1, a ``shared``
    request (the context and one question)."""
    if prompt_tokens < 1:
        return f"--prompt-tokens must be at least 1, not {prompt_tokens}"
    need = prompt_tokens + messages * TURN_MESSAGE + tokens
    if need <= context:
        return None
    what = f"{TURNS} messages of {TURN_MESSAGE}" if messages > 1 else f"a question of {TURN_MESSAGE}"
    after = "the last" if messages > 1 else "it"
    text = (
        f"--prompt-tokens {prompt_tokens}: a context of that many tokens, {what} "
        f"and {tokens} generated after {after} need a context of {need}, but the "
    )
    most = context - messages * TURN_MESSAGE - tokens
    if launched:
        return text + f"engine's memory.context is {context}, so at most --prompt-tokens {max(most, 0)}"
    return text + f"plan's memory.context is {context}; pass --set memory.context={need} (or more)"
