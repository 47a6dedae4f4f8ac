"""How a lone request's solo windows draft: a simulation of the engine's own `DraftGauge`.

One request alone decodes 128 tokens in solo windows of up to 3 proposals, its depth chosen as the engine
chooses it (`DraftGauge.depth`, with window times per row count fixed at the given milliseconds), and each
proposal j holding with chance h_j once those before it held (independently, or in bursts: a good stretch
at h, a bad one at 5%). It prints the tokens per millisecond and the share of windows without proposals
(paused), over many seeded requests, in two tables:

* the floor: as the engine reads it (each window's first proposal) and as it read it before (every
  proposal's share of its window);
* the depth after other text (``--depth``): each request follows one on other text whose first proposals
  held 42% of the time (as the bench's warm-up teaches the engine before its repeats), under the adaptive
  depth, the full depth and no drafting, with the window times measured as the requests run;
* silent probes (``--silent``): a paused request probing with windows of one proposal, against probing
  silently (`DraftGauge.silent`: the head's proposal checked against the next token, at no window's cost),
  over the floor's cases and text in long stretches, under the adaptive depth;
* the silent probes' interval (``--intervals 8,2,1-8``): a plain greedy request after one on other text, as
  the bench runs it, probing silently every so many paused windows (``A-B``: A windows apart at first and
  after a probe that holds, the wait doubled after each that fails, up to B; the engine's
  `speculative.SILENT_PROBE_FIRST` and `SILENT_PROBE_MOST`), each probe charged ``--probe-ms`` (the head's
  pass over the rows it deferred and its LM head).

    python scripts/draft_floor_sim.py [--requests 300] [--ms 2.90,3.90,4.80,5.72] [--depth | --silent |
        --intervals 8,2,1-8 [--probe-ms 0.12]]

The default times are one H200's solo windows of 1 and 4 rows on the `qwen3-30b-a3b` preset
(docs/PERFORMANCE.md), with 2 and 3 rows between them. CPU only; no model runs.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

from strata_runtime.engine import speculative
from strata_runtime.engine.depth import PRIOR_WEIGHT, Holds, WindowCosts
from strata_runtime.engine.speculative import DraftGauge

CASES = {
    "85 / 80 / 75%": ([0.85, 0.80, 0.75], None),
    "75 / 70 / 65%": ([0.75, 0.70, 0.65], None),
    "60 / 55 / 50%": ([0.60, 0.55, 0.50], None),
    "45 / 40 / 35%": ([0.45, 0.40, 0.35], None),
    "20 / 20 / 20%": ([0.20, 0.20, 0.20], None),
    "bursts of 80 / 75 / 70%": ([0.80, 0.75, 0.70], (0.95, 0.90)),
}
SILENT_CASES = {
    **CASES,
    "long stretches of 80 / 75 / 70%": ([0.80, 0.75, 0.70], (0.98, 0.98)),
    "long stretches of 60 / 55 / 50%": ([0.60, 0.55, 0.50], (0.98, 0.98)),
}
"""Bursts (p_good, p_bad): each window the text stays good with p_good, or stays bad (5% a proposal) with
p_bad; "long stretches" last about 50 windows each."""


OTHER_TEXT = [0.42, 0.89, 1.0]
"""The chances of the request before each one in the depth table: on one H200 the bench's warm-up request
taught 37-44% / 72-89% / 94-100% (docs/PERFORMANCE.md)."""
DEPTH_CASES = {
    **{f"{h:.0%} / 89% / 100%": ([h, 0.89, 1.0], None) for h in (0.2, 0.3, 0.42, 0.5, 0.56, 0.65, 0.8)},
    "60 / 55 / 50%": ([0.60, 0.55, 0.50], None),
    "45 / 40 / 35%": ([0.45, 0.40, 0.35], None),
    "bursts of 80 / 75 / 70%": ([0.80, 0.75, 0.70], (0.95, 0.90)),
}


def decode(
    gauge: DraftGauge,
    holds: list[float],
    bursts: tuple[float, float] | None,
    ms: list[float],
    rng: random.Random,
    costs: WindowCosts | None = None,
    probe_ms: float = 0.0,
) -> tuple[float, float]:
    """One request of 128 tokens on ``gauge``: its tokens per millisecond and share of windows without
    proposals; each window's time is added to ``costs`` when given, and ``probe_ms`` to the request's time
    for each silent probe."""
    made, spent, windows, paused, good = 0, 0.0, 0, 0, True
    while made < 128:
        if bursts is not None:
            good = rng.random() < (bursts[0] if good else 1 - bursts[1])
        h = holds if good else [0.05] * len(holds)
        depth = gauge.depth(len(ms) - 1)
        accepted = 0
        while accepted < depth and rng.random() < h[accepted]:
            accepted += 1
        gauge.record(depth, accepted)
        if depth == 0 and gauge.silent_probe_due:  # the head's proposal for the next token
            gauge.record(1, int(rng.random() < h[0]), silent=True)
            spent += probe_ms
        if costs is not None:
            costs.observe(depth + 1, ms[depth])
        made, spent = made + accepted + 1, spent + ms[depth]
        windows, paused = windows + 1, paused + (depth == 0)
    return made / spent, paused / windows


def measured(ms: list[float]) -> WindowCosts:
    costs = WindowCosts()
    for rows, t in enumerate(ms, start=1):
        for _ in range(15):
            costs.observe(rows, t)
    return costs


def request(
    holds: list[float], bursts: tuple[float, float] | None, ms: list[float], seed: int, silent: bool = False
) -> tuple[float, float]:
    """One request's tokens per millisecond and share of windows without proposals (``silent``: probing
    silently)."""
    gauge = DraftGauge(0.25, measured(ms), len(ms) - 1, Holds(PRIOR_WEIGHT), silent=silent)
    return decode(gauge, holds, bursts, ms, random.Random(seed))


def after_other_text(
    holds: list[float],
    bursts: tuple[float, float] | None,
    ms: list[float],
    seed: int,
    adaptive: bool,
    probe_ms: float | None = None,
) -> tuple[float, float]:
    """A request after one on other text (`OTHER_TEXT`), as the engine runs them: the window times and,
    with ``adaptive``, the chances by position are what the engine measured so far. With ``probe_ms``, a
    plain greedy request, which probes silently, each probe costing that many milliseconds."""
    rng = random.Random(seed)
    most, silent = len(ms) - 1, probe_ms is not None
    costs, prior = (WindowCosts(), Holds(PRIOR_WEIGHT)) if adaptive else (None, None)
    for text, chunks in ((OTHER_TEXT, None), (holds, bursts)):
        gauge = DraftGauge(0.25, costs, most, prior, silent=silent)
        out = decode(gauge, text, chunks, ms, rng, costs, probe_ms or 0.0)
    return out


@contextmanager
def probes_every(first: int, most: int | None = None) -> Iterator[None]:
    """Silent probes ``first`` paused windows apart, the wait doubled after each that fails up to ``most``
    (default ``first``: a fixed interval), as `speculative.SILENT_PROBE_FIRST` and `SILENT_PROBE_MOST` set
    them. A gauge takes its first wait when it is made, so make it inside."""
    kept = speculative.SILENT_PROBE_FIRST, speculative.SILENT_PROBE_MOST
    speculative.SILENT_PROBE_FIRST, speculative.SILENT_PROBE_MOST = first, first if most is None else most
    try:
        yield
    finally:
        speculative.SILENT_PROBE_FIRST, speculative.SILENT_PROBE_MOST = kept


def interval(text: str) -> tuple[int, int]:
    """``N`` (every N paused windows) or ``A-B`` (A apart, doubling after each failed probe up to B); a
    `ValueError` naming the span where it is neither, or not 1 <= A <= B."""
    first, _, most = text.partition("-")
    try:
        a, b = int(first), int(most or first)
    except ValueError:
        raise ValueError(f"--intervals: {text!r} is not N or A-B (windows, e.g. 2 or 1-8)") from None
    if not 1 <= a <= b:
        raise ValueError(f"--intervals: {text!r} needs 1 <= A <= B")
    return a, b


@contextmanager
def every_proposal() -> Iterator[None]:
    """The floor as it read a window before: the share of all its proposals that held."""
    original = DraftGauge.record

    def record(self: DraftGauge, proposed: int, accepted: int, silent: bool = False) -> None:
        rate = self.rate
        original(self, proposed, accepted, silent)
        if proposed:
            keep = (1 - speculative.DRAFT_WEIGHT) ** proposed
            self.rate = keep * rate + (1 - keep) * accepted / proposed

    DraftGauge.record = record  # type: ignore[method-assign]
    try:
        yield
    finally:
        DraftGauge.record = original  # type: ignore[method-assign]


def table(
    first: str,
    columns: list[str],
    cases: dict[str, tuple[list[float], tuple[float, float] | None]],
    run: Callable[[list[float], tuple[float, float] | None, int, int], tuple[float, float]],
    ms: list[float],
    requests: int,
) -> None:
    """A markdown table: per case, for each column c, the mean tokens per millisecond and share of windows
    paused of ``requests`` seeded requests ``run(holds, bursts, seed, c)``; then no drafting's rate."""
    print(f"| {first} | " + " | ".join(f"{c}: tok/ms, paused" for c in columns) + " | no drafting |")
    print("| --- |" + " ---: |" * (len(columns) + 1))
    for name, (holds, bursts) in cases.items():
        row = []
        for c in range(len(columns)):
            runs = [run(holds, bursts, seed, c) for seed in range(requests)]
            rate = sum(r for r, _ in runs) / len(runs)
            paused = sum(p for _, p in runs) / len(runs)
            row.append(f"{rate:.3f}, {paused:.0%}")
        print(f"| {name} | " + " | ".join(row) + f" | {1 / ms[0]:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--ms", default="2.90,3.90,4.80,5.72", help="solo window times of 1, 2, ... rows")
    parser.add_argument("--depth", action="store_true", help="the depth after other text, not the floor")
    parser.add_argument("--silent", action="store_true", help="window probes against silent probes")
    parser.add_argument("--intervals", help="silent probes' intervals: N or A-B (backing off), e.g. 2,1-8")
    parser.add_argument("--probe-ms", type=float, default=0.12, help="what a silent probe costs (ms)")
    args = parser.parse_args()
    ms = [float(v) for v in args.ms.split(",")]
    n = args.requests

    def silent(h: list[float], b: tuple[float, float] | None, seed: int, c: int) -> tuple[float, float]:
        return request(h, b, ms, seed, silent=c == 1)

    def depth(h: list[float], b: tuple[float, float] | None, seed: int, c: int) -> tuple[float, float]:
        return after_other_text(h, b, ms, seed, adaptive=c == 0)

    def floor(h: list[float], b: tuple[float, float] | None, seed: int, c: int) -> tuple[float, float]:
        with every_proposal() if c == 1 else nullcontext():
            return request(h, b, ms, seed)

    if args.intervals:
        try:
            spans = [interval(v) for v in args.intervals.split(",")]
        except ValueError as exc:
            parser.error(str(exc))

        def probing(h: list[float], b: tuple[float, float] | None, seed: int, c: int) -> tuple[float, float]:
            with probes_every(*spans[c]):
                return after_other_text(h, b, ms, seed, True, args.probe_ms)

        columns = [
            f"silent probes every {a}" if a == b else f"silent probes {a} to {b} apart" for a, b in spans
        ]
        table("chances of proposals 1 / 2 / 3", columns, {**DEPTH_CASES, **SILENT_CASES}, probing, ms, n)
    elif args.silent:
        table("chances", ["window probes", "silent probes"], SILENT_CASES, silent, ms, n)
    elif args.depth:
        table("chances of proposals 1 / 2 / 3", ["adaptive depth", "full depth"], DEPTH_CASES, depth, ms, n)
    else:
        table("chances", ["first proposal", "every proposal"], CASES, floor, ms, n)


if __name__ == "__main__":
    main()
