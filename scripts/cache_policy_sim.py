"""Compare expert-cache policies by the experts they move over the host link per generated token.

    python scripts/cache_policy_sim.py [--requests 12] [--tokens 128] [--layers 48] [--seed 0] [--lag 0]
        [--prompt-lag N] [--break-even SHARES [--experts 128] [--top-k 8]]

Replays requests through the cache's own bookkeeping (strata_runtime/experts/cache_sim.py) in a model of
Qwen3-30B-A3B's shape (48 sparse layers of 128 experts, top-8), with 34% and 63% of the experts in VRAM (a
24 GiB card, and each GPU of two 20 GiB ones), under calibrated routing (short and long prompts, one and two
streams) and uniform routing. The first half of the requests settle the cache. ``--lag``: decode windows
between a rebalance's decision and its landing (a GPU's windows run ahead of its hand-overs);
``--prompt-lag``: the same for the rebalance a prompt brings (default: ``--lag``; 0: as the engine lands it
on a GPU, before the first window after the prompt; for a cache that keeps its misses, its new queue of
victims lands so). The policies that swap vary one key of the swapping default each. Two rows follow
them: kernels that keep each miss they read over the held expert of lowest score, where the miss scores higher
(`strata_runtime.experts.cache_sim.filled_on_miss`; the engine's rule instead takes the next slot its queue
of victims gives), and the bound no policy can pass, a cache that knows every window to come
(`foresight`). docs/RUNTIME.md shows this script's tables.

``--break-even 0.05,0.1,...``: instead, keeping misses against swapping (each at its defaults) at those
shares of the experts in VRAM, one and two streams, calibrated routing, with the slots a layer in units of
top-k (``--experts`` and ``--top-k`` set the layer's shape): where the plan's rule
``experts.keep-misses-small-cache`` draws its line.
"""

from __future__ import annotations

import argparse

import numpy as np

from strata_cfg.schema.plan import KEEP_SCORE_DECAY
from strata_runtime.experts.cache import Policy
from strata_runtime.experts.cache_sim import (
    RequestTrace,
    calibrated_requests,
    filled_on_miss,
    foresight,
    simulate,
    uniform_requests,
)
from strata_runtime.experts.routing import RoutingModel

POLICIES = {
    "before (decay 0.7, margin 1, at most 32, no rebalance after a prompt)": Policy(
        decay=0.7, every=4, margin=1.0, max_swaps=32, after_prompt=False
    ),
    "**keeping misses** (the engine's default): decay 0.95, 512 queued": Policy(keep_misses=True, decay=0.95),
    "keeping misses, decay 0.9": Policy(keep_misses=True),
    "keeping misses, 256 queued": Policy(keep_misses=True, decay=0.95, max_swaps=256),
    "swapping (`experts.keep_misses = false`): decay 0.9, margin 3, at most 512": Policy(),
    "margin 1": Policy(margin=1.0),
    "margin 2": Policy(margin=2.0),
    "margin 4": Policy(margin=4.0),
    "at most 64": Policy(max_swaps=64),
    "at most 128": Policy(max_swaps=128),
    "at most 32": Policy(max_swaps=32),
    "decay 0.7": Policy(decay=0.7),
    "decay 0.95": Policy(decay=0.95),
    "no rebalance after a prompt": Policy(every=4, after_prompt=False),
    "every 2 windows": Policy(every=2),
    "every 2 windows, margin 2": Policy(every=2, margin=2.0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lag", type=int, default=0, help="decode windows a rebalance lands after its decision")
    ap.add_argument("--prompt-lag", type=int, default=None, help="the same for a prompt's rebalance")
    ap.add_argument("--break-even", help="shares of the experts in VRAM: keeping against swapping at each")
    ap.add_argument("--experts", type=int, help="experts a layer (with --break-even; default 128)")
    ap.add_argument("--top-k", type=int, help="experts a token routes to (with --break-even; default 8)")
    args = ap.parse_args()
    for flag, lag in (("--lag", args.lag), ("--prompt-lag", args.prompt_lag)):
        if lag is not None and lag < 0:
            ap.error(f"{flag}: a rebalance lands 0 or more windows after it is decided, not {lag}")
    if args.break_even is None and (args.experts is not None or args.top_k is not None):
        ap.error("--experts and --top-k set the layer's shape of --break-even, which is not given")
    if args.break_even is not None:
        args.shares = _shares(ap, args.break_even)
    experts, k, n = args.experts or 128, args.top_k or 8, args.requests
    if not 0 < k <= experts:
        ap.error(f"--top-k: a token routes to 1 to --experts ({experts}) experts, not {k}")
    g = np.random.default_rng(args.seed)
    model = RoutingModel(args.layers, experts, k, model_seed=args.seed)

    def prompts(lo: int, hi: int) -> list[list[int]]:
        return [g.integers(0, 32000, int(g.integers(lo, hi))).tolist() for _ in range(n)]

    short = calibrated_requests(model, prompts(20, 200), args.tokens)
    if args.break_even is not None:
        break_even(args, short, experts, k)
        return
    long = calibrated_requests(model, prompts(500, 2000), args.tokens)
    uniform = uniform_requests(
        g, [int(x) for x in g.integers(20, 200, n)], args.tokens, args.layers, experts, k
    )
    cases = [
        ("calibrated, 34%", short, 0.34, 1),
        ("calibrated, 63%", short, 0.63, 1),
        ("calibrated, long prompts, 34%", long, 0.34, 1),
        ("calibrated, 2 streams, 34%", short, 0.34, 2),
        ("uniform, 34%", uniform, 0.34, 1),
        ("uniform, 2 streams, 34%", uniform, 0.34, 2),
    ]
    print(
        f"{n} requests of {args.tokens} tokens ({n // 2} settle the cache), {args.layers} layers x {experts} "
        f"experts, top-{k}, rebalances landing {args.lag} windows late (a prompt's "
        f"{args.lag if args.prompt_lag is None else args.prompt_lag}): experts over the host link per "
        "generated token (VRAM hit rate, the most experts one rebalance moved)"
    )
    print("| policy | " + " | ".join(c[0] for c in cases) + " |")
    print("| --- |" + " ---: |" * len(cases))
    for name, policy in POLICIES.items():
        cells = []
        for _, requests, share, streams in cases:
            slots = int(share * args.layers * experts)
            out = simulate(
                requests,
                slots,
                policy,
                streams=streams,
                warm=n // 2,
                lag=args.lag,
                prompt_lag=args.prompt_lag,
            )
            cells.append(f"{out.link:.1f} ({100 * out.hit_rate:.1f}%, {out.largest})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    cells = []
    for _, requests, share, streams in cases:
        out = filled_on_miss(requests, int(share * args.layers * experts), 0.95, streams=streams, warm=n // 2)
        cells.append(f"{out.link:.1f} ({100 * out.hit_rate:.1f}%)")
    print(
        "| keeping each miss over the lowest score (decay 0.95, `filled_on_miss`) | "
        + " | ".join(cells)
        + " |"
    )
    cells = []
    for _, requests, share, streams in cases:  # lags do not apply: it moves each expert before its window
        out = foresight(requests, int(share * args.layers * experts), streams=streams, warm=n // 2)
        cells.append(f"{out.link:.1f} ({100 * out.hit_rate:.1f}%)")
    print("| knowing every window to come (a bound, `foresight`) | " + " | ".join(cells) + " |")


def _shares(ap: argparse.ArgumentParser, text: str) -> list[float]:
    """``--break-even``'s shares of the experts, each in (0, 1]; anything else is a usage error."""
    try:
        shares = [float(x) for x in text.split(",")]
    except ValueError:
        ap.error(f"--break-even: shares of the experts in VRAM, such as 0.1,0.2, not {text!r}")
    bad = [x for x in shares if not 0 < x <= 1]
    if bad:
        ap.error(f"--break-even: a share of the experts is above 0 and at most 1, not {bad[0]:g}")
    return shares


def break_even(args: argparse.Namespace, requests: list[RequestTrace], experts: int, k: int) -> None:
    """Keeping misses against swapping, each at the plan's defaults, at each share of ``--break-even``."""
    n = args.requests
    prompt_lag = args.lag if args.prompt_lag is None else args.prompt_lag
    print(
        f"{n} requests of {args.tokens} tokens ({n // 2} settle the cache), {args.layers} layers x {experts} "
        f"experts, top-{k}, calibrated routing, rebalances landing {args.lag} windows late (a prompt's "
        f"{prompt_lag}): experts over the host link per generated token, keeping / swapping"
    )
    print(
        "| share | slots a layer | x top-k | one stream | keeping / swapping | two streams "
        "| keeping / swapping |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    keep, swap = Policy(keep_misses=True, decay=KEEP_SCORE_DECAY), Policy()
    for share in args.shares:
        slots = int(share * args.layers * experts)
        cells = []
        for streams in (1, 2):
            kw = dict(streams=streams, warm=n // 2, lag=args.lag, prompt_lag=args.prompt_lag)
            kept, swapped = simulate(requests, slots, keep, **kw), simulate(requests, slots, swap, **kw)
            cells += [f"{kept.link:.1f} / {swapped.link:.1f}", f"{kept.link / swapped.link:.3f}"]
        per = slots / args.layers
        print(f"| {share:.0%} | {per:.1f} | {per / k:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
