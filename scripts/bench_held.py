"""What holding a reply off tokens costs: ``min_tokens`` over the whole reply, and bad words of one token and
of several, against the free reply.

One greedy request a run, every reply ``--tokens`` long: the free arm ignores end-of-text (``ignore_eos``),
the ``min_tokens`` arm holds it off to the last token (its stop tokens banned in the bias the device adds,
windows running ahead up to that token), and the bad-words arms ban words the free reply does not hold, so
they choose the free reply's tokens through the machinery that bans them: a one-token word in the request's
bias, a longer one by the masks a grammar's rows get (docs/SERVING.md, "Penalties and logit bias"). The
arms alternate in one engine (A B C D A B C D ...), after a warm-up of each, and the medians are printed with
their ratios to the free arm. Where an arm's text parts from the free reply's (an end-of-text token the free
reply kept, say), the script says where; the rates still compare equal numbers of tokens.
Usage: ``python scripts/bench_held.py [PROFILE] [--tokens N] [--repeats N] [--set KEY=VALUE ...]``
(default: the demo profile, 200 tokens, 5 repeats).
"""

from __future__ import annotations

import statistics

from bench_grammar_cost import arguments, report, runner

from strata_runtime.api import SamplingParams

LONG_WORD = "Zqxjv Wkpfq"
"""A bad word of several tokens in any tokenizer, which no reply holds."""
ONE_TOKEN_WORDS = ("Zanzibar", "Quixote", "Xerxes", "zq", "Q", "~")
"""Candidates for a bad word of one token: the first that the tokenizer spells with one token the free
reply does not hold."""


def main() -> None:
    args = arguments(__doc__).parse_args()
    engine, timed = runner(args)

    def run(sampling: SamplingParams, ignore_eos: bool) -> tuple[list[int], float]:
        tokens, seconds = timed(sampling, ignore_eos)
        if len(tokens) != args.tokens:
            raise SystemExit(f"a reply of {len(tokens)} tokens, not {args.tokens}")
        return tokens, seconds

    free = run(SamplingParams(), True)[0]
    spelled = {w: engine.tokenizer.encode(w) for w in ONE_TOKEN_WORDS}
    single = next((w for w, ids in spelled.items() if len(ids) == 1 and ids[0] not in free), None)
    arms: dict[str, tuple[SamplingParams, bool]] = {
        "free": (SamplingParams(), True),
        "min_tokens": (SamplingParams(min_tokens=args.tokens), False),
        f"bad word {LONG_WORD!r}": (SamplingParams(bad_words=(LONG_WORD,)), True),
    }
    if single is not None:
        arms[f"bad word {single!r} (one token)"] = (SamplingParams(bad_words=(single,)), True)
    for sampling, ignore_eos in arms.values():  # the warm-up
        run(sampling, ignore_eos)
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    parted: dict[str, int] = {}
    for _ in range(args.repeats):
        for arm, (sampling, ignore_eos) in arms.items():
            tokens, seconds = run(sampling, ignore_eos)
            rates[arm].append(len(tokens) / seconds)
            if tokens != free and arm not in parted:
                parted[arm] = next(i for i, (a, b) in enumerate(zip(free, tokens, strict=True)) if a != b)
    report(rates)
    base = statistics.median(rates["free"])
    for arm in list(arms)[1:]:
        print(f"{arm} / free: {statistics.median(rates[arm]) / base:.2f}x")
    if single is None:
        print(f"no one-token bad word: none of {', '.join(ONE_TOKEN_WORDS)} is one token the reply lacks")
    for arm, at in parted.items():
        print(f"{arm}: the text parted from the free reply's at token {at}")
    if not parted:
        print(f"the same text in every arm, {args.tokens} tokens")


if __name__ == "__main__":
    main()
