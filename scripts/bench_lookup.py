"""Looked-up windows decided on the device against decided on the host (``spec.method = "ngram"``).

One request alone, whose proposals come from its own text (or ``--clients N`` at once, in serial windows).
With ``Engine.lookup_on_device`` on, a window whose proposals were looked up is decided on the device, which
looks up the next window's proposals in its copy of the request's text, so the windows after it are queued
before the host has read any of them; off, the host reads each window's tokens and looks up the next
proposals itself (docs/RUNTIME.md, "Drafting from
the request's own text"). The arms alternate in one engine (A B A B ...), after a warm-up of each, and the
medians are printed with their ratio, with the share of each arm's windows decided on the device and of its
proposals that held. Greedy replies must be the same in both arms, which the script checks.
Usage: ``python scripts/bench_lookup.py [PROFILE] [--tokens N] [--repeats N] [--temperature T] [--clients
N] [--set KEY=VALUE ...]`` (default: the demo profile with ``spec.method = "ngram"``, 200 tokens, 5
repeats; a sampled request takes seed 1 in every run).
"""

from bench_forced import clients_runner
from bench_grammar_cost import arguments, report, runner

from strata_runtime.api import SamplingParams


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--clients", type=int, default=1, help="requests at once, each its own prompt")
    args = parser.parse_args()
    args.set = ['spec.method="ngram"', f"batch.slots={args.clients}", *args.set]
    engine, run = runner(args)
    if args.clients > 1:
        run = clients_runner(engine, args)
    greedy = args.temperature == 0
    sampling = SamplingParams(temperature=args.temperature, seed=None if greedy else 1)
    arms = {"decided on the host": False, "decided on the device": True}
    first: dict[str, list[int]] = {}
    for arm, on_device in arms.items():  # the warm-up
        engine.lookup_on_device = on_device
        first[arm], _ = run(sampling)
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    counts = {arm: {"windows": 0, "decided_on_device": 0, "proposals": 0, "accepted": 0} for arm in arms}
    for _ in range(args.repeats):
        for arm, on_device in arms.items():
            engine.lookup_on_device = on_device
            before = {key: engine.totals[key] for key in counts[arm]}
            reply, seconds = run(sampling)
            for key in counts[arm]:
                counts[arm][key] += engine.totals[key] - before[key]
            rates[arm].append(len(reply) / seconds)
            if greedy and reply != first["decided on the host"]:
                raise SystemExit(f"{arm}: the greedy reply is not the reply the host's lookups gave")
    print(f"on the device / on the host: {report(rates):.2f}x, {args.tokens} tokens")
    for arm, c in counts.items():
        print(
            f"{arm}: {100 * c['decided_on_device'] / max(c['windows'], 1):.0f}% of {c['windows']} windows "
            f"decided on the device, {c['accepted']} of {c['proposals']} proposals held"
        )
    if greedy:
        print("the same greedy text in both arms and every repeat")


if __name__ == "__main__":
    main()
