"""What choosing a prompt's first token on the device saves: the time to the first token of greedy, sampled
and penalised requests, with that token chosen on the device and by the host.

One request a run, a prompt of ``--prompt-tokens`` tokens and one token generated, so the time is the
prompt's read and the first token's choice. In the device arms the last stage adjusts, draws and counts
the token as it does a decode row's, and the host reads one token; in the host arms
(``Engine.first_tokens_on_device`` off) it reads the row's logits and chooses (docs/RUNTIME.md, "Windows
in flight"). The arms alternate in one engine, after a warm-up of each, and every pair must choose
the same token (each request is seeded). Medians are printed with what the device saves.
Usage: ``python scripts/bench_first_token.py [PROFILE] [--prompt-tokens N] [--repeats N] [--json]
[--set KEY=VALUE ...]`` (default: the demo profile, 64 prompt tokens, 9 repeats).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from strata_cfg.plan.from_profile import resolve_path
from strata_runtime.api import Request, SamplingParams
from strata_runtime.engine import Engine

PROMPT = "The old man looked at the sea and said that the fish would come back with the tide, "

KINDS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(),
    "T 0.7, top-k 20, top-p 0.8": SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=1),
    "T 0.7, top-p 0.95": SamplingParams(temperature=0.7, top_p=0.95, seed=2),
    "greedy, repetition 1.1": SamplingParams(repetition_penalty=1.1),
}
"""The requests timed: a plain greedy one (the device chose its token before too: the control), and the
sampled and penalised ones whose first token the host used to choose."""


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", nargs="?", default="profiles/demo.toml")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", action="store_true", help="print the medians as JSON")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a profile override")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    engine = Engine(resolve_path(args.profile, tuple(args.set)).plan)
    text = engine.tokenizer.encode(PROMPT * (1 + args.prompt_tokens // 8))
    prompt = tuple(text[: args.prompt_tokens])
    if len(prompt) < args.prompt_tokens:
        raise SystemExit(f"the prompt has {len(prompt)} tokens, fewer than --prompt-tokens")

    def run(sampling: SamplingParams, on_device: bool) -> tuple[int, float]:
        engine.first_tokens_on_device = on_device
        engine.forget_prefixes()  # each run reads its whole prompt
        t0 = time.perf_counter()
        handle = engine.submit(Request(prompt, 1, sampling, ignore_eos=True))
        while engine.step():
            pass
        ms = (time.perf_counter() - t0) * 1e3
        (token,) = [t for _ in range(handle.events.qsize()) for t in handle.events.get().token_ids]
        return token, ms

    arms = [(kind, on_device) for kind in KINDS for on_device in (True, False)]
    for kind, on_device in arms:  # the warm-up
        run(KINDS[kind], on_device)
    times: dict[tuple[str, bool], list[float]] = {arm: [] for arm in arms}
    for _ in range(args.repeats):
        for kind in KINDS:
            chosen = {}
            for on_device in (True, False):
                chosen[on_device], ms = run(KINDS[kind], on_device)
                times[kind, on_device].append(ms)
            if chosen[True] != chosen[False]:
                raise SystemExit(f"{kind}: the device chose {chosen[True]}, the host {chosen[False]}")
    rows = []
    for kind in KINDS:
        device, host = (statistics.median(times[kind, d]) for d in (True, False))
        rows.append({"request": kind, "device_ms": device, "host_ms": host, "saved_ms": host - device})
    if args.json:
        print(json.dumps({"prompt_tokens": len(prompt), "repeats": args.repeats, "rows": rows}, indent=2))
        return
    print(f"time to the first token, {len(prompt)}-token prompt, medians of {args.repeats} (ms)")
    print(f"{'request':<28} {'device':>9} {'host':>9} {'saved':>8}")
    for r in rows:
        print(f"{r['request']:<28} {r['device_ms']:>9.2f} {r['host_ms']:>9.2f} {r['saved_ms']:>8.2f}")
    print("the same token in every pair")


if __name__ == "__main__":
    main()
