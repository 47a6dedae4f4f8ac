"""What reading a grammar's forced tokens as proposals gains, on replies that follow a JSON schema.

One greedy request, or ``--clients N`` at once, under a JSON schema (a book's record by default, five
required keys; ``--schema FILE`` for another), with the engine's forcing off (every token chosen in a
window row of its own, or drafted) and on (the keys and punctuation the schema leaves no choice in read as
proposals, in the rows a window has to spare, up to seven: docs/RUNTIME.md, "Replies that follow a
grammar"). The arms alternate in one engine (A B A B ...), after a warm-up of each, and the medians are
printed with their ratio. Both arms should give the same text, which the script checks and reports: on a
GPU a window of several rows may round a row otherwise than a window of one, and on a random model's near
ties the texts can then part. A synthetic preset's tokenizer spells text byte by byte, so its forced
stretches are several times longer in tokens than a real tokenizer's: there the gain is an upper bound.
Usage: ``python scripts/bench_forced.py [PROFILE] [--schema FILE] [--clients N] [--repeats N]
[--set KEY=VALUE ...]`` (default: the demo profile, one client, 5 repeats; ``--tokens`` bounds a reply,
200 by default).
"""

import argparse
import json
import time
from collections.abc import Callable

from bench_grammar_cost import PROMPT, arguments, report, runner

from strata_runtime.api import Request, SamplingParams
from strata_runtime.engine import Engine
from strata_runtime.structured import json_grammar

BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "author": {"type": "string", "maxLength": 24},
        "year": {"type": "integer", "minimum": 1500, "maximum": 2025},
        "genre": {"enum": ["novel", "poetry", "drama", "essay"]},
        "in_print": {"type": "boolean"},
    },
    "required": ["title", "author", "year", "genre", "in_print"],
    "additionalProperties": False,
}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--schema", help="a JSON schema file (default: a book's record)")
    parser.add_argument("--clients", type=int, default=1, help="requests at once, each its own prompt")
    args = parser.parse_args()
    schema = BOOK
    if args.schema:
        with open(args.schema, encoding="utf-8") as f:
            schema = json.load(f)
    engine, one = runner(args)
    held = SamplingParams(grammar=json_grammar(schema))
    run = one if args.clients == 1 else clients_runner(engine, args)
    arms = {"one token a window": False, "forced tokens as proposals": True}
    texts: dict[str, list[int]] = {}
    for arm, forcing in arms.items():  # the warm-up
        engine.forcing = forcing
        texts[arm], _ = run(held)
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    parted: dict[str, list[int]] = {arm: [] for arm in arms}
    forced = tokens = 0
    for _ in range(args.repeats):
        for arm, forcing in arms.items():
            engine.forcing = forcing
            before = engine.totals["forced"]
            reply, seconds = run(held)
            if reply != texts[arm]:
                parted[arm].append(_parting(reply, texts[arm]))
            rates[arm].append(len(reply) / seconds)
            if forcing:
                forced += engine.totals["forced"] - before
                tokens += len(reply)
    print(f"forced / one a window: {report(rates):.2f}x")
    print(f"{100 * forced / max(tokens, 1):.1f}% of the forcing arm's tokens were forced")
    one, ahead = texts.values()
    if one == ahead and not any(parted.values()):
        print("the same text in both arms and in every repeat")
    else:  # on a GPU a window's rows may round otherwise than one row's: a near tie can go either way
        print(f"the arms' texts part at token {_parting(one, ahead)}")
        print(f"repeats that parted from their arm's first reply, at tokens: {parted}")
    for arm, reply in texts.items():
        print(f"{arm} ({len(reply)} tokens): {engine.tokenizer.decode(reply)[:100]}")


def clients_runner(
    engine: Engine, args: argparse.Namespace
) -> Callable[[SamplingParams], tuple[list[int], float]]:
    """A run of ``--clients`` requests submitted together, each `PROMPT` with a number of its own: their
    tokens one after another, and the seconds until the last ended."""
    prompts = [tuple(engine.tokenizer.encode(f"{PROMPT} ({i + 1})")) for i in range(args.clients)]

    def run(sampling: SamplingParams) -> tuple[list[int], float]:
        engine.forget_prefixes()
        handles = [engine.submit(Request(p, args.tokens, sampling, ignore_eos=True)) for p in prompts]
        t0 = time.perf_counter()
        while engine.step():
            pass
        seconds = time.perf_counter() - t0
        tokens = [t for h in handles for _ in range(h.events.qsize()) for t in h.events.get().token_ids]
        return tokens, seconds

    return run


def _parting(a: list[int], b: list[int]) -> int:
    """The first token at which two replies differ (-1 where they are the same)."""
    if a == b:
        return -1
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    main()
