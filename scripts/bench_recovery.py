"""The pause a failed step costs the requests it carries on (docs/SERVING.md, "When a step fails").

Every slot of the profile's engine decodes one greedy request (``ignore_eos``); once each has generated
``N`` tokens, for each ``--at N``, the host's next launch raises. The engine recovers (`Engine.recover`),
runs its self-check as the server does, and the requests carried on read their prompt and tokens again
and go on. Printed for each: the recovery's time, the self-check's, the time until every request carried
on has its next token, the whole pause in median decode steps before the failure, and whether each reply is
the one it gets without the failure (it must be: greedy).
Usage: ``python scripts/bench_recovery.py [PROFILE] [--at N ...] [--set KEY=VALUE ...]`` (default: the demo
profile, at 50, 200 and 400 tokens).
"""

import argparse
import statistics
import time
from typing import Any

from strata_cfg.plan.from_profile import resolve_path
from strata_runtime.api import Request, RequestHandle
from strata_runtime.engine import Engine

PROMPT = "It is a truth universally acknowledged, {} times over, that"
AFTER = 40
"""Tokens each request generates after the failure."""


class Planted(RuntimeError):
    """The fault: the host's launch of a window raises."""


def requests(engine: Engine, tokens: int) -> list[Request]:
    """One greedy request a slot, each of its own prompt, generating ``tokens``."""
    return [
        Request(tuple(engine.tokenizer.encode(PROMPT.format(i))), tokens, ignore_eos=True)
        for i in range(engine.n_slots)
    ]


def drained(handle: RequestHandle) -> list[int]:
    """The tokens of every event in ``handle``'s queue, which it empties."""
    return [t for _ in range(handle.events.qsize()) for t in handle.events.get().token_ids]


def replies(engine: Engine, handles: list[RequestHandle]) -> list[list[int]]:
    """Run ``engine`` until it is idle; each handle's tokens (every event drained)."""
    while engine.step():
        pass
    return [drained(h) for h in handles]


def pause(engine: Engine, at: int) -> dict[str, Any]:
    """Fail a step once every slot's request has ``at`` tokens; what the recovery took."""
    handles = [engine.submit(r) for r in requests(engine, at + AFTER)]
    steps, tokens = [], [[] for _ in handles]
    last = time.perf_counter()
    while min(h.completion_tokens for h in handles) < at:
        engine.step()
        now = time.perf_counter()
        steps.append(now - last)
        last = now
    for got, h in zip(tokens, handles, strict=True):
        got += drained(h)

    def planted(job: Any, after: Any = None) -> Any:
        raise Planted("planted in the host's launch")

    t0 = time.perf_counter()
    engine.executor.launch = planted  # type: ignore[method-assign]
    try:
        while True:
            engine.step()
    except Planted as exc:
        del engine.executor.launch
        recovery = engine.recover(exc)
    t1 = time.perf_counter()
    assert engine.self_check() is None, "the model computes what it did after loading"
    t2 = time.perf_counter()
    resumed: list[float | None] = [None] * len(handles)
    while any(t is None for t in resumed):
        engine.step()
        for i, h in enumerate(handles):
            while not h.events.empty():
                event = h.events.get()
                tokens[i] += event.token_ids
                if event.token_ids and resumed[i] is None:
                    resumed[i] = time.perf_counter()
    t3 = max(t for t in resumed if t is not None)
    for got, rest in zip(tokens, replies(engine, handles), strict=True):
        got += rest
    step = statistics.median(steps)
    return {
        "recovery": recovery,
        "recover_ms": (t1 - t0) * 1e3,
        "check_ms": (t2 - t1) * 1e3,
        "resume_ms": (t3 - t2) * 1e3,
        "pause_ms": (t3 - t0) * 1e3,
        "step_ms": step * 1e3,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", nargs="?", default="profiles/demo.toml")
    parser.add_argument("--at", type=int, action="append", help="tokens before the failure (50, 200, 400)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a profile override")
    args = parser.parse_args()
    engine = Engine(resolve_path(args.profile, tuple(args.set)).plan)
    assert engine.self_check() is None  # the reading the later checks compare with
    print(f"{engine.n_slots} slots, {engine.plan.batch.mode} windows")
    for at in args.at or [50, 200, 400]:
        engine.forget_prefixes()
        without = replies(engine, [engine.submit(r) for r in requests(engine, at + AFTER)])
        engine.forget_prefixes()
        got = pause(engine, at)
        print(
            f"failed at {at} tokens: recover {got['recover_ms']:.1f} ms, "
            f"self-check {got['check_ms']:.1f} ms, "
            f"every request's next token {got['resume_ms']:.1f} ms later; the pause {got['pause_ms']:.1f} ms "
            f"= {got['pause_ms'] / got['step_ms']:.1f} decode steps of {got['step_ms']:.2f} ms; "
            f"{got['recovery']}; replies as without the failure: {got['tokens'] == without}"
        )


if __name__ == "__main__":
    main()
