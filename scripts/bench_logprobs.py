"""What a request's log-probabilities cost: one greedy request without them, and asking for each token's
log-probability with 0 and with 20 alternatives (``logprobs``, ``top_logprobs``).

A window that holds such a request copies the raw logits of its deciding rows to the host, which computes
each token's log softmax and likeliest tokens in float64 when the window is decided (docs/RUNTIME.md,
"Log-probabilities"): a 151,936-word row is 0.6 MB to copy and a pass over it on the host. The arms alternate
in one engine (A B C A B C ...), after a warm-up of each, every reply runs to ``--tokens`` (``ignore_eos``),
and the medians are printed with their ratios to the first arm. The text must be the same in every arm:
asking for log-probabilities changes no token, which the script checks.
Usage: ``python scripts/bench_logprobs.py [PROFILE] [--tokens N] [--repeats N] [--set KEY=VALUE ...]``
(default: the demo profile, 200 tokens, 5 repeats).
"""

import statistics

from bench_grammar_cost import arguments, report, runner

from strata_runtime.api import SamplingParams


def main() -> None:
    args = arguments(__doc__).parse_args()
    engine, run = runner(args)
    arms = {
        "without": SamplingParams(),
        "logprobs": SamplingParams(logprobs=0),
        "logprobs, 20 alternatives": SamplingParams(logprobs=20),
    }
    texts = {arm: run(sampling)[0] for arm, sampling in arms.items()}  # the warm-up
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(args.repeats):
        for arm, sampling in arms.items():
            tokens, seconds = run(sampling)
            rates[arm].append(len(tokens) / seconds)
            if tokens != texts["without"]:
                raise SystemExit(f"{arm}: the text differs from the arm without log-probabilities")
    report(rates)
    without = statistics.median(rates["without"])
    for arm in list(arms)[1:]:
        print(f"{arm} / without: {statistics.median(rates[arm]) / without:.2f}x")


if __name__ == "__main__":
    main()
