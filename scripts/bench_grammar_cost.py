"""What holding a reply to a grammar costs, apart from what the grammar changes in the text.

One greedy request, free and under a grammar that allows any text (llguidance's regex ``(?s:.*)``), so
both arms choose the same tokens from the same logits; the arms alternate in one engine (A B C A B C ...),
after a warm-up of each, and the medians are printed with their ratio. Under a grammar the device masks
each row to the allowed tokens and chooses, and decides drafted windows there, which run ahead of the
host; a third arm has the host verify each drafted window before it launches the next
(``Engine.grammar_drafts_on_device`` off), and a fourth has the host read the logits and choose
(``Engine.masks_on_device`` off). Both must give the grammar arm's text (docs/RUNTIME.md, "Replies that
follow a grammar"). Every reply runs to ``--tokens`` (``ignore_eos``), so the arms generate as many tokens.

On a synthetic preset the arms' texts part: its vocabulary is far larger than its byte-level tokenizer, a
random model often prefers an id the tokenizer has no text for, and no grammar allows a token without text.
The script then says where the texts first differ, and the rates still compare equal numbers of tokens.
``--set spec.adaptive_depth=false`` keeps every window's shape the same in both arms.
With ``--schema FILE`` the grammar arms follow a JSON schema instead, as a structured-output request does;
each arm's windows and the share of its proposals that held are printed too (a drafter's proposals hold less
often under a schema that allows little, and more where the host masks them than where the GPU drafts).
Usage: ``python scripts/bench_grammar_cost.py [PROFILE] [--tokens N] [--repeats N] [--schema FILE]
[--set KEY=VALUE ...]`` (default: the demo profile, 200 tokens, 5 repeats).
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable

import llguidance

from strata_cfg.plan.from_profile import resolve_path
from strata_runtime.api import Request, SamplingParams
from strata_runtime.engine import Engine
from strata_runtime.structured import json_grammar

PROMPT = "The old man looked at the sea and said"


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options of this script and of `bench_think_budget.py`: a profile, tokens, repeats, overrides."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("profile", nargs="?", default="profiles/demo.toml")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a profile override")
    return parser


def runner(
    args: argparse.Namespace,
) -> tuple[Engine, Callable[..., tuple[list[int], float]]]:
    """The profile's engine, and a run of `PROMPT` to ``--tokens`` (``ignore_eos`` unless the run says
    otherwise) under given sampling: its tokens and seconds, the prompt read each time."""
    engine = Engine(resolve_path(args.profile, tuple(args.set)).plan)
    prompt = tuple(engine.tokenizer.encode(PROMPT))

    def run(sampling: SamplingParams, ignore_eos: bool = True) -> tuple[list[int], float]:
        engine.forget_prefixes()  # each run reads its prompt
        handle = engine.submit(Request(prompt, args.tokens, sampling, ignore_eos=ignore_eos))
        t0 = time.perf_counter()
        while engine.step():
            pass
        seconds = time.perf_counter() - t0
        return [t for _ in range(handle.events.qsize()) for t in handle.events.get().token_ids], seconds

    return engine, run


def report(rates: dict[str, list[float]]) -> float:
    """Print each arm's median rate and its runs; the second arm's median over the first's."""
    for arm, values in rates.items():
        print(f"{arm}: {statistics.median(values):.1f} tok/s ({', '.join(f'{v:.1f}' for v in values)})")
    first, second = (statistics.median(values) for values in list(rates.values())[:2])
    return second / first


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument(
        "--schema",
        metavar="FILE",
        help="a JSON schema the grammar arms follow instead of any text (their replies end when the JSON is "
        "complete, and part from the free reply's)",
    )
    args = parser.parse_args()
    engine, run = runner(args)
    free_params = SamplingParams()
    if args.schema:
        with open(args.schema, encoding="utf-8") as f:
            held = SamplingParams(grammar=json_grammar(json.load(f)))
    else:
        held = SamplingParams(grammar=llguidance.LLMatcher.grammar_from_regex(r"(?s:.*)"))
    arms = {  # (sampling, masks on the device, drafted windows decided there)
        "free": (free_params, True, True),
        "under a grammar": (held, True, True),
        "drafts verified by the host": (held, True, False),
        "masks on the host": (held, False, False),
    }
    for sampling, masks, drafts in arms.values():  # the warm-up
        engine.masks_on_device, engine.grammar_drafts_on_device = masks, drafts
        run(sampling)
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    drafted: dict[str, list[int]] = {arm: [0, 0, 0] for arm in arms}  # windows, proposals, accepted
    parted: list[int] = []
    for _ in range(args.repeats):
        replies = {}
        for arm, (sampling, masks, drafts) in arms.items():
            engine.masks_on_device, engine.grammar_drafts_on_device = masks, drafts
            before = [engine.totals[k] for k in ("windows", "proposals", "accepted")]
            replies[arm], seconds = run(sampling)
            rates[arm].append(len(replies[arm]) / seconds)
            for i, k in enumerate(("windows", "proposals", "accepted")):
                drafted[arm][i] += engine.totals[k] - before[i]
        free, shaped = replies["free"], replies["under a grammar"]
        if free != shaped:
            parted.append(next(i for i, (a, b) in enumerate(zip(free, shaped, strict=True)) if a != b))
        for arm in ("drafts verified by the host", "masks on the host"):
            if replies[arm] != shaped:
                raise SystemExit(f"the grammar's reply with {arm} is not its reply decided on the device")
    for arm, (windows, proposals, accepted) in drafted.items():
        held_share = f"{accepted / proposals:.0%}" if proposals else "none"
        print(f"{arm}: {windows} windows, {accepted} of {proposals} proposals held ({held_share})")
    print(f"under a grammar / free: {report(rates):.2f}x, {args.tokens} tokens")
    device = statistics.median(rates["under a grammar"])
    for arm in ("drafts verified by the host", "masks on the host"):
        print(f"under a grammar / {arm}: {device / statistics.median(rates[arm]):.2f}x (the same text)")
    if parted:
        print(f"the texts parted in {len(parted)} of {args.repeats} repeats, first at tokens {parted}")
    else:
        print("the same text in every repeat")


if __name__ == "__main__":
    main()
