"""A failed step, recovered from: `Engine.recover` ends the admitted requests and serves the queue on, and
`Engine.self_check` says whether the model still computes what it computed at start.

Faults are planted where a bug would raise: the host queuing a window (`Executor.launch`), and a stage's
layers while a window runs (`Stage.forward`, whose error the window carries to its finish), in every window
mode, at several points of a run (with windows chained ahead or not).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from rt_engine_helpers import Planted, assert_kv_consistent, collect, mode_plan, plant
from rt_plans import make_plan
from script_loader import load_script

from strata_runtime.api import Recovery, Request, SamplingParams, TokenLogprob
from strata_runtime.backend import Device
from strata_runtime.engine import Engine, check, scheduler
from strata_runtime.structured import json_grammar

PROMPTS = [tuple(range(40 + 7 * i, 58 + 7 * i)) for i in range(5)]
TOKENS = 10


def _engine(mode: str, stages: int, **kw: Any) -> Engine:
    return Engine(mode_plan(mode, stages, preset="tiny", context=128, prefill_chunk=16, **kw))


def _reference_of(request: Request) -> tuple[int, ...]:
    """``request`` alone on one stage, one slot, no drafting."""
    eng = Engine(make_plan(stages=1, preset="tiny", context=128, prefill_chunk=16))
    return tuple(collect(eng, [(0, request)])[0])


@functools.cache
def _reference(prompt: tuple[int, ...], tokens: int = TOKENS) -> tuple[int, ...]:
    """A plain request of ``prompt`` alone (`_reference_of`), once for each."""
    return _reference_of(Request(prompt, tokens))


def _plant(eng: Engine, where: str, at: int) -> list[int]:
    """`plant` in the host's launch or the last stage's layers."""
    return plant(eng.executor if where == "launch" else eng.model.stages[-1], where, at)


def _run_into_fault(eng: Engine, at: int) -> None:
    """Step ``eng`` until the ``at``-th launch from now raises `Planted`, then take the fault out again."""
    _plant(eng, "launch", at)
    with pytest.raises(Planted):
        while eng.step():
            pass
    del eng.executor.launch


def _drain(handle: Any) -> list[Any]:
    events = []
    while not handle.events.empty():
        events.append(handle.events.get_nowait())
    return events


CASES = [
    ("serial", 1, {}),
    ("solo", 1, {}),
    ("pipelined", 2, {}),
    ("batch-mtp", 2, {}),
    ("pipelined-mtp", 2, {}),
    ("serial", 2, {"prefix_store_mib": 4}),
    ("serial", 1, {"expert_cache": 4}),
]


@pytest.mark.parametrize(("mode", "stages", "kw"), CASES, ids=[f"{m}-{n}-{sorted(k)}" for m, n, k in CASES])
@pytest.mark.parametrize("where", ["launch", "forward"])
@pytest.mark.parametrize("at", [4, 9])
def test_a_failed_step_carries_the_held_requests_on_and_every_request_gets_its_text_alone(
    mode, stages, kw, where, at
):
    """The requests the failed step held are carried on (each reads its prompt and the tokens it was sent
    again, from a KV the recovery emptied) and the queued ones are served after them: each gets the text
    it gets alone, every token once, and ends by its length."""
    eng = _engine(mode, stages, **kw)
    slots = eng.n_slots
    assert eng.self_check() is None
    handles = [eng.submit(Request(p, TOKENS)) for p in PROMPTS[: slots + 2]]  # two wait for a slot
    calls = _plant(eng, where, at)
    with pytest.raises(Planted):
        for _ in range(1000):
            eng.step()
    held = [h for h in handles if h.slot is not None and eng.slots[h.slot] is not None]
    held = [h for h in held if eng.slots[h.slot].handle is h and not eng.slots[h.slot].told]
    assert held, "the fault came while requests were being served"
    sent = sum(eng.slots[h.slot].told_tokens for h in held)
    delattr(eng.model.stages[-1] if where == "forward" else eng.executor, where)

    assert eng.recover(Planted(f"planted in {where}")) == Recovery(resumed=len(held), ended=0)
    assert eng.in_flight == 0 and all(s is None for s in eng.slots)
    assert_kv_consistent(eng)  # every slot is empty: nothing it held is reused
    assert eng.self_check() is None, "the model is as it was"
    assert all(h.events.empty() or _last(h).finished is None for h in held)

    while eng.step():
        assert_kv_consistent(eng)
    for h, prompt in zip(handles, PROMPTS, strict=False):
        events = _drain(h)
        assert [ev.finished for ev in events if ev.finished] == ["length"] and not any(
            ev.error for ev in events
        )
        assert tuple(t for ev in events for t in ev.token_ids) == _reference(prompt)
    if at == 9:
        assert sent > 0, "some carried on had tokens sent before the fault"
    # Requests after the recovery, several at once, each get their text alone.
    after = [(i, Request(p, TOKENS)) for i, p in enumerate(PROMPTS)]
    assert [tuple(t) for t in collect(eng, after)] == [_reference(p) for p in PROMPTS]
    assert calls[0] >= at  # the planted fault fired (windows in flight may have run on)


def _last(handle: Any) -> Any:
    """The newest event in ``handle``'s queue, left there."""
    return handle.events.queue[-1]


@pytest.mark.parametrize(("mode", "stages"), [("serial", 1), ("solo", 1), ("pipelined", 2), ("batch-mtp", 2)])
def test_wherever_the_fault_comes_every_request_gets_its_text_once(mode, stages):
    """A fault at each of a run's launches in turn: among them those right after a window that finished a
    request or gave a token, before its events were delivered (the recovery delivers them). Every request
    gets the text it gets alone, every token once, and ends once, by its length."""
    for at in range(1, 40):
        eng = _engine(mode, stages)
        handles = [eng.submit(Request(p, n)) for p, n in zip(PROMPTS, (3, 9, 2, 12, 5), strict=True)]
        calls = _plant(eng, "launch", at)
        try:
            while eng.step():
                pass
        except Planted as exc:
            assert eng.recover(exc).ended == 0
            while eng.step():
                pass
        for h, prompt in zip(handles, PROMPTS, strict=True):
            events = _drain(h)
            assert [ev.finished for ev in events if ev.finished] == ["length"], (at, events)
            assert tuple(t for ev in events for t in ev.token_ids) == _reference(prompt, h.request.max_tokens)
            assert "".join(ev.text for ev in events) == eng.tokenizer.decode(
                _reference(prompt, h.request.max_tokens)
            )
        if calls[0] < at:
            return  # the run ended before the fault's call: every later one would too
    raise AssertionError("the runs always reached the fault")


def test_a_request_held_by_a_second_failed_step_is_ended_and_the_others_carried_on():
    """A request carried through one recovery and held when a step fails again may be what fails: it is
    ended with the error. A request admitted after the first failure is carried on through the second, to
    the text it gets alone."""
    eng = _engine("serial", 1)
    early = [eng.submit(Request(p, TOKENS)) for p in PROMPTS[: eng.n_slots - 1]]
    _run_into_fault(eng, 3)
    assert eng.recover(Planted("the first")) == Recovery(resumed=len(early), ended=0)
    late = eng.submit(Request(PROMPTS[-1], TOKENS))
    eng.step()  # the carried-on requests take their slots back, before the queued one
    states = [eng.stats()["slots"][h.slot] for h in early]
    assert [s["restarts"] for s in states] == [1] * len(early)
    assert "reread" in {s["state"] for s in states}  # (one that was reading its prompt: "prefill")
    _run_into_fault(eng, 3)
    assert late.slot is not None and all(eng.slots[h.slot].handle is h for h in (*early, late))
    assert eng.recover(Planted("the second")) == Recovery(resumed=1, ended=len(early))
    while eng.step():
        pass
    assert tuple(t for ev in _drain(late) for t in ev.token_ids) == _reference(PROMPTS[-1])
    for h in early:
        last = _drain(h)[-1]
        assert last.finished == "error" and "the second" in last.error
        assert "carried on through an earlier failed step and decoded " in last.error
        assert f" of {scheduler.RESTART_FORGOTTEN} tokens since, so it may be what makes" in last.error


def test_a_request_that_served_on_after_a_recovery_is_carried_through_a_later_one(monkeypatch):
    """A recovery counts against a request only until it decodes `RESTART_FORGOTTEN` tokens after it: a
    later failure, once both requests have, carries them on again, each to its text alone. One that fails
    again sooner is ended (the test before)."""
    monkeypatch.setattr(scheduler, "RESTART_FORGOTTEN", 4)
    tokens = 24
    eng = _engine("serial", 1)
    handles = [eng.submit(Request(p, tokens)) for p in PROMPTS[:2]]
    _run_into_fault(eng, 6)
    assert eng.recover(Planted("the first")) == Recovery(resumed=2, ended=0)
    restarted = [s.restarted_at for s in eng._restarting]

    def since(i: int) -> int:
        slot = eng.slots[handles[i].slot] if handles[i].slot is not None else None
        return -1 if slot is None or slot.handle is not handles[i] else len(slot.generated) - restarted[i]

    while min(since(0), since(1)) < 4:
        assert eng.step()
    assert max(since(0), since(1)) < tokens - max(restarted)  # neither has ended
    _run_into_fault(eng, 1)
    assert eng.recover(Planted("the second")) == Recovery(resumed=2, ended=0)
    assert [s.restarts for s in eng._restarting] == [2, 2]
    for h, prompt in zip(handles, PROMPTS, strict=False):
        events = _drain_all(eng, h)
        assert events[-1].finished == "length"
        assert tuple(t for ev in events for t in ev.token_ids) == _reference(prompt, tokens)


@pytest.mark.parametrize(("mode", "stages"), [("serial", 1), ("pipelined", 2), ("batch-mtp", 2)])
def test_replies_with_penalties_a_grammar_and_stop_strings_are_carried_on_to_their_text_alone(mode, stages):
    """What a reply's next tokens follow besides the KV goes on from the tokens sent: its penalties' counts
    (the device's start afresh from the host's), its place in a grammar and its stop strings' search. Each
    greedy reply carried through a failed step is the one it gets alone, ending where it ends alone."""
    eng = _engine(mode, stages)
    penalised = SamplingParams(presence_penalty=0.8, frequency_penalty=1.5, logit_bias=((ord("e"), 3.0),))
    person = json_grammar(
        {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    )
    requests = [
        Request(PROMPTS[0], 24, penalised),
        Request(PROMPTS[1], 40, SamplingParams(grammar=person)),
        Request(PROMPTS[2], 24),
    ]
    alone = [_reference_of(r) for r in requests]
    stop = eng.tokenizer.decode(list(alone[2][8:10]))  # met after a few tokens sent
    requests[2] = Request(PROMPTS[2], 24, stop_strings=(stop,))
    alone[2] = _reference_of(requests[2])
    for at in (5, 8):
        handles = [eng.submit(r) for r in requests]
        _run_into_fault(eng, at)
        assert eng.recover(Planted("planted")).ended == 0
        while eng.step():
            pass
        for h, tokens in zip(handles, alone, strict=True):
            events = _drain(h)
            assert tuple(t for ev in events for t in ev.token_ids) == tokens, (at, h.request)
            assert events[-1].finished in ("stop", "length") and not any(ev.error for ev in events)
    assert len(alone[2]) < 24  # the stop string ends it early


@pytest.mark.parametrize(("mode", "stages"), [("serial", 1), ("pipelined", 2)])
@pytest.mark.parametrize("where", ["launch", "forward"])
def test_seeded_sampled_replies_carried_on_draw_what_they_draw_without_the_failure(mode, stages, where):
    """The windows queued ahead of a failure drew numbers from each request's generator; a reply carried on
    draws from where its kept tokens left it (`Sampler.take_back`), so a seeded reply is the one the same
    engine gives without the failure. (Where windows draft, which of them carry proposals after the
    failure can differ from the run without it, and with them the numbers a token is drawn with.)"""
    sampled = [SamplingParams(temperature=0.9, top_k=40, seed=7 + i) for i in range(3)]
    requests = [Request(p, 16, params) for p, params in zip(PROMPTS, sampled, strict=False)]
    requests = requests[: _engine(mode, stages).n_slots]
    sound = _engine(mode, stages)
    without = [
        [t for ev in _drain_all(sound, h) for t in ev.token_ids] for h in [sound.submit(r) for r in requests]
    ]
    for at in (4, 7):
        eng = _engine(mode, stages)
        handles = [eng.submit(r) for r in requests]
        _plant(eng, where, at)
        with pytest.raises(Planted):
            while eng.step():
                pass
        delattr(eng.model.stages[-1] if where == "forward" else eng.executor, where)
        assert eng.recover(Planted("planted")).ended == 0
        while eng.step():
            pass
        assert [[t for ev in _drain(h) for t in ev.token_ids] for h in handles] == without, at


def _drain_all(eng: Engine, handle: Any) -> list[Any]:
    """Step ``eng`` until it is idle, then `_drain` ``handle``."""
    while eng.step():
        pass
    return _drain(handle)


def test_with_more_restarts_allowed_a_request_failing_again_while_it_reads_again_keeps_its_text(monkeypatch):
    """Where `RESTARTS_MOST` carries a request through two failures, the second coming while it reads its
    tokens again (its re-read chunk's launch fails): it reads them once more, from the start, and gets its
    text alone, every token once."""
    monkeypatch.setattr(scheduler, "RESTARTS_MOST", 2)
    eng = _engine("serial", 1)
    handles = [eng.submit(Request(p, TOKENS)) for p in PROMPTS[:2]]
    _run_into_fault(eng, 9)
    assert eng.recover(Planted("the first")) == Recovery(resumed=2, ended=0)
    assert all(s.resume for s in eng._restarting), "each was given tokens before the fault"
    _run_into_fault(eng, 1)  # the first re-read chunk
    assert eng.recover(Planted("the second")) == Recovery(resumed=2, ended=0)
    while eng.step():
        assert_kv_consistent(eng)
    for h, prompt in zip(handles, PROMPTS, strict=False):
        assert tuple(t for ev in _drain(h) for t in ev.token_ids) == _reference(prompt)


def test_tokens_decided_but_not_sent_are_sent_on_unless_they_need_their_log_probabilities():
    """A fault inside a window's deciding, after two of its three slots were decided: the one whose request
    does not ask for log-probabilities gets its decided tokens in one event and is carried on; the one that
    asks is ended with the error (its log-probabilities are gone with the window); the undecided one is
    carried on. Those carried on get the text they get alone."""
    eng = _engine("serial", 1)
    a = eng.submit(Request(PROMPTS[0], TOKENS))
    b = eng.submit(Request(PROMPTS[1], TOKENS, SamplingParams(logprobs=1)))
    c = eng.submit(Request(PROMPTS[2], TOKENS))
    while not all(h.completion_tokens >= 2 for h in (a, b, c)):
        eng.step()
    decide = eng.executor._decide
    decided: dict[int, list[Any]] = {}

    def failing(flight: Any, e: Any, row: int, logit_row: Any) -> Any:
        done = decided.setdefault(id(flight), [])
        if a in done and b in done and e.slot.handle is c:
            raise Planted("planted in deciding")
        done.append(e.slot.handle)
        return decide(flight, e, row, logit_row)

    eng.executor._decide = failing  # type: ignore[method-assign]
    with pytest.raises(Planted):
        while eng.step():
            pass
    del eng.executor._decide
    untold = {id(h): eng.slots[h.slot].untold()[0] for h in (a, b, c)}
    assert untold[id(a)] and untold[id(b)] and not untold[id(c)]
    assert eng.recover(Planted("planted in deciding")) == Recovery(resumed=2, ended=1)
    while eng.step():
        pass
    for h, prompt in ((a, PROMPTS[0]), (c, PROMPTS[2])):
        events = _drain(h)
        assert events[-1].finished == "length"
        assert tuple(t for ev in events for t in ev.token_ids) == _reference(prompt)
    events = _drain(b)
    assert events[-1].finished == "error" and "planted in deciding" in events[-1].error
    assert "tokens decided for it in the failed window could not be sent as they were" in events[-1].error
    sent = [t for ev in events for t in ev.token_ids]
    assert sent == list(_reference(PROMPTS[1])[: len(sent)])  # what it was sent before stands
    assert all(len(ev.logprobs) == len(ev.token_ids) for ev in events)


def test_after_recovering_no_slot_lends_what_it_kept_for_prefix_reuse():
    """A window that failed part-way may have written any slot's KV: a request that begins as an earlier one
    did reads its whole prompt again, and gets its text."""
    eng = _engine("serial", 1)
    prompt = PROMPTS[1]
    collect(eng, [(0, Request(prompt, TOKENS))])
    keeper = next(i for i, k in enumerate(eng.prefixes.kept) if k is not None)
    other = eng.submit(Request(PROMPTS[3], TOKENS))
    eng.step()
    assert other.slot != keeper, "the other request leaves the kept prompt where it is"
    _plant(eng, "launch", 1)
    with pytest.raises(Planted):
        eng.step()
    del eng.executor.launch
    eng.recover(Planted("planted"))
    assert all(k is None for k in eng.prefixes.kept)
    handle = eng.submit(Request(prompt, TOKENS))
    while eng.step():
        assert_kv_consistent(eng)
    assert handle.cached_tokens == 0
    assert tuple(t for ev in _drain(handle) for t in ev.token_ids) == _reference(prompt)


def test_after_recovering_the_prefix_store_lends_nothing():
    """The store's pages are copied from slots on the stages' streams, which a failed window may have left
    part-way: a conversation stored before the fault is read again whole."""
    eng = Engine(make_plan(stages=1, preset="tiny", context=128, prefill_chunk=16, prefix_store_mib=4))
    prompt = tuple(range(30, 110))  # long enough to be worth storing
    collect(eng, [(0, Request(prompt, TOKENS))])
    eng.submit(Request(PROMPTS[3], TOKENS))  # takes the one slot: the first prompt goes to the store
    eng.step()
    assert eng.store.best(prompt, (None, ""))[1] >= len(prompt) - 1
    _run_into_fault(eng, 1)
    eng.recover(Planted("planted"))
    assert not eng.store.entries
    handle = eng.submit(Request(prompt, TOKENS))
    while eng.step():
        assert_kv_consistent(eng)
    assert handle.cached_tokens == 0
    assert tuple(t for ev in _drain(handle) for t in ev.token_ids) == _reference(prompt)


def test_a_device_that_reports_an_error_ends_recovery(monkeypatch):
    """Where a device still holds a kernel's fault, nothing more can run there: `recover` raises it, and
    leaves the requests as they were."""
    eng = _engine("serial", 1)
    handle = eng.submit(Request(PROMPTS[0], TOKENS))
    eng.step()

    def faulted(self: Device) -> None:
        raise RuntimeError(f"{self}: an illegal memory access was encountered")

    monkeypatch.setattr(Device, "wait_idle", faulted)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        eng.recover(Planted("planted"))
    assert eng.slots[handle.slot] is not None and not any(ev.finished for ev in _drain(handle))


@pytest.mark.parametrize(("mode", "stages"), [("serial", 1), ("batch-mtp", 2), ("pipelined", 2)])
def test_the_self_check_finds_a_changed_model_and_agrees_again_once_it_is_restored(mode, stages):
    eng = _engine(mode, stages)
    assert eng.self_check() is None
    assert eng.self_check() is None
    norm = eng.model.stages[-1].norm
    saved = norm.copy()
    norm *= 1.5  # the final norm's weight, as a broken weight would be
    problem = eng.self_check()
    assert problem is not None and "position" in problem and "at start" in problem
    norm[...] = saved
    assert eng.self_check() is None


def test_the_self_check_finds_a_broken_expert_in_nearly_every_place():
    """One routed expert's down projection scaled by 4, in each of the tiny preset's 32 places (4 layers of
    8) in turn: the check departs from its first reading in all but at most one (an expert its 67 tokens
    route to little; with 16 prompt tokens it missed three)."""
    eng = _engine("serial", 1)
    assert eng.self_check() is None
    store = eng.model.stages[0].experts
    missed = []
    for j in range(len(store.layer_down)):
        for e in range(len(store.layer_down[j])):
            down = store.weights(j, e)[1]
            saved = down.copy()
            down *= 4.0
            if eng.self_check() is None:
                missed.append((j, e))
            down[...] = saved
    assert len(missed) <= 1, missed
    assert eng.self_check() is None


def test_the_self_check_leaves_no_trace_and_queued_requests_wait_for_it():
    eng = _engine("batch-mtp", 2)
    collect(eng, [(0, Request(PROMPTS[0], TOKENS)), (1, Request(PROMPTS[1], TOKENS))])

    def learned() -> dict[str, Any]:
        return {kind: (h.chance, h.reached) for kind, h in eng.drafting_state().items()}

    totals, holds, kept = dict(eng.totals), learned(), list(eng.prefixes.kept)
    assert holds and any(reached for _, reached in holds.values())
    queued = eng.submit(Request(PROMPTS[2], TOKENS))
    assert eng.self_check() is None
    assert queued.slot is None and queued.events.empty(), "a queued request waits while the check runs"
    assert dict(eng.totals) == totals and learned() == holds and eng.prefixes.kept == kept
    while eng.step():
        pass
    assert tuple(t for ev in _drain(queued) for t in ev.token_ids) == _reference(PROMPTS[2])


def test_a_request_arriving_while_the_self_check_runs_waits_for_it_and_for_those_carried_on():
    """The server's threads submit while the engine thread runs the self-check after a recovery: a request
    that arrives then is not admitted until the check is done, and the requests carried on take their own
    slots back before it; each gets its text alone."""
    eng = _engine("serial", 1)
    assert eng.self_check() is None
    handles = [eng.submit(Request(p, TOKENS)) for p in PROMPTS[: eng.n_slots]]
    _run_into_fault(eng, 6)
    assert eng.recover(Planted("planted")).resumed == eng.n_slots
    launch, arrived = eng.executor.launch, []

    def arriving(job: Any, after: Any = None) -> Any:
        if not arrived:  # the check's first window: a request comes in meanwhile
            arrived.append(eng.submit(Request(PROMPTS[-1], TOKENS)))
        return launch(job, after)

    eng.executor.launch = arriving  # type: ignore[method-assign]
    assert eng.self_check() is None
    del eng.executor.launch
    (late,) = arrived
    assert late.slot is None and late.events.empty()
    while eng.step():
        assert_kv_consistent(eng)
    for h, prompt in zip((*handles, late), (*PROMPTS[: eng.n_slots], PROMPTS[-1]), strict=True):
        assert tuple(t for ev in _drain(h) for t in ev.token_ids) == _reference(prompt)


def test_the_recovery_bench_measures_a_pause_after_which_every_reply_is_as_without_the_failure():
    """`scripts/bench_recovery.py` on a two-stage pipelined plan: the requests carried on get their next
    tokens after the recovery and the self-check, and their replies are those of a run without the fault."""
    bench = load_script("bench_recovery")
    eng = _engine("pipelined", 2)
    assert eng.self_check() is None
    without = bench.replies(eng, [eng.submit(r) for r in bench.requests(eng, 12 + bench.AFTER)])
    eng.forget_prefixes()
    got = bench.pause(eng, 12)
    assert got["recovery"] == Recovery(resumed=eng.n_slots, ended=0)
    assert got["tokens"] == without and all(len(t) == 12 + bench.AFTER for t in without)
    assert 0 < got["check_ms"] < got["pause_ms"] and got["resume_ms"] > 0


def _reading(*positions: tuple[int, float, tuple[tuple[int, float], ...]]) -> check.Reading:
    return check.Reading(tuple(TokenLogprob(t, lp, top) for t, lp, top in positions))


P1 = (5, -1.0, ((5, -1.0), (9, -2.0)))
P2 = (7, -0.5, ((7, -0.5), (3, -0.55)))
P3 = (2, -3.0, ())
START = _reading(P1, P2, P3)


@pytest.mark.parametrize(
    ("now", "found"),
    [
        (START, None),
        (_reading((5, -1.05, ((5, -1.05), (9, -1.95))), P2, P3), None),
        (_reading((5, -1.2, ((5, -1.2), (9, -2.0))), P2, P3), "position 1: token 5's"),
        (_reading((5, float("nan"), ((5, -1.0), (9, -2.0))), P2, P3), "position 1: token 5's"),
        (_reading((5, -1.0, ((5, -1.0), (9, -2.5))), P2, P3), "position 1: alternative 9's"),
        # the reply parts at a near tie (3 was within 0.1 of 7): nothing after it is compared
        (_reading(P1, (3, -0.5, ((3, -0.5), (7, -0.55))), (8, -9.0, ())), None),
        # ... but not where the token taken was rated far below the one chosen at start
        (_reading(P1, (4, -0.5, ((4, -0.5), (7, -0.55))), P3), "position 2: it chose"),
        (_reading(P1, P2), "it gave 2 log-probabilities, against 3"),
    ],
)
def test_a_reading_departs_from_the_first_by_more_than_the_tolerance(now, found):
    problem = check.disagreement(START, now)
    assert problem == found if found is None else (problem is not None and problem.startswith(found)), problem


def test_the_probe_fits_any_context_and_vocabulary():
    for vocab, context in [(300, 128), (151_936, 8192), (5, 24), (2, 8)]:
        r = check.probe_request(vocab, context)
        assert len(r.prompt_ids) + r.max_tokens + 1 <= context
        assert all(0 < t < vocab for t in r.prompt_ids)
        assert r.sampling.temperature == 0 and r.ignore_eos
