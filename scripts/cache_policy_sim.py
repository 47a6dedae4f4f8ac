"""Compare expert-cache policies by the experts they move over the host link per generated token.

    python scripts/cache_policy_sim.py [--requests 12] [--tokens 128] [--layers 48] [--seed 0] [--lag 0]
        [--prompt-lag N]

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
"""

from __future__ import annotations

import argparse

import numpy as np

from strata_runtime.experts.cache import Policy
from strata_runtime.experts.cache_sim import (
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
    args = ap.parse_args()
    for flag, lag in (("--lag", args.lag), ("--prompt-lag", args.prompt_lag)):
        if lag is not None and lag < 0:
            ap.error(f"{flag}: a rebalance lands 0 or more windows after it is decided, not {lag}")
    experts, k, n = 128, 8, args.requests
    g = np.random.default_rng(args.seed)
    model = RoutingModel(args.layers, experts, k, model_seed=args.seed)

    def prompts(lo: int, hi: int) -> list[list[int]]:
        return [g.integers(0, 32000, int(g.integers(lo, hi))).tolist() for _ in range(n)]

    short = calibrated_requests(model, prompts(20, 200), args.tokens)
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


if __name__ == "__main__":
    main()
