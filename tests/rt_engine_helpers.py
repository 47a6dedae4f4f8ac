"""Shared by the engine tests: the window modes as plan keywords, and running requests to the end.

`MODES` gives each window mode's plan keywords for `rt_plans.make_plan`; `mode_plan` adapts them to the
number of stages (pipelined groups need a split). `collect` submits requests at given steps and steps the
engine until every request has finished, checking after every step that each stage's KV (and each drafter)
holds exactly what its slot has committed, and `collect_launched` also returns the windows it launched.
`run_script` runs one of `scripts/` and returns what it printed. `handed_to_cache` records what an expert
cache is told.
`bench_with_and_without` runs the bench's CLI with and without one flag. `generate` runs one request to its
end; `chi_square_p` is the p-value of counts against the counts a distribution expects, `two_sample_p` of
two samples' counts against their drawing from one distribution. `plant` makes one call of an engine's
method raise `Planted`, a fault for the recovery tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import numpy as np
from rt_plans import make_plan, with_mtp_in_groups

from strata_cfg.schema.plan import LaunchPlan
from strata_runtime.api import Request, SamplingParams
from strata_runtime.engine import Engine
from strata_runtime.engine.speculative import DEFER_MOST
from strata_runtime.experts.cache import HELPER, HOST, Reads
from strata_runtime.experts.store import ExpertStore

MODES: dict[str, dict[str, Any]] = {
    "solo": {"slots": 1, "draft_tokens": 4},
    "serial": {"slots": 4, "groups": 1},
    "pipelined": {"slots": 4, "groups": 2},
    "batch-mtp": {"slots": 4, "groups": 1, "batch_mtp": True, "draft_tokens": 3},
    "pipelined-mtp": {"slots": 4, "groups": 2, "draft_tokens": 3},
}
"""Window modes by their keywords to `rt_plans.make_plan`; ``pipelined-mtp`` is batch MTP inside pipelined
groups, which needs a split (`mode_plan` gives it two stages at least)."""


def mode_plan(mode: str, stages: int, make: Callable[..., LaunchPlan] = make_plan, **kw: Any) -> LaunchPlan:
    """The plan of window mode ``mode`` on ``stages`` virtual CPU stages (``kw``: more plan keywords), made
    by ``make`` from `rt_plans.make_plan`'s keywords (by default that function itself)."""
    args = {**MODES[mode], **kw}
    if mode == "pipelined" and stages == 1:
        args["groups"] = None  # groups need a split; one stage keeps one group
    if mode == "pipelined-mtp":
        return with_mtp_in_groups(make(stages=max(stages, 2), **args))
    return make(stages=stages, **args)


def launches(eng: Engine) -> list[tuple[Any, Any, Any]]:
    """Every window ``eng`` launches from now on, as (job, what it is chained to or None, its flight); ``del
    eng.executor.launch`` stops the recording."""
    seen: list[tuple[Any, Any, Any]] = []
    launch = eng.executor.launch

    def launching(job: Any, after: Any = None) -> Any:
        flight = launch(job, after)
        seen.append((job, after, flight))
        return flight

    eng.executor.launch = launching  # type: ignore[method-assign]
    return seen


def collect_launched(
    eng: Engine, schedule: list[tuple[int, Request]]
) -> tuple[list[list[int]], list[tuple[Any, Any, Any]]]:
    """`collect`, with every window it launched as `launches` records them (the recording stops after)."""
    seen = launches(eng)
    try:
        return collect(eng, schedule), seen
    finally:
        del eng.executor.launch


def run_script(name: str, *argv: str) -> str:
    """The standard output of ``scripts/NAME`` run with ``argv`` from the repository's root, which must exit
    0 (its standard error's tail is the failure's message otherwise)."""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, str(root / "scripts" / name), *argv],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def chained_grammar_windows(seen: list[tuple[Any, Any, Any]]) -> list[int]:
    """Of `launches`' windows, those with rows under a grammar chained behind another (queued before the host
    read the tokens their masks follow): how many slots each holds."""
    return [
        len(job.entries) for job, after, _ in seen if after is not None and any(e.masked for e in job.entries)
    ]


def collect(eng: Engine, schedule: list[tuple[int, Request]], check_kv: bool = True) -> list[list[int]]:
    """Submit each request at its step, run to the end, return each request's tokens."""
    handles: list[Any] = [None] * len(schedule)
    tokens: list[list[int]] = [[] for _ in schedule]
    done = [False] * len(schedule)
    step = 0
    while not all(done):
        for i, (at, req) in enumerate(schedule):
            if handles[i] is None and at <= step:
                handles[i] = eng.submit(req)
        eng.step()
        step += 1
        assert step < 10_000
        if check_kv:
            assert_kv_consistent(eng)
        for i, h in enumerate(handles):
            while h is not None and not h.events.empty():
                ev = h.events.get()
                assert ev.error is None, ev.error
                tokens[i] += ev.token_ids
                done[i] = done[i] or ev.finished is not None
    assert all(s is None for s in eng.slots), "every slot is released at the end"
    return tokens


def run_checking_kv(eng: Engine, handle: Any) -> tuple[list[int], str | None]:
    """Run the engine to the end, checking the KV after every step; ``handle``'s tokens and how it ended."""
    events = []
    while eng.step():
        assert_kv_consistent(eng)
        while not handle.events.empty():
            events.append(handle.events.get())
    return [t for ev in events for t in ev.token_ids], events[-1].finished


def cancel_mid_chain(
    eng: Engine, first: Request, second: Request, steps: int, chained: Callable[[Engine], bool]
) -> tuple[list[int], str | None, list[int]]:
    """Submit two requests, step ``steps`` times, check that ``chained(eng)`` holds (windows are in flight),
    cancel the first and run to the end, checking the KV after every step. Returns the first request's
    tokens and how it finished, and the second's tokens."""
    ha, hb = eng.submit(first), eng.submit(second)
    for _ in range(steps):
        eng.step()
    assert chained(eng), "windows are chained by now"
    ha.cancel()
    while eng.step():
        assert_kv_consistent(eng)
    a = [ha.events.get() for _ in range(ha.events.qsize())]
    b = [hb.events.get() for _ in range(hb.events.qsize())]
    return [t for ev in a for t in ev.token_ids], a[-1].finished, [t for ev in b for t in ev.token_ids]


def assert_kv_consistent(eng: Engine) -> None:
    """Every stage holds exactly the slot's committed positions and the rows of its chained windows still in
    flight (the drafter only the committed ones: in its KV, or deferred until it drafts again, at most
    `DEFER_MOST`). A window decided on the device is accounted when it is finished, so its rows in flight
    do not count yet."""
    for i, slot in enumerate(eng.slots):
        if slot is None:  # a free slot keeps its last request's tokens for prefix reuse, or nothing
            kept = eng.prefixes.kept[i]
            assert eng.model.kv_lengths(i) == [0 if kept is None else len(kept.tokens)] * len(
                eng.model.stages
            )
            if eng.tracked:
                drafter = eng.model.drafters[i]
                assert drafter.length + drafter.pending_rows == (0 if kept is None else kept.drafted)
            continue
        ahead = sum(  # the rows of this request's chained windows (not those of the slot's previous one)
            len(e.tokens) for f in eng._chain if f.spec is None for e in f.job.entries if e.slot is slot
        )
        assert eng.model.kv_lengths(i) == [slot.length + ahead] * len(eng.model.stages)
        if eng.tracked:
            drafter = eng.model.drafters[i]
            assert drafter.length + drafter.pending_rows == slot.length
            assert drafter.pending_rows <= DEFER_MOST


def kept_tokens(eng: Engine, slot: int) -> tuple[int, ...]:
    """The tokens free slot ``slot`` keeps for prefix reuse, checked to be what every stage's KV holds."""
    assert eng.slots[slot] is None
    kept = eng.prefixes.kept[slot]
    tokens = () if kept is None else kept.tokens
    assert eng.model.kv_lengths(slot) == [len(tokens)] * len(eng.model.stages)
    return tokens


def assert_keeps_what_it_read(eng: Engine, slot: int, prompt: tuple[int, ...], out: list[int]) -> None:
    """Free slot ``slot`` keeps the KV of what its request read and nothing past it: its prompt and its
    emitted tokens, all but the last of them at most (a last token chosen is not read unless the request
    went on past it, as past a stop or a cancellation)."""
    kept = kept_tokens(eng, slot)
    assert len(prompt) + len(out) - 1 <= len(kept) <= len(prompt) + len(out)
    assert kept == (*prompt, *out)[: len(kept)]


def handed_to_cache(store: ExpertStore) -> list[tuple[np.ndarray, Reads | None]]:
    """From now on, every (routing counts [L, E], reads) the engine hands ``store``'s cache, in order."""
    handed: list[tuple[np.ndarray, Reads | None]] = []
    decide = store.decide

    def spy(counts: np.ndarray, windows: int = 1, reads: Reads | None = None, prompt: bool = False) -> Any:
        handed.append((counts.copy(), reads))
        return decide(counts, windows, reads, prompt)

    store.decide = spy  # type: ignore[method-assign]
    return handed


def assert_reads_by_tier(handed: list[tuple[np.ndarray, Reads | None]], tiers: np.ndarray) -> None:
    """Each hand-over's reads are exactly its counts in the helper tier and in host memory, by ``tiers``
    [L, E] (the cache was frozen)."""
    assert handed
    for counts, reads in handed:
        assert reads == Reads(int(counts[tiers == HELPER].sum()), int(counts[tiers == HOST].sum()))


def record_unreplayed(monkeypatch: Any) -> list[int]:
    """From now on, the row counts of decode windows (through a stage's layers or the drafting head) that ran
    eagerly or were captured as a graph, rather than replaying one: the returned list fills as they run."""
    from strata_runtime.cuda.decode import CudaLayers

    unreplayed: list[int] = []
    replay = CudaLayers.replay

    def counting(self: CudaLayers, b: Any, body: Callable[[Any], None]) -> None:
        if b.rows not in self.captured:  # eager (first) or capturing (second)
            unreplayed.append(b.rows)
        replay(self, b, body)

    monkeypatch.setattr(CudaLayers, "replay", counting)
    return unreplayed


BenchRun = tuple[dict[str, Any], str]
"""A bench run's JSON and its stderr."""


def bench_with_and_without(profile: Path, argv: list[str], flag: str) -> dict[bool, BenchRun]:
    """`strata bench` on ``profile`` with ``argv`` and ``--json``, run without and with ``flag``: for each,
    keyed by whether the flag was given, its JSON and its stderr (each run must succeed)."""
    base = [sys.executable, "-m", "strata_cfg", "bench", str(profile), *argv, "--json"]
    runs = {}
    for extra in ([], [flag]):
        out = subprocess.run(base + extra, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        runs[bool(extra)] = (json.loads(out.stdout), out.stderr)
    return runs


def generate(
    eng: Engine, prompt: tuple[int, ...], n: int, sampling: SamplingParams | None = None
) -> list[int]:
    """The tokens of one request of ``n`` tokens, run to its end on ``eng``."""
    h = eng.submit(Request(prompt, n, sampling or SamplingParams()))
    while eng.step():
        pass
    return [t for _ in range(h.events.qsize()) for t in h.events.get().token_ids]


def chi_square_p(counts: np.ndarray, expected: np.ndarray) -> float:
    """The p-value of ``counts`` against the ``expected`` counts of the same cells (Pearson's chi-square,
    one degree of freedom fewer than cells). Needs torch, for the survival function: callers skip without
    it."""
    import torch

    chi2 = float(((counts - expected) ** 2 / expected).sum())
    dof = counts.size - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(chi2 / 2.0)))


def two_sample_p(a: Counter[Hashable], b: Counter[Hashable], least: int = 10) -> tuple[float, int]:
    """The p-value that samples ``a`` and ``b`` (of the same size) come from one distribution, by the
    two-sample chi-square test over the outcomes either drew at least ``least`` times together, and its
    degrees of freedom. Needs torch, as `chi_square_p`."""
    import torch

    cells = [k for k in a.keys() | b.keys() if a[k] + b[k] >= least]
    chi2 = sum((a[k] - b[k]) ** 2 / (a[k] + b[k]) for k in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(chi2 / 2.0))), dof


class Planted(RuntimeError):
    """A fault a test plants in the engine (`plant`)."""


def plant(owner: Any, name: str, at: int) -> list[int]:
    """Make the ``at``-th call (from 1) of ``owner``'s method ``name`` raise `Planted`, once; returns the
    calls counted so far (``delattr(owner, name)`` takes it out)."""
    real, calls = getattr(owner, name), [0]

    def planted(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == at:
            raise Planted(f"planted in {name} at call {at}")
        return real(*args, **kw)

    setattr(owner, name, planted)
    return calls
