"""What choosing a token on the host costs: ``python -m strata_runtime.bench.host_choice``.

The engine chooses on the host a sampled prompt's first token, and verifies there the drafted windows of
requests with a logit bias or a presence / frequency penalty that it does not decide on the device. Top-p
then needs the tokens in order of probability. This times `strata_runtime.engine.sampling.distribution` on
random logits of a vocabulary's size, at the sampling settings a chat client sends, with top-p found two
ways in one run: by sorting each whole row (``sort_rows``) and by sorting a row's likeliest tokens only
(`strata_runtime.models.ops.distribution.nucleus_host`, what the engine runs), and checks that both give
the same distribution bit for bit.

With ``--logprobs`` it times instead what a request asking for log-probabilities costs the host per window:
`strata_runtime.engine.logprobs.token_logprobs` on the same rows, with no alternatives and with the most the
API allows, each interleaved with the host's choice at temperature 0.7 on those rows as the yardstick.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from ..api import MAX_TOP_LOGPROBS, SamplingParams
from ..engine.logprobs import token_logprobs
from ..engine.sampling import distribution

CASES: dict[str, SamplingParams] = {
    "temperature 0.7": SamplingParams(temperature=0.7),  # no top-p: both arms run the same code
    "top-p 0.8": SamplingParams(temperature=0.7, top_p=0.8),
    "top-p 0.95": SamplingParams(temperature=0.7, top_p=0.95),
    "top-k 20 + top-p 0.8": SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
}
"""The settings timed: Qwen3's recommended sampling (top-k 20, top-p 0.8, temperature 0.7), top-p alone, and
temperature alone, where the two arms run the same code (their ratio shows the timing's noise)."""


def _logits(vocab: int, rows: int, seed: int) -> np.ndarray:
    """``rows`` rows of ``vocab`` random logits (normal, sd 3), float32 as the engine's."""
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * 3).astype(np.float32)


def _ms(call: Callable[[], Any]) -> tuple[float, Any]:
    """How long ``call()`` took, in ms, and what it returned."""
    start = time.perf_counter()
    out = call()
    return (time.perf_counter() - start) * 1e3, out


def measure(vocab: int, rows: int, repeats: int, seed: int = 0) -> list[dict[str, Any]]:
    """Each of `CASES` on ``rows`` rows of ``vocab`` logits (normal, sd 3): ms per call with top-p sorting
    whole rows and sorting candidates (`nucleus_host`), interleaved, and whether the distributions match."""
    logits = _logits(vocab, rows, seed)
    out = []
    for name, params in CASES.items():
        timed: dict[bool, list[float]] = {True: [], False: []}
        dists: dict[bool, np.ndarray] = {}
        for _ in range(repeats):  # interleaved: A B A B
            for sort_rows in (True, False):
                ms, dists[sort_rows] = _ms(partial(distribution, logits, params, sort_rows=sort_rows))
                timed[sort_rows].append(ms)
        out.append(
            {
                "case": name,
                "sorted_ms": statistics.median(timed[True]),
                "candidates_ms": statistics.median(timed[False]),
                "same": bool(np.array_equal(dists[True], dists[False])),
            }
        )
    return out


YARDSTICK = "temperature 0.7"
"""The host's choice `measure_logprobs` compares with: its cheapest sampled one."""


def measure_logprobs(vocab: int, rows: int, repeats: int, seed: int = 0) -> list[dict[str, Any]]:
    """Log-probabilities of one token per row on ``rows`` rows of ``vocab`` logits, with 0 and the most
    alternatives, each interleaved with the host's `YARDSTICK` choice on the same rows: ms per call."""
    logits = _logits(vocab, rows, seed)
    tokens = np.argmax(logits, axis=1).tolist()
    out = []
    for top in (0, MAX_TOP_LOGPROBS):
        timed: dict[str, list[float]] = {"logprobs": [], "choice": []}
        for _ in range(repeats):  # interleaved: A B A B
            timed["logprobs"].append(_ms(partial(token_logprobs, logits, tokens, top))[0])
            timed["choice"].append(_ms(partial(distribution, logits, CASES[YARDSTICK]))[0])
        ms = {arm: statistics.median(v) for arm, v in timed.items()}
        out.append({"case": f"top {top}", "logprobs_ms": ms["logprobs"], "choice_ms": ms["choice"]})
    return out


def logprob_lines(results: list[dict[str, Any]], vocab: int, rows: int) -> list[str]:
    head = f"log-probabilities on the host, {rows} row(s) of {vocab:,} logits, ms per call (medians)"
    table = [head, f"{'alternatives':14s} {'logprobs':>9s} {YARDSTICK:>16s} {'ratio':>7s}"]
    for r in results:
        ratio = r["logprobs_ms"] / r["choice_ms"]
        table.append(f"{r['case']:14s} {r['logprobs_ms']:9.2f} {r['choice_ms']:16.2f} {ratio:6.2f}x")
    return table


def lines(results: list[dict[str, Any]], vocab: int, rows: int) -> list[str]:
    head = f"choosing on the host, {rows} row(s) of {vocab:,} logits, ms per call (medians)"
    table = [head, f"{'case':24s} {'sorted':>9s} {'candidates':>11s} {'ratio':>7s}  same distribution"]
    for r in results:
        ratio = r["sorted_ms"] / r["candidates_ms"]
        table.append(
            f"{r['case']:24s} {r['sorted_ms']:9.2f} {r['candidates_ms']:11.2f} {ratio:6.2f}x  {r['same']}"
        )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m strata_runtime.bench.host_choice", description=__doc__)
    parser.add_argument(
        "--vocab", type=int, default=151_936, help="logits per row (default: Qwen3's 151,936)"
    )
    parser.add_argument("--rows", type=int, default=1, help="rows per call: a window's (default 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per arm and case (default 5)")
    parser.add_argument(
        "--logprobs",
        action="store_true",
        help="time the log-probabilities a request may ask for, against the host's choice, instead",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    for name in ("vocab", "rows", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    run, table = (measure_logprobs, logprob_lines) if args.logprobs else (measure, lines)
    results = run(args.vocab, args.rows, args.repeats)
    print(json.dumps(results, indent=2) if args.json else "\n".join(table(results, args.vocab, args.rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
