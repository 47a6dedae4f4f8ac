"""Serial decode windows run ahead: the next window is queued before the host has read the tokens it reads.

Each chained window embeds the tokens the window before it chose on the device. The text must be exactly the
text of windows run one at a time (``run_ahead = 1``), on 1 to 3 virtual stages, with requests arriving,
stopping, running out of tokens or context and being cancelled while windows are in flight; a request that
stops computes at most ``run_ahead - 1`` windows past its stop, and emits and keeps nothing of them.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from rt_engine_helpers import (
    assert_keeps_what_it_read,
    assert_kv_consistent,
    cancel_mid_chain,
    collect,
    kept_tokens,
    run_checking_kv,
)
from rt_plans import make_plan

from strata_runtime.api import Reasoning, Request, SamplingParams
from strata_runtime.engine import Engine
from strata_runtime.engine.flight import Chained, Flight
from strata_runtime.engine.job import CHAINED, Job

PROMPTS = [b"The river", b"A second, longer prompt here", b"Third", b"x" * 20]


def engine(
    stages: int,
    slots: int,
    run_ahead: int,
    draft_tokens: int = 0,
    context: int = 128,
    adaptive_depth: bool | None = None,
) -> Engine:
    """An engine whose profile sets ``batch.run_ahead`` (and ``spec.adaptive_depth``, where given)."""
    plan = make_plan(
        stages=stages,
        slots=slots,
        groups=1,
        draft_tokens=draft_tokens,
        context=context,
        prefill_chunk=8,
        run_ahead=run_ahead,
        adaptive_depth=adaptive_depth,
    )
    return Engine(plan)


class Spy:
    """Records the engine's launches and finishes, in order, and how many windows were in flight."""

    def __init__(self, eng: Engine) -> None:
        self.log: list[tuple[str, Job]] = []
        self.chained: list[Job] = []
        self.most_in_flight = 0
        launch, finish = eng.executor.launch, eng.executor.finish
        in_flight: list[Flight] = []

        def spy_launch(job: Job, after: Chained | None = None) -> Flight:
            flight = launch(job, after)
            if after is not None:
                self.chained.append(job)
            in_flight.append(flight)
            self.most_in_flight = max(self.most_in_flight, len(in_flight))
            self.log.append(("launch", job))
            return flight

        def spy_finish(flight: Flight) -> Any:
            in_flight.remove(flight)
            self.log.append(("finish", flight.job))
            return finish(flight)

        eng.executor.launch = spy_launch  # type: ignore[method-assign]
        eng.executor.finish = spy_finish  # type: ignore[method-assign]


@functools.cache
def alone(prompt: bytes, max_tokens: int) -> tuple[int, ...]:
    """The request's greedy tokens, alone and windows one at a time."""
    return tuple(collect(engine(1, 1, 1), [(0, Request(tuple(prompt), max_tokens))])[0])


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("run_ahead", [2, 3])
def test_a_lone_stream_queues_its_next_windows_before_finishing_one_and_gives_the_same_text(
    stages, run_ahead
) -> None:
    eng = engine(stages, 1, run_ahead)
    assert any(f"up to {run_ahead} in flight" in line for line in eng.startup)
    spy = Spy(eng)
    got = collect(eng, [(0, Request(tuple(PROMPTS[0]), 24))])[0]
    assert tuple(got) == alone(PROMPTS[0], 24)
    assert spy.most_in_flight == run_ahead
    decode = [job for what, job in spy.log if what == "launch" and job.kind == "solo"]
    assert len(decode) == 24 - 1  # the prompt's window gives the first token; none is launched past the last
    assert len(spy.chained) >= 20
    assert all(e.tokens == [CHAINED] for job in spy.chained for e in job.entries)
    # Once the chain runs, each finish is followed by the launch of the window run_ahead - 1 places after it.
    kinds = [what for what, job in spy.log if job.kind == "solo"]
    steady = kinds[run_ahead : run_ahead + 10]
    assert steady == ["finish", "launch"] * 5


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("draft_tokens", [0, 3])
def test_serial_windows_of_several_slots_run_ahead_with_the_text_of_windows_one_at_a_time(
    stages, draft_tokens
) -> None:
    """Staggered arrivals and different lengths: chains start, stop for a prompt and start again. With a
    drafting plan the drafters are caught up window by window, and a slot left alone drafts again."""
    schedule = [(0, 17), (0, 9), (5, 30), (40, 12)]
    requests = [(at, Request(tuple(PROMPTS[i]), n)) for i, (at, n) in enumerate(schedule)]
    base = collect(engine(stages, 4, 1, draft_tokens), requests)
    eng = engine(stages, 4, 2, draft_tokens)
    spy = Spy(eng)
    assert collect(eng, requests) == base
    assert any(len(job.entries) >= 2 for job in spy.chained)  # serial windows of several slots chained
    if draft_tokens:
        assert any(w.kind == "solo" and w.rows > 1 for w in eng.windows)  # the last slot alone drafts
    for (_, req), tokens in zip(requests, base, strict=True):
        assert tuple(tokens) == alone(bytes(req.prompt_ids), req.max_tokens)


@pytest.mark.parametrize("stages", [1, 2])
def test_a_stop_token_computes_a_bounded_overrun_that_is_neither_emitted_nor_kept(stages) -> None:
    run_ahead = 3
    ref = alone(PROMPTS[1], 40)
    k = 12
    stop = ref[k]
    assert stop not in ref[:k], "the stop must first appear at index k"
    eng = engine(stages, 2, run_ahead)
    spy = Spy(eng)
    h = eng.submit(Request(tuple(PROMPTS[1]), 40, stop_ids=(stop,)))
    assert run_checking_kv(eng, h) == (list(ref[:k]), "stop")
    decode = [job for what, job in spy.log if what == "launch" and job.kind != "prefill"]
    assert k < len(decode) <= k + run_ahead - 1  # the stop came out of decode window k - 1
    assert eng.totals["discarded_rows"] == len(decode) - k  # counted, and exported as a metric
    assert "past a stop and discarded" in eng.summary()
    # The slot keeps the prompt and the tokens before the stop, none of the overrun.
    assert eng.slots == [None, None] and kept_tokens(eng, 0) == (*PROMPTS[1], *ref[:k])
    # The slot's next request reads its own text.
    again = collect(eng, [(0, Request(tuple(PROMPTS[2]), 15))])[0]
    assert tuple(again) == alone(PROMPTS[2], 15)


def test_a_stop_string_ends_the_text_at_the_same_place_running_ahead() -> None:
    base_eng, eng = engine(1, 1, 1), engine(1, 1, 3)
    text = eng.tokenizer.decode(list(alone(PROMPTS[0], 30)))
    stop = text[10:13]
    assert len(stop) == 3 and stop not in text[:12]
    outs = []
    for e in (base_eng, eng):
        h = e.submit(Request(tuple(PROMPTS[0]), 30, stop_strings=(stop,)))
        while e.step():
            pass
        evs = [h.events.get() for _ in range(h.events.qsize())]
        outs.append(("".join(ev.text for ev in evs), evs[-1].finished))
    assert outs[0] == outs[1] and outs[1][1] == "stop"


def test_a_newcomer_stops_the_chain_and_is_served_between_windows() -> None:
    eng = engine(1, 2, 2)
    spy = Spy(eng)
    a = Request(tuple(PROMPTS[0]), 30)
    b = Request(tuple(PROMPTS[3]), 6)
    got = collect(eng, [(0, a), (12, b)])
    assert got == [list(alone(PROMPTS[0], 30)), list(alone(PROMPTS[3], 6))]
    # No chained window is launched while the newcomer's prompt waits: each prefill launch follows a finish.
    launches = [(what, job) for what, job in spy.log]
    for i, (what, job) in enumerate(launches):
        if what == "launch" and job.kind == "prefill" and i:
            assert launches[i - 1][0] == "finish"


def test_a_request_that_runs_out_of_context_mid_chain_ends_as_it_does_alone() -> None:
    prompt = tuple(PROMPTS[1])
    outs = []
    for run_ahead in (1, 2):
        eng = engine(1, 1, run_ahead, context=40)
        h = eng.submit(Request(prompt, 100))
        while eng.step():
            assert_kv_consistent(eng)
        evs = [h.events.get() for _ in range(h.events.qsize())]
        outs.append(([t for ev in evs for t in ev.token_ids], evs[-1].finished))
    assert outs[0] == outs[1] and outs[0][1] == "length"
    assert len(prompt) + len(outs[0][0]) - 1 == 40  # the KV is full: the last token is never read


def test_a_request_cancelled_mid_chain_ends_cancelled_and_the_other_slot_is_unaffected() -> None:
    eng = engine(2, 2, 3)
    first, second = Request(tuple(PROMPTS[0]), 40), Request(tuple(PROMPTS[2]), 30)
    a, finished, b = cancel_mid_chain(eng, first, second, 14, lambda e: bool(e._chain))
    assert finished == "cancelled"
    assert tuple(a) == alone(PROMPTS[0], 40)[: len(a)]
    assert b == list(alone(PROMPTS[2], 30))
    assert_keeps_what_it_read(eng, 0, tuple(PROMPTS[0]), a)
    assert_keeps_what_it_read(eng, 1, tuple(PROMPTS[2]), b)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.0, logit_bias=((65, 2.0),)),
        SamplingParams(temperature=0.7, presence_penalty=0.5, seed=3),
        SamplingParams(temperature=0.7, top_p=0.9, frequency_penalty=0.2, seed=3),
        SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5),
    ],
    ids=["greedy-with-bias", "presence-penalty", "top-p-with-frequency-penalty", "greedy-penalties"],
)
@pytest.mark.parametrize("stages", [1, 2])
def test_a_slot_with_a_logit_bias_or_penalty_runs_ahead_with_the_text_of_windows_one_at_a_time(
    sampling, stages
) -> None:
    # Its rows are adjusted on the device, which counts the tokens it chooses there.
    texts = []
    for ahead in (1, 3):
        eng = engine(stages, 1, ahead)
        spy = Spy(eng)
        texts.append(collect(eng, [(0, Request(tuple(PROMPTS[0]), 30, sampling=sampling))]))
        assert spy.most_in_flight == ahead and bool(spy.chained) == (ahead > 1)
    assert texts[0] == texts[1]


@pytest.mark.parametrize("stages", [1, 2])
def test_sampling_runs_ahead_and_a_seed_gives_the_same_text_as_windows_one_at_a_time(stages) -> None:
    """The device draws each row (temperature, top-k, top-p) at a uniform the host drew at launch, in window
    order: the same uniforms whether the windows run ahead or not."""
    requests = [
        (0, Request(tuple(PROMPTS[0]), 25, sampling=SamplingParams(temperature=0.9, seed=11))),
        (3, Request(tuple(PROMPTS[2]), 18, sampling=SamplingParams(temperature=1.3, top_p=0.8, seed=12))),
        (0, Request(tuple(PROMPTS[1]), 20)),  # greedy beside them
        (1, Request(tuple(PROMPTS[3]), 22, sampling=SamplingParams(temperature=1.1, top_k=5, seed=13))),
    ]
    base = collect(engine(stages, 4, 1), requests)
    eng = engine(stages, 4, 3)
    spy = Spy(eng)
    assert collect(eng, requests) == base
    assert any(len(job.entries) == 4 for job in spy.chained)
    assert base[2] == list(alone(PROMPTS[1], 20))
    assert base[0] != list(alone(PROMPTS[0], 25))  # sampled, not greedy


@pytest.mark.parametrize("stages", [2, 3])
def test_pipelined_groups_chain_their_windows_and_keep_their_text(stages) -> None:
    """On the simulated GPU of the pipeline tests, each group queues its next decode window behind the one in
    flight (up to run_ahead per group), reading its tokens on the device; the text is the text alone, with
    requests finishing at different lengths and a sampled one among them."""
    from test_rt_pipeline import gated, group_of, in_flight_at

    plan = make_plan(stages=stages, slots=4, groups=2, context=128, prefill_chunk=16)
    eng, ex = gated(plan)
    assert eng.run_ahead == 2
    sampled = SamplingParams(temperature=0.9, seed=4)
    reqs = [
        (0, Request(tuple(PROMPTS[0]), 20)),
        (0, Request(tuple(PROMPTS[1]), 14)),
        (0, Request(tuple(PROMPTS[2]), 25, sampling=sampled)),
        (2, Request(tuple(PROMPTS[3]), 9)),
    ]
    got = collect(eng, reqs, check_kv=False)
    for (_, r), tokens in zip(reqs, got, strict=True):
        if r.sampling.temperature == 0:
            assert tuple(tokens) == alone(bytes(r.prompt_ids), r.max_tokens)
    lockstep, _ = gated(plan)
    lockstep.run_ahead = 1
    assert collect(lockstep, reqs, check_kv=False)[2] == got[2]  # the same draws, one window at a time
    chained = [e for e in ex.log if e.what == "launch" and e.flight.after is not None]
    assert chained and all(e.flight.job.kind == "pipelined" for e in chained)
    most = max(
        max(sum(1 for f in in_flight_at(ex, i) if group_of(eng, f) == g) for g in (0, 1))
        for i in range(len(ex.log))
    )
    assert most == 2  # two windows of one group in flight
    for (_, r), tokens in zip(reqs, got, strict=True):  # each slot keeps what its last request read
        slot = next(
            i for i, k in enumerate(eng.prefixes.kept) if k is not None and k.tokens[:4] == r.prompt_ids[:4]
        )
        assert_keeps_what_it_read(eng, slot, r.prompt_ids, tokens)


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("draft_tokens", [0, 4])
def test_a_think_budget_closes_the_block_where_it_runs_out_while_windows_run_ahead(stages, draft_tokens):
    """Replies whose prompt opened a think block, with budgets of 3 to 11 tokens and no grammar: windows
    (serial, or solo windows drafting and decided on the device) run ahead up to the token a spent budget
    forces and never past it; the host makes that token the block's close, and the reply goes on free. The
    text is the text of windows one at a time, and each reply's close sits at its budget (the models here
    never choose the close themselves)."""
    close = 300  # an id the synthetic vocabulary holds but the model does not favour
    budgets = [3, 7, 11]

    def requests() -> list[tuple[int, Request]]:
        return [
            (at, Request(tuple(PROMPTS[i]), 24, SamplingParams(reasoning=Reasoning(299, close, True, n))))
            for i, (at, n) in enumerate(zip([0, 0, 2], budgets, strict=True))
        ]

    # A fixed drafting depth: the adaptive one weighs the windows' measured times, which a loaded machine
    # can make draft nothing.
    slots = 1 if draft_tokens else 3
    base = collect(engine(stages, slots, 1, draft_tokens, adaptive_depth=False), requests())
    eng = engine(stages, slots, 3, draft_tokens, adaptive_depth=False)
    spy = Spy(eng)
    got = collect(eng, requests())
    assert got == base
    for tokens, n in zip(got, budgets, strict=True):
        assert tokens.index(close) == n and close not in tokens[:n] and len(tokens) == 24
    assert spy.chained  # windows ran ahead
    if draft_tokens:
        assert any(e.proposals.tokens for job in spy.chained for e in job.entries if job.spec_on_device)


@pytest.mark.parametrize(
    ("stages", "ahead", "draft_tokens"),
    [(1, 1, 0), (2, 3, 0), (1, 1, 3), (2, 3, 3)],
    ids=["one-at-a-time", "ahead-2-stages", "drafting", "drafting-ahead-2-stages"],
)
def test_min_p_of_one_leaves_only_the_top_token_in_every_window_mode(stages, ahead, draft_tokens) -> None:
    """Min-p 1 keeps only the tokens as likely as the most likely one: a hot sampled request gives the greedy
    text, whether its tokens are drawn on the device with windows running ahead, one window at a time, or
    drafted and verified by rejection sampling; the same request without min-p does not."""
    hot = SamplingParams(temperature=1.8, top_p=0.99, seed=21)
    pinned = SamplingParams(temperature=1.8, top_p=0.99, seed=21, min_p=1.0)
    requests = [
        (0, Request(tuple(PROMPTS[0]), 24, sampling=pinned)),
        (0, Request(tuple(PROMPTS[1]), 16, sampling=hot)),
    ]
    got = collect(engine(stages, 2, ahead, draft_tokens), requests)
    assert got[0] == list(alone(PROMPTS[0], 24))
    assert got[1] != list(alone(PROMPTS[1], 16))
