"""Print the locality of calibrated and random routing next to the published Qwen3-30B-A3B figures.

    python scripts/routing_stats.py [--prompts 9] [--tokens 512] [--experts 128] [--top-k 8] [--seed 0]

Simulates the calibrated routing model (strata_runtime.experts.routing, default parameters) on mid-stack
layers of a 48-layer model, and random routing (k distinct experts uniformly at each position), and measures
both with strata_runtime.experts.routing_stats. docs/RUNTIME.md shows this script's table.
"""

from __future__ import annotations

import argparse

import numpy as np

from strata_runtime.experts import routing_stats as st
from strata_runtime.experts.routing import RoutingModel

LABELS = {
    "repeat": "next-token repeat",
    "within_8": "reuse within 8 tokens",
    "lru_40": "LRU hit, 40% resident",
    "best_40": "per-prompt best 40% covers",
    "held_out_40": "held-out 40% covers",
    "oracle_4": "oracle hit, m = 4",
    "oracle_16": "oracle hit, m = 16",
    "oracle_64": "oracle hit, m = 64",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    g = np.random.default_rng(args.seed)
    prompts = [g.integers(0, 32000, int(g.integers(5, 200))).tolist() for _ in range(args.prompts)]
    layers = (12, 20, 30)
    model = RoutingModel(48, args.experts, args.top_k, model_seed=args.seed)
    calibrated = st.measure(st.calibrated_traces(model, prompts, args.tokens, layers), args.experts)
    uniform = st.measure(
        st.uniform_traces(g, args.prompts, args.tokens, len(layers), args.experts, args.top_k), args.experts
    )
    shape = f"{args.experts} experts top-{args.top_k}"
    print(f"{args.prompts} prompts x {args.tokens} tokens, {shape}, layers {layers}")
    print("| measure | calibrated | uniform | Qwen3-30B-A3B |\n| --- | ---: | ---: | ---: |")
    for key, label in LABELS.items():
        c, u, p = (getattr(x, key) for x in (calibrated, uniform, st.PUBLISHED))
        print(f"| {label} | {100 * c:.1f}% | {100 * u:.1f}% | {100 * p:.1f}% |")


if __name__ == "__main__":
    main()
