"""Speculative windows decided on the device, chained without the host (CPU virtual devices).

A greedy solo or batch-MTP window accepts its proposals, catches the drafters up and drafts the next window
on the last stage's device, and the next window is queued before the host has read any of it. Against the
same engine deciding every window on the host: the same text, the same proposals and the same acceptance,
on 1 to 3 stages, with requests stopping, running out of context and being cancelled while windows are in
flight; the KV the host accounts is the KV the windows kept.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import numpy as np
import pytest
from rt_engine_helpers import (
    assert_keeps_what_it_read,
    assert_kv_consistent,
    cancel_mid_chain,
    collect,
    kept_tokens,
    run_checking_kv,
    two_sample_p,
)
from rt_plans import make_plan

from strata_runtime.api import Request, SamplingParams
from strata_runtime.engine import Engine, device_spec
from strata_runtime.engine.device_spec import leading_matches
from strata_runtime.engine.flight import Chained, Flight
from strata_runtime.engine.job import CHAINED, Job
from strata_runtime.engine.sampling import distribution
from strata_runtime.model.kvcache import KVError
from strata_runtime.model.placed import Model

PROMPTS = [b"The river", b"A second, longer prompt here", b"Third", b"x" * 20]


def engine(stages: int, slots: int, batch_mtp: bool, on_device: bool, run_ahead: int = 3, context: int = 128):
    plan = make_plan(
        stages=stages,
        slots=slots,
        groups=1,
        batch_mtp=batch_mtp,
        draft_tokens=3,
        context=context,
        prefill_chunk=8,
        run_ahead=run_ahead,
        adaptive_depth=False,  # the same windows whoever decides them
    )
    eng = Engine(plan)
    if not on_device:
        eng._decided_on_device = lambda *args: False  # type: ignore[method-assign]
    return eng


class Launches:
    """Every job the engine launches, which of them were chained to a window decided on the device, and the
    draft logits each drafting slot's proposals came from (on CPU devices a chained window's source has run
    by the time it is launched)."""

    def __init__(self, eng: Engine) -> None:
        self.jobs: list[Job] = []
        self.chained: list[Job] = []
        self.drafts: dict[int, list[np.ndarray]] = {}
        """For each slot, in launch order."""
        launch = eng.executor.launch

        def spy(job: Job, after: Chained | None = None) -> Flight:
            self.jobs.append(job)
            if after is not None and after.rows is None:
                self.chained.append(job)
            for e in job.entries:
                if e.kind == "decode" and len(e.tokens) > 1:
                    logits = eng.model.drafters[e.slot.id].logits[: len(e.tokens) - 1].copy()
                    self.drafts.setdefault(e.slot.id, []).append(logits)
            return launch(job, after)

        eng.executor.launch = spy  # type: ignore[method-assign]


def run(eng: Engine, requests: list[tuple[int, Request]]) -> tuple[list[list[int]], tuple[int, int]]:
    tokens = collect(eng, requests)
    return tokens, (eng.totals["proposals"], eng.totals["accepted"])


@functools.cache
def greedy_alone(prompt: bytes, max_tokens: int) -> tuple[int, ...]:
    """The request's greedy tokens without drafting, windows one at a time."""
    plan = make_plan(stages=1, slots=1, groups=1, context=128, prefill_chunk=8, run_ahead=1)
    return tuple(collect(Engine(plan), [(0, Request(tuple(prompt), max_tokens))])[0])


def test_leading_matches_counts_the_proposals_that_hold_from_the_first() -> None:
    g = np.random.default_rng(5)
    for n in (1, 2, 3, 5, 8):
        tokens = g.integers(1, 4, (64, n))  # few distinct ids, so that runs of matches are common
        picks = g.integers(1, 4, (64, n))
        want = []
        for t, p in zip(tokens, picks, strict=True):
            a = 0
            while a < n - 1 and t[a + 1] == p[a]:
                a += 1
            want.append(a)
        got = leading_matches(np, tokens, picks)
        assert got.tolist() == want
        assert sum(want) > 0 or n == 1


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("batch_mtp", [False, True])
def test_windows_decided_on_the_device_give_the_host_decisions_text_proposals_and_acceptance(
    stages, batch_mtp
) -> None:
    slots = 2 if batch_mtp else 1
    requests = [(0, Request(tuple(PROMPTS[0]), 40))]
    if batch_mtp:
        requests.append((0, Request(tuple(PROMPTS[2]), 33)))
    host_eng = engine(stages, slots, batch_mtp, on_device=False)
    host_launches = Launches(host_eng)
    host = run(host_eng, requests)
    eng = engine(stages, slots, batch_mtp, on_device=True)
    launches = Launches(eng)
    got = run(eng, requests)
    assert got[0] == host[0]
    if not batch_mtp:  # one slot: the same windows, so the same proposals and acceptance
        assert got[1] == host[1]
    assert host[1][1] > 0, "some proposals are accepted"
    # Each window's proposals came from the same draft logits (their values, not only their argmax), until
    # one request ends: running ahead, the other slot's next windows were queued as batch-MTP windows before
    # the host knew, where deciding on the host gives it a solo window with more proposals.
    assert launches.drafts.keys() == host_launches.drafts.keys()
    for slot, want in host_launches.drafts.items():
        same = 0
        for a, b in zip(launches.drafts[slot], want, strict=False):
            if a.shape != b.shape:
                break
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
            same += 1
        assert same >= 8
    for (_, req), tokens in zip(requests, host[0], strict=True):
        assert tuple(tokens) == greedy_alone(bytes(req.prompt_ids), req.max_tokens)
    assert host_eng.totals["decided_on_device"] == 0
    assert eng.totals["decided_on_device"] >= len(launches.chained)  # and the chains' first windows
    assert "speculative windows decided on the device" in eng.summary()
    said = "decided there, running ahead of the host: solo and batch-MTP windows"
    assert eng.startup[-1].endswith(said)
    kind = "batch-mtp" if batch_mtp else "solo"
    chained = [job for job in launches.chained if job.kind == kind]
    assert len(chained) >= 8, "the speculative windows ran chained to one another"
    assert all(job.spec_on_device for job in chained)
    assert all(e.tokens[0] == CHAINED and len(e.tokens) > 1 for job in chained for e in job.entries)


@pytest.mark.parametrize("stages", [1, 2])
def test_staggered_requests_stop_and_restart_chains_with_the_host_decisions_text(stages) -> None:
    """Arrivals break a chain (a prompt waits), a slot left alone takes solo windows, and every window that
    was decided on the device is accounted exactly when it is finished (checked after every step). Arrivals
    are counted in engine steps, and a step finishes one window either way, so the windows' makeup differs
    from the host decisions' and only the text is compared."""
    schedule = [(0, 0, 17), (1, 0, 25), (2, 6, 30), (3, 40, 12)]
    requests = [(at, Request(tuple(PROMPTS[i]), n)) for i, at, n in schedule]
    eng = engine(stages, 4, True, on_device=True)
    launches = Launches(eng)
    assert run(eng, requests)[0] == run(engine(stages, 4, True, on_device=False), requests)[0]
    assert {job.kind for job in launches.chained} >= {"batch-mtp", "solo"}


@pytest.mark.parametrize("batch_mtp", [False, True])
def test_a_stop_token_mid_chain_emits_and_keeps_nothing_after_it(batch_mtp) -> None:
    ref = greedy_alone(PROMPTS[1], 40)
    k = next(i for i in range(10, 40) if ref[i] not in ref[:i])
    stop = ref[k]
    eng = engine(2, 2, batch_mtp, on_device=True)
    launches = Launches(eng)
    h = eng.submit(Request(tuple(PROMPTS[1]), 40, stop_ids=(stop,)))
    other = eng.submit(Request(tuple(PROMPTS[2]), 40)) if batch_mtp else None
    assert run_checking_kv(eng, h) == (list(ref[:k]), "stop")
    assert launches.chained, "the stop came while windows were chained"
    assert eng.totals["discarded_rows"] > 0
    if other is not None:
        got = [t for ev in [other.events.get() for _ in range(other.events.qsize())] for t in ev.token_ids]
        assert tuple(got) == greedy_alone(PROMPTS[2], 40)
    # The slot keeps the prompt and the tokens before the stop, and none of the windows run past it.
    assert eng.slots == [None, None] and kept_tokens(eng, 0) == (*PROMPTS[1], *ref[:k])
    assert_keeps_what_it_read(eng, 0, tuple(PROMPTS[1]), list(ref[:k]))
    again = collect(eng, [(0, Request(tuple(PROMPTS[3]), 15))])[0]
    assert tuple(again) == greedy_alone(PROMPTS[3], 15)


def test_a_request_admitted_while_its_slots_last_request_still_has_windows_in_flight_gets_its_own_text() -> (
    None
):
    """A stop ends a request while serial windows chained behind it still carry its rows; a request arriving
    then takes the freed slot at once. The stale windows still write that slot's KV where the old request
    would have gone; the new request must not see any of it (and the KV accounting must follow the slot's
    new request, not the old one's windows)."""
    ref = greedy_alone(PROMPTS[0], 40)
    k = next(i for i in range(16, 40) if ref[i] not in ref[:i])  # once both requests decode, chained
    seen = False
    for at in range(14, 26):
        eng = engine(1, 2, False, on_device=True)
        stopping = Request(tuple(PROMPTS[0]), 40, stop_ids=(ref[k],))
        other, late = Request(tuple(PROMPTS[1]), 30), Request(tuple(PROMPTS[2]), 12)
        handles = [eng.submit(stopping), eng.submit(other)]
        tokens: list[list[int]] = [[], [], []]
        step = 0
        while eng.step() or len(handles) < 3:
            step += 1
            if step == at:
                handles.append(eng.submit(late))
            assert_kv_consistent(eng)
            for i, h in enumerate(handles):
                while not h.events.empty():
                    tokens[i] += h.events.get().token_ids
            if len(handles) == 3 and handles[2].slot is not None:
                mine = eng.slots[handles[2].slot]
                seen = seen or any(
                    e.slot.id == handles[2].slot and e.slot is not mine
                    for f in eng._chain
                    for e in f.job.entries
                )
        assert tokens[0] == list(ref[:k])
        assert tuple(tokens[1]) == greedy_alone(PROMPTS[1], 30)
        assert tuple(tokens[2]) == greedy_alone(PROMPTS[2], 12), at
    assert seen, "a request took a slot while its last request's chained windows were in flight"


def test_a_request_that_runs_out_of_context_mid_chain_ends_as_with_host_decisions() -> None:
    outs = []
    for on_device in (False, True):
        eng = engine(1, 1, False, on_device=on_device, context=48)
        h = eng.submit(Request(tuple(PROMPTS[1]), 100))
        while eng.step():
            assert_kv_consistent(eng)
        evs = [h.events.get() for _ in range(h.events.qsize())]
        outs.append(([t for ev in evs for t in ev.token_ids], evs[-1].finished))
    assert outs[0] == outs[1] and outs[0][1] == "length"
    assert len(PROMPTS[1]) + len(outs[0][0]) - 1 == 48


@pytest.mark.parametrize(("context", "prompt"), [(58, 0), (60, 1), (66, 0), (66, 1), (70, 0)])
def test_a_window_whose_proposals_all_hold_at_the_end_of_the_context_ends_as_with_host_decisions(
    context, prompt
) -> None:
    """A solo window of several proposals that ends on the context's last position, every proposal held,
    drafts the next window's proposals past the context (no next window has room for them): the engine must
    neither index past its drafters' KV nor change the text."""
    outs = []
    for on_device in (False, True):
        eng = engine(1, 1, False, on_device=on_device, context=context)
        h = eng.submit(Request(tuple(PROMPTS[prompt]), 200))
        while eng.step():
            assert_kv_consistent(eng)
        evs = [h.events.get() for _ in range(h.events.qsize())]
        outs.append(([t for ev in evs for t in ev.token_ids], evs[-1].finished))
    assert outs[0] == outs[1] and outs[0][1] == "length"
    assert len(PROMPTS[prompt]) + len(outs[0][0]) - 1 == context


@pytest.mark.parametrize(("context", "prompt"), [(62, 2), (66, 3)])
def test_a_sampled_request_that_fills_the_context_on_the_device_ends_by_length(context, prompt) -> None:
    eng = engine(1, 1, False, on_device=True, context=context)
    h = eng.submit(Request(tuple(PROMPTS[prompt]), 200, SamplingParams(temperature=0.7, seed=context)))
    while eng.step():
        assert_kv_consistent(eng)
    evs = [h.events.get() for _ in range(h.events.qsize())]
    assert evs[-1].finished == "length"
    assert len(PROMPTS[prompt]) + sum(len(ev.token_ids) for ev in evs) - 1 == context


def test_a_request_cancelled_mid_chain_ends_cancelled_and_the_other_slot_is_unaffected() -> None:
    eng = engine(2, 2, True, on_device=True)
    a, finished, b = cancel_mid_chain(
        eng,
        Request(tuple(PROMPTS[0]), 60),
        Request(tuple(PROMPTS[2]), 30),
        12,
        lambda e: any(f.spec is not None for f in e._chain),
    )
    assert finished == "cancelled"
    assert tuple(a) == greedy_alone(PROMPTS[0], 60)[: len(a)]
    assert tuple(b) == greedy_alone(PROMPTS[2], 30)


def test_the_host_refuses_a_device_decision_that_verify_does_not_make(monkeypatch) -> None:
    """Each finished window's accept counts are checked against `verify` on the same tokens: a device that
    kept one proposal too many is caught at once, not emitted."""
    real = leading_matches

    def one_too_many(xp, tokens, picks):
        return xp.minimum(real(xp, tokens, picks) + 1, tokens.shape[1] - 1)

    monkeypatch.setattr(device_spec, "leading_matches", one_too_many)
    eng = engine(1, 1, False, on_device=True)
    eng.submit(Request(tuple(PROMPTS[0]), 40))
    with pytest.raises(RuntimeError, match="the device kept"):
        while eng.step():
            pass


def test_settling_a_window_that_does_not_start_where_the_kv_ends_is_refused() -> None:
    eng = engine(2, 1, False, on_device=True)
    collect(eng, [(0, Request(tuple(PROMPTS[0]), 4))])
    model = eng.model
    model.rewind(0, 0)  # forget what the slot keeps for prefix reuse
    model.drafters[0].rewind(0)
    model.settle(0, 0, 3, 2)
    assert model.kv_lengths(0) == [2, 2] and model.drafters[0].length == 2
    with pytest.raises(KVError, match="starts at position 3"):
        model.settle(0, 3, 2, 1)


@pytest.mark.parametrize("batch_mtp", [False, True])
def test_sampled_windows_decided_on_the_device_are_seeded_and_greedy_when_cold(batch_mtp) -> None:
    """Sampled requests with drafting are decided on the device too: chained, reproducible from their seeds,
    and at a temperature low enough that each row's distribution is its argmax, the greedy text."""
    slots = 2 if batch_mtp else 1
    cold = SamplingParams(temperature=1e-4, seed=3)
    requests = [(0, Request(tuple(PROMPTS[0]), 30, cold))]
    if batch_mtp:
        requests.append((0, Request(tuple(PROMPTS[2]), 24, SamplingParams(temperature=1e-4, seed=4))))
    eng = engine(2, slots, batch_mtp, on_device=True)
    launches = Launches(eng)
    got, (proposed, accepted) = run(eng, requests)
    assert launches.chained and all(job.spec_on_device for job in launches.chained)
    assert accepted > 0 and eng.totals["decided_on_device"] > 0
    for (_, req), tokens in zip(requests, got, strict=True):
        assert tuple(tokens) == greedy_alone(bytes(req.prompt_ids), req.max_tokens)
    hot = SamplingParams(temperature=0.9, seed=8)
    warm = [(at, Request(r.prompt_ids, r.max_tokens, hot)) for at, r in requests]
    first = run(engine(2, slots, batch_mtp, on_device=True), warm)[0]
    assert first == run(engine(2, slots, batch_mtp, on_device=True), warm)[0]
    assert first != [list(greedy_alone(bytes(r.prompt_ids), r.max_tokens)) for _, r in warm]


def _first_tokens(on_device: bool, requests: int, **adjust: Any) -> Counter[tuple[int, ...]]:
    """How often each run of a request's first three tokens comes up over ``requests`` seeds (temperature
    1, top-k 3, one slot drafting two proposals a window; ``adjust``: penalties or a logit bias)."""
    eng = engine(1, 1, False, on_device=on_device, run_ahead=2)
    seen: Counter[tuple[int, ...]] = Counter()
    for seed in range(requests):
        sampling = SamplingParams(temperature=1.0, top_k=3, seed=seed, **adjust)
        h = eng.submit(Request(tuple(PROMPTS[0]), 3, sampling))
        while eng.step():
            pass
        seen[tuple(t for _ in range(h.events.qsize()) for t in h.events.get().token_ids)] += 1
    assert (eng.totals["decided_on_device"] >= requests) if on_device else not eng.totals["decided_on_device"]
    return seen


@pytest.mark.parametrize(
    "adjust",
    # Three tokens biased far above the rest, for the target and the drafter alike, so that the drafts fall
    # where the target's top-k is and how each was drawn matters; the penalty moves them row by row.
    [{}, {"presence_penalty": 2.0, "logit_bias": ((65, 8.0), (66, 8.0), (67, 8.0))}],
    ids=["plain", "penalised"],
)
def test_sampled_windows_decided_on_the_device_have_the_distribution_of_host_decisions(adjust) -> None:
    """Over 1,500 seeds each, the first three tokens (the prompt's draw, then one window's accepted proposals
    and the draw after them) come out with the same distribution whether the speculative window is decided
    on the device or on the host, whose rule a chi-square test holds to the target's (`test_rt_spec` and,
    with penalties, `test_rt_penalties`): a two-sample chi-square test over the runs of three tokens. With
    penalties, each row of the window and each draft follows the proposals before it."""
    pytest.importorskip("torch")  # for the chi-square survival function
    device, host = _first_tokens(True, 1500, **adjust), _first_tokens(False, 1500, **adjust)
    p_value, dof = two_sample_p(device, host)
    assert dof >= 10 and p_value > 1e-3, f"{dof} degrees of freedom, p = {p_value:.2e}"


def test_a_greedy_and_a_sampled_slot_in_one_window_are_each_decided_by_their_own_rule() -> None:
    """A batch-MTP window decided on the device holding a greedy slot and a sampled one: the greedy request
    gets its text alone, and the sampled one is reproducible from its seed."""
    greedy = Request(tuple(PROMPTS[0]), 30)
    sampled = Request(tuple(PROMPTS[2]), 30, SamplingParams(temperature=0.9, top_k=20, seed=9))
    outs = []
    for _ in range(2):
        eng = engine(2, 2, True, on_device=True)
        launches = Launches(eng)
        outs.append(run(eng, [(0, greedy), (0, sampled)])[0])
        mixed = [job for job in launches.chained if job.kind == "batch-mtp" and len(job.entries) == 2]
        assert mixed, "the two slots' windows ran chained, decided on the device"
    assert outs[0] == outs[1]
    assert tuple(outs[0][0]) == greedy_alone(PROMPTS[0], 30)
    assert tuple(outs[0][1]) != greedy_alone(PROMPTS[2], 30)


def test_each_next_proposal_is_drawn_at_its_own_uniform_not_at_an_accept_or_bonus_one() -> None:
    """A sampled window's uniforms are [accept n - 1 | bonus 1 | next proposals n - 1]. Proposal j + 1 of
    the next window must be drawn at column n + j: reusing an accept uniform would correlate whether this
    window's proposals held with what the next one proposes, a bias too small for the chi-square tests to
    see. Over a uniform distribution on 4 tokens every column here maps to a different token."""
    from types import SimpleNamespace

    from strata_runtime.model import inverse_cdf

    n = 3
    params = SamplingParams(temperature=1.0, seed=1)
    uniforms = np.array(
        [
            [0.99, 0.70, 0.60, 0.01, 0.30],  # accept -> tokens 3, 2; bonus -> 2; proposals -> 0, 1
            [0.10, 0.30, 0.05, 0.55, 0.80],  # accept -> 0, 1; bonus -> 0; proposals -> 2, 3
        ]
    )
    spec = device_spec.DeviceSpec((0, 1), n, params=(params, params), uniforms=uniforms)
    model = SimpleNamespace(
        last=SimpleNamespace(device=SimpleNamespace(xp=np)),
        distribution=lambda logits, params: distribution(logits, params),
        draw=lambda probs, u: np.array([inverse_cdf(row, x) for row, x in zip(probs, u, strict=True)]),
    )
    flat = np.zeros((2, 4), np.float32)  # every token equally likely
    drawn = [device_spec._propose(model, spec, flat, j, []).tolist() for j in range(n - 1)]  # type: ignore[arg-type]
    assert drawn == [[0, 2], [1, 3]]


@pytest.mark.parametrize("sampled", [False, True])
def test_every_window_decided_on_the_device_has_a_shape_the_engine_prepares_at_start(
    monkeypatch, sampled
) -> None:
    """`device_spec.prepare` runs the decision's array steps at start for the shapes of `_spec_shapes`, so
    that no window waits for CuPy to compile them: every (slots, rows per slot) the engine then decides on the
    device must be one of those. Requests join and leave, so solo windows of every depth and batch-MTP
    windows of 1 to 4 slots all run."""
    from strata_runtime.engine import executor

    seen: set[tuple[int, int]] = set()
    decide = executor.decide

    def spy(model, spec, *args, **kwargs):
        seen.add((len(spec.slots), spec.n))
        return decide(model, spec, *args, **kwargs)

    monkeypatch.setattr(executor, "decide", spy)
    params = SamplingParams(temperature=0.8, seed=3) if sampled else SamplingParams(temperature=0.0)
    schedule = [(0, 0, 30), (1, 3, 24), (2, 6, 18), (3, 9, 40)]
    requests = [(at, Request(tuple(PROMPTS[i]), n, params)) for i, at, n in schedule]
    eng = engine(1, 4, True, on_device=True)
    collect(eng, requests)
    prepared = eng._spec_shapes()
    assert seen <= prepared, f"decided on the device without being prepared: {sorted(seen - prepared)}"
    assert any(s == 1 and n > 2 for s, n in seen), "a solo window with more than one proposal ran"
    assert len({s for s, n in seen if n == 2}) >= 3, "batch-MTP windows of several slot counts ran"


def test_the_engine_rehearses_greedy_and_sampled_decisions_at_start_without_touching_a_drafter(
    monkeypatch,
) -> None:
    """At start `device_spec.prepare` runs a sampled decision (`Model.verify_sampled`, with every step of
    `distribution`) for each rows-per-slot a window can have, besides the greedy steps, so that a GPU's first
    sampled window does not wait for CuPy to compile them; it reads and writes no drafter."""
    seen: list[int] = []
    asked: list[SamplingParams] = []
    verify, dist = Model.verify_sampled, Model.distribution

    def spy(self, p, q, tokens, uniforms):
        seen.append(int(p.shape[0]))
        return verify(self, p, q, tokens, uniforms)

    def spy_dist(self, logits, params):
        asked.append(params)
        return dist(self, logits, params)

    monkeypatch.setattr(Model, "verify_sampled", spy)
    monkeypatch.setattr(Model, "distribution", spy_dist)
    eng = engine(1, 4, True, on_device=True)
    rows = sorted({n for _, n in eng._spec_shapes()})
    assert len(rows) > 1 and sorted(seen) == rows
    assert asked and all(p.temperature > 0 and p.top_k > 0 and p.top_p < 1 for p in asked)
    g = np.random.default_rng(5)
    for d in eng.model.drafters.values():  # values a rehearsal that wrote into a drafter would change
        d.hidden[...] = g.standard_normal(d.hidden.shape) + 1
        d.logits[...] = g.standard_normal(d.logits.shape) + 1
    before = {s: (d.hidden.copy(), d.logits.copy(), d.length) for s, d in eng.model.drafters.items()}
    device_spec.prepare(eng.model, eng._spec_shapes())
    for s, d in eng.model.drafters.items():
        hidden, logits, length = before[s]
        np.testing.assert_array_equal(d.hidden, hidden)
        np.testing.assert_array_equal(d.logits, logits)
        assert d.length == length and not d.pending_rows
