"""Before a bench's first measured repeat, on every arm: a warm-up that runs every window shape the
workload will (`warm_up`), the adaptive expert caches settled on other text (`settle`), and the drafting depth
taught on other text (`teach`), each with the line the bench prints about it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from strata_cfg.schema.windows import warm_prompt_lengths
from strata_cfg.schema.workloads import (
    CLIENT_COUNTS,
    WARM_PROMPTS,
    prompt_ids,
)

from ..api import Request, SamplingParams, Tokenizer
from .harness import (
    SETTLE_MOST,
    Arrival,
    InProcessDriver,
    Settling,
    Taught,
    adaptive_caches,
    settle_experts,
    settled,
    teach_drafting,
)

if TYPE_CHECKING:
    from ..engine import Engine


WARM_STREAMS = {
    "two-decodes": 2,
    "clients": max(CLIENT_COUNTS),
    "read-beside-decode": 1,
    "solo": 1,
    "turns": 1,
    "shared": 2,
    "conversations": 1,
}
"""Streams each workload decodes at once, which the warm-up runs too (every window shape it will use)."""


WARM_TOKENS = 24


def warm_up(engines: dict[str, Engine], length: int, vocab: int, streams: int = 0) -> None:
    """Before the first measured repeat, on every arm: read one prompt of ``length``, one of each size of
    prefill graph the arm replays (`strata_cfg.schema.windows.warm_prompt_lengths`: each is captured
    then) and one of `PROMPT_GRAPH_MAX` rows where the arm's prefill path also reads short prompts (its
    products at a few dozen rows load other kernels than a long chunk's), then decode ``streams`` requests
    at once, joining one at a time (so every group runs), then capture the graph of every decode window
    shape these did not (`strata_runtime.model.placed.Model.capture_window_graphs`), so that no repeat pays
    for compiling kernels or capturing graphs; then forget the warm-up's requests
    (`strata_runtime.engine.Engine.forget_requests`), as `strata serve`'s warm-up does: their window
    statistics and what their proposals did (the window times, which count only replayed windows, are
    kept)."""
    greedy = SamplingParams(temperature=0.0)
    ids = prompt_ids(length, vocab, seed=1 << 20)  # not a seed any repeat uses
    for engine in engines.values():
        InProcessDriver(engine).run([Arrival(Request(ids, 1, greedy))])
        mem = engine.plan.memory
        lengths = warm_prompt_lengths(mem.prefill_graph_rows, mem.prompt_graph_rows, mem.context)
        for k, n in enumerate(lengths):
            once = prompt_ids(n, vocab, seed=(1 << 20) - 1 - k)
            InProcessDriver(engine).run([Arrival(Request(once, 1, greedy))])
        if streams:
            short = [prompt_ids(4, vocab, seed=(1 << 20) + i) for i in range(streams)]
            arrivals = [
                Arrival(Request(p, WARM_TOKENS, greedy), after_tokens=2 * i) for i, p in enumerate(short)
            ]
            InProcessDriver(engine).run(arrivals)
        engine.forget_prefixes()  # before the capture, which writes slot 0's KV
        engine.model.capture_window_graphs()
        engine.forget_requests()


def settle(
    engines: dict[str, Engine], workload: str, tokens: int, tokenizer: Tokenizer
) -> dict[str, list[Settling]]:
    """Settle the arms' adaptive expert caches before the first repeat (`settle_experts`), on requests of the
    workload's streams and ``tokens`` each, greedy, on prompts no repeat uses (`WARM_PROMPTS`): every repeat
    then starts from a cache that has served other text, as a server's has. Arms of one layout share their
    caches, so each set of caches settles once. The engines then forget the warm-up's requests. {} for the
    workloads that decode nothing."""
    if workload not in WARM_STREAMS:
        return {}
    greedy = SamplingParams(temperature=0.0)

    def arrivals(k: int) -> list[Arrival]:
        return warm_arrivals(workload, k, tokens, tokenizer, greedy)

    out: dict[str, list[Settling]] = {}
    done: set[int] = set()
    for name, engine in engines.items():
        caches = adaptive_caches(engine)
        if not caches or all(id(c) in done for c in caches):
            continue
        out[name] = settle_experts(engine, arrivals)
        done.update(id(c) for c in caches)
        engine.forget_requests()
    return out


def teach(
    engines: dict[str, Engine],
    workload: str,
    tokens: int,
    tokenizer: Tokenizer,
    sampling: SamplingParams,
    seeded: bool = True,
) -> dict[str, Taught | None]:
    """Before the first repeat, each arm whose drafting depth learns (`teach_drafting`) decodes requests
    like the workload's (its streams, ``tokens`` each, the bench's sampling) on prompts no repeat uses
    (`WARM_PROMPTS`), so that every repeat starts from an estimate of how often proposals hold that other
    text taught, as a server's next request does. A seeded sampled request drafts at a fixed depth (its
    text must not depend on window times), so nothing is taught for those. {} for the workloads that
    decode nothing."""
    if workload not in WARM_STREAMS or (sampling.temperature > 0 and seeded):
        return {}
    arrivals = warm_arrivals(workload, SETTLE_MOST, tokens, tokenizer, sampling)  # after settling's
    return {name: teach_drafting(engine, arrivals) for name, engine in engines.items()}


def warm_arrivals(
    workload: str, k: int, tokens: int, tokenizer: Tokenizer, sampling: SamplingParams
) -> list[Arrival]:
    """The k-th set of warm-up requests on text no repeat uses (`WARM_PROMPTS`): one per stream the
    workload decodes at once, ``tokens`` each, choosing by ``sampling``."""
    streams = max(WARM_STREAMS[workload], 1)
    texts = [WARM_PROMPTS[(k * streams + i) % len(WARM_PROMPTS)] for i in range(streams)]
    return [Arrival(Request(tuple(tokenizer.encode(t)), tokens, sampling)) for t in texts]


def taught_line(t: Taught, tokens: int) -> str:
    """One line on what warm-up requests taught an arm's drafting before the first repeat."""
    held = f"{t.accepted} of {t.proposals} proposals held" if t.proposals else "no proposal drafted"
    kinds = "; ".join(
        f"{kind}: " + " / ".join(f"{c:.0%}" for c in chances)
        for kind, chances in t.chances.items()
        if chances
    )
    where = f", by position: {kinds}" if kinds else ""
    return (
        f"drafting: every repeat starts from what {t.requests} warm-up request(s) of {tokens} tokens on "
        f"other text taught ({held}{where}; --cold-drafting starts from nothing)"
    )


def settling_line(steps: list[Settling], slots: int, tokens: int) -> str:
    """One line on how an arm's expert caches (``slots`` slots in all) settled before the first repeat."""
    shares = " -> ".join(f"{x.from_vram:.1%}" for x in steps)
    moved = sum(x.moved for x in steps)
    how = "settled" if settled(steps, slots) else "still learning"
    return (
        f"expert cache {how} after {len(steps)} warm-up request(s) of {tokens} tokens, which every repeat "
        f"starts from: {shares} of the decode windows' expert work from VRAM, {moved:,} experts brought in "
        f"for {slots:,} slots (--cold-experts skips this)"
    )
