"""What a think budget costs a reply that runs under it (no grammar), against the same reply free.

One greedy request whose prompt opened a think block: free, and with a budget (``--budget``, half its
tokens by default; with one token less than ``--tokens`` the two replies are the same but for the last
token, which leaves the cost of stopping short of the forced token alone). Under the
budget the block's tokens are chosen as the free reply's are (on the device, drafted, windows running
ahead), except the one the spent budget forces, ``</think>``, which the host chooses; the windows before it
stop short of it (docs/RUNTIME.md, "A budget with no grammar"). So the budget's reply is the free reply's
first half, the close, then the model's own continuation. The arms alternate in one engine (A B A B ...),
after a warm-up of each, and the medians are printed with their ratio; every reply runs to ``--tokens``
(``ignore_eos``). The close is a token the free reply never chooses, so only the budget puts it there.
Usage: ``python scripts/bench_think_budget.py [PROFILE] [--tokens N] [--budget N] [--repeats N]
[--set KEY=VALUE ...]``
(default: the demo profile, 200 tokens, 5 repeats).
"""

from bench_grammar_cost import arguments, report, runner

from strata_runtime.api import Reasoning, SamplingParams
from strata_runtime.thinking import think_ids


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--budget", type=int, help="the think block's budget (default: half of --tokens)")
    args = parser.parse_args()
    budget = args.budget if args.budget is not None else args.tokens // 2
    if not 1 <= budget < args.tokens:
        parser.error(f"--budget must be at least 1 and less than --tokens ({args.tokens})")
    engine, run = runner(args)
    free, _ = run(SamplingParams())
    tags = think_ids(engine.tokenizer)
    if (
        tags is None or tags[1] in free
    ):  # no think tags, or a reply that closes by itself: a token it never uses
        unused = [t for t in range(engine.model.args.vocab_size - 1, 0, -1) if t not in free]
        tags = (unused[1], unused[0])
    budgeted = SamplingParams(reasoning=Reasoning(*tags, opened=True, budget=budget))
    held, _ = run(budgeted)
    assert held[:budget] == free[:budget] and held[budget] == tags[1], "the budget did not close the block"
    rates: dict[str, list[float]] = {"free": [], f"a budget of {budget}": []}
    for _ in range(args.repeats):
        for arm, sampling in zip(rates, (SamplingParams(), budgeted), strict=True):
            tokens, seconds = run(sampling)
            rates[arm].append(len(tokens) / seconds)
    print(f"budget / free: {report(rates):.2f}x, {args.tokens} tokens, the close at token {budget}")


if __name__ == "__main__":
    main()
