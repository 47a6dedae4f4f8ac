"""How often the demo model's MTP drafts hold on text it was not trained on (greedy).

Persuasion is held out of the demo model's training (``scripts/demo_corpus.py``). From ``--prompts``
of its paragraphs, evenly spaced, each one's first ``--prompt-bytes`` bytes are a prompt, and the engine of
``--profile`` (default: the demo's, two virtual CPU stages) writes ``--tokens`` greedily for each, one request
at a time: each window is the request's token plus three chained proposals. Prints the share of proposals
accepted, the share by depth (the first proposal; the second when the first held; the third when both held)
and tokens per window, plus one sample continuation.

Usage: ``python scripts/demo_acceptance.py --corpus /tmp/austen`` (the corpus as ``demo_corpus.py`` gets it).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import demo_corpus

from strata_cfg.plan.from_profile import resolve_path
from strata_runtime.api import Request
from strata_runtime.engine import Engine


def prompts(text: str, count: int, size: int) -> list[bytes]:
    """The first ``size`` bytes of ``count`` evenly spaced paragraphs that are at least twice that long."""
    long = [p.encode() for p in text.splitlines() if len(p.encode()) >= 2 * size]
    step = len(long) / count
    return [long[int(i * step)][:size] for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--profile", default="profiles/demo.toml")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-bytes", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    _, held = demo_corpus.split(args.corpus)
    engine = Engine(resolve_path(args.profile).plan)
    depth = engine.plan.spec.draft_tokens - 1
    sample, windows = "", []
    for j, prompt in enumerate(prompts(held, args.prompts, args.prompt_bytes)):
        handle = engine.submit(Request(tuple(prompt), args.tokens))
        while engine.step():
            pass
        tokens = [t for _ in range(handle.events.qsize()) for t in handle.events.get().token_ids]
        windows += engine.windows  # the engine keeps only its latest windows
        engine.windows.clear()
        if j == 0:
            reply = bytes(t for t in tokens if t < 256).decode(errors="replace")
            sample = f"{prompt.decode()!r} -> {reply!r}"
    solo = [w for w in windows if w.kind == "solo" and w.proposals == depth]
    held_to = Counter(w.accepted for w in solo)  # windows by how many of their proposals held
    t = engine.totals
    print(f"{args.prompts} held-out prompts of {args.prompt_bytes} bytes, {args.tokens} tokens each (greedy)")
    print(f"proposals accepted: {t['accepted']}/{t['proposals']} ({t['accepted'] / t['proposals']:.1%})")
    reached = len(solo)
    for d in range(1, depth + 1):
        held_here = sum(n for a, n in held_to.items() if a >= d)
        share = held_here / max(reached, 1)
        print(f"  depth {d}: {held_here}/{reached} ({share:.1%}) of the windows that got there")
        reached = held_here
    print(f"tokens per decode window: {sum(w.accepted + 1 for w in solo) / max(len(solo), 1):.2f}")
    print(f"sample: {sample}")


if __name__ == "__main__":
    main()
