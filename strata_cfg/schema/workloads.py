"""The bench workloads (docs/PERFORMANCE.md), shared by the in-process harness and the HTTP driver.

Both measure the same requests: the same workload names, client counts and prompts. Some workloads only make
sense in the engine's own process: ``step`` times the CUDA kernels without an engine, ``vram`` reads the
driver's memory counters, and ``handoff`` times the copies between two stages' GPUs. ``prompt`` runs in both;
in process it also reports against the GPU's matrix rate measured in that run, over HTTP its read rate and
time to first token only.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

WORKLOADS = ("two-decodes", "clients", "read-beside-decode", "solo", "prompt", "step", "vram", "handoff")
"""Workload names, as `strata bench --workload` takes them."""
HTTP_WORKLOADS = ("two-decodes", "clients", "read-beside-decode", "solo", "prompt")
"""Workloads that also run against a launched engine (`strata bench --url`)."""
GPU_WORKLOADS = ("step", "vram", "handoff")
"""Workloads that need CuPy and a CUDA GPU; they measure the profile's plan, not arms."""
PEERS = ("transformers", "llama.cpp")
"""Peer engines `strata bench --peer` runs on the same weights: transformers' ``generate`` as an arm, and
llama.cpp's own benchmark tools on the model written as GGUF."""
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


def prompt_ids(length: int, vocab: int, seed: int) -> tuple[int, ...]:
    """A prompt of fresh token ids, seeded and spread over the vocabulary (id 0 left out): the ``prompt``
    workload's, the same in process and over HTTP."""
    rng = random.Random(seed)
    return tuple(rng.randrange(1, vocab) for _ in range(length))


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


PENALTY_BOUND = 2.0
"""OpenAI's bound on a presence or frequency penalty: each lies in [-2, 2]."""


def sampling_problem(
    temperature: float,
    top_p: float,
    top_k: int,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> str | None:
    """Why sampling options are not valid: the bench's (every request of the workload draws with them) or
    a generate command's."""
    if not temperature >= 0:  # also refuses nan
        return f"--temperature must be at least 0, not {temperature}"
    if not 0 < top_p <= 1:
        return f"--top-p must be in (0, 1], not {top_p}"
    if top_k < 0:
        return f"--top-k must be at least 0 (0: no cut), not {top_k}"
    for flag, value in (("--presence-penalty", presence_penalty), ("--frequency-penalty", frequency_penalty)):
        if not -PENALTY_BOUND <= value <= PENALTY_BOUND:  # also refuses nan
            return f"{flag} must be in [-2, 2], as OpenAI defines it, not {value}"
    return None


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty")
"""The bench's sampling options, by their names in a request (OpenAI's, and `SamplingParams`')."""


def sampling_options(args: Any) -> dict[str, float]:
    """The bench's sampling options from its parsed arguments, by `SAMPLING_KEYS` (``--top-p``: ``top_p``)."""
    return {key: getattr(args, key) for key in SAMPLING_KEYS}


def bench_option_problem(args: Any) -> str | None:
    """Why the bench's parsed arguments cannot run: `sampling_problem`, or a count of tokens or repeats
    below 1."""
    for flag, value in (("--tokens", args.tokens), ("--repeats", args.repeats)):
        if value < 1:
            return f"{flag} must be at least 1, not {value}"
    return sampling_problem(
        args.temperature, args.top_p, args.top_k, args.presence_penalty, args.frequency_penalty
    )


def generation_problem(max_tokens: int, seed: int) -> str | None:
    """Why ``--max-tokens`` or ``--seed`` of a generate command is not valid."""
    if max_tokens < 1:
        return f"--max-tokens must be at least 1, not {max_tokens}"
    if not 0 <= seed < 2**63:
        return f"--seed must be in [0, 2^63), not {seed}"
    return None


def add_penalty_arguments(parser: Any) -> None:
    """``--presence-penalty`` and ``--frequency-penalty`` on a bench or generate command's parser."""
    for name, what in (
        ("presence", "once it has been generated"),
        ("frequency", "each time it was generated"),
    ):
        parser.add_argument(
            f"--{name}-penalty",
            type=float,
            default=0.0,
            help=f"{name} penalty in [-2, 2], as OpenAI defines it: a token's logit loses it {what}; the "
            "host then chooses the tokens (default 0)",
        )


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
