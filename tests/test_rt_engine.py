"""The engine executes plans: every mode gives the same greedy text, slots stay apart, KV rolls back.

Property tests run random staggered arrival schedules through solo, serial, pipelined and batch-MTP plans on
1 to 4 virtual CPU stages, and compare each request's greedy tokens with the same request run alone on one
stage without drafting. The lifecycle test follows slots through admission, solo promotion and demotion,
a cancellation mid-run and reuse, and 8 slots through 4-slot batch-MTP windows (on the packaged demo model,
whose drafts are accepted because its MTP head was trained).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rt_engine_helpers import MODES, assert_keeps_what_it_read, collect, mode_plan
from rt_plans import make_plan

from strata_cfg.schema.packaged import packaged_dir
from strata_cfg.schema.plan import LaunchPlan
from strata_runtime.api import PlanMismatch, Reasoning, Request, SamplingParams
from strata_runtime.engine import Engine

PRESET_FOR_STAGES = {1: "tiny", 2: "tiny", 3: "tiny", 4: "small"}


@functools.cache
def engine(stages: int, mode: str) -> Engine:
    return Engine(mode_plan(mode, stages, preset=PRESET_FOR_STAGES[stages], context=128, prefill_chunk=16))


def model_source(name: str) -> dict[str, object]:
    """``make_plan`` keywords for a synthetic preset, or for the packaged demo model ``austen``."""
    return {"model_dir": packaged_dir(name)} if name == "austen" else {"preset": name}


@functools.cache
def reference(model: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """The request alone: one stage, one slot, no drafting."""
    eng = _reference_engine(model)
    return tuple(collect(eng, [(0, Request(prompt, max_tokens))])[0])


@functools.cache
def _reference_engine(model: str) -> Engine:
    return Engine(make_plan(stages=1, context=128, prefill_chunk=16, **model_source(model)))


arrivals = st.lists(
    st.tuples(
        st.integers(0, 12),  # arrival step
        st.lists(st.integers(32, 126), min_size=1, max_size=24),  # prompt (printable bytes)
        st.integers(1, 14),  # max tokens
    ),
    min_size=1,
    max_size=5,
)


@pytest.mark.parametrize(
    ("stages", "mode"), [(n, m) for n in (1, 2, 3, 4) for m in MODES if n > 1 or m != "pipelined-mtp"]
)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=arrivals)
def test_greedy_text_is_the_same_in_every_mode_and_slots_stay_apart(stages, mode, schedule) -> None:
    eng = engine(stages, mode)
    preset = PRESET_FOR_STAGES[stages]
    reqs = [(at, Request(tuple(p), n, request_id=f"r{i}")) for i, (at, p, n) in enumerate(schedule)]
    got = collect(eng, reqs)
    for (_, req), tokens in zip(reqs, got, strict=True):
        # Equal to the request run alone: no slot saw another slot's tokens, and drafting changed nothing.
        assert tuple(tokens) == reference(preset, req.prompt_ids, req.max_tokens)


@functools.cache
def small_context_engine(stages: int, mode: str, context: int) -> Engine:
    return Engine(mode_plan(mode, stages, preset="tiny", context=context, prefill_chunk=16))


filling = st.lists(
    st.tuples(st.integers(0, 8), st.lists(st.integers(32, 126), min_size=1, max_size=20)),
    min_size=1,
    max_size=3,
)


@pytest.mark.parametrize(
    ("stages", "mode"), [(n, m) for n in (1, 2) for m in MODES if n > 1 or m != "pipelined-mtp"]
)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=filling, context=st.sampled_from([40, 58, 66]))
def test_requests_that_fill_the_context_end_by_length_with_the_text_they_get_alone(
    stages, mode, schedule, context
) -> None:
    """Every request runs until its context is full, so windows (drafting ones too) reach the last position:
    each ends by length, holding as many tokens as the context leaves, the same as the request run alone."""
    eng = small_context_engine(stages, mode, context)
    reqs = [(at, Request(tuple(p), 500)) for at, p in schedule]
    got = collect(eng, reqs)
    for (_, req), tokens in zip(reqs, got, strict=True):
        room = context - len(req.prompt_ids) + 1
        assert tuple(tokens) == reference("tiny", req.prompt_ids, room)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_drafters_live_only_on_the_last_stage(stages) -> None:
    eng = engine(stages, "batch-mtp")
    last = eng.model.stages[-1].device
    assert sorted(eng.model.drafters) == list(range(eng.n_slots))
    assert all(d.device == last for d in eng.model.drafters.values())
    assert all(not s.drafters for s in eng.plan.stages[:-1])
    assert "drafters: slots [0, 1, 2, 3] on cpu:" + str(last.index) in eng.startup[-1]


@pytest.mark.parametrize("mode", ["solo", "serial", "batch-mtp"])
def test_seeded_sampling_is_reproducible(mode) -> None:
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    req = Request(tuple(b"Sampled text"), 16, sampling)
    other = Request(tuple(b"Another one"), 10, SamplingParams(temperature=1.0, seed=7))
    first = collect(engine(2, mode), [(0, req), (2, other)])
    again = collect(engine(2, mode), [(0, req), (2, other)])
    assert first == again
    differently = collect(
        engine(2, mode), [(0, Request(req.prompt_ids, 16, SamplingParams(0.9, 0.95, 50, 99)))]
    )
    assert differently[0] != first[0]


def test_lifecycle_promotion_demotion_cancellation_and_reuse() -> None:
    # The fixed rules (batch MTP by the floor alone), whose windows this test follows one by one.
    plan = make_plan(
        stages=2, slots=2, batch_mtp=True, draft_tokens=4, context=128, prefill_chunk=8, adaptive_depth=False
    )
    eng = Engine(plan)
    a = eng.submit(Request(tuple(b"First request"), 60))
    for _ in range(6):
        eng.step()
    kinds = [w.kind for w in eng.windows]
    assert kinds[:2] == ["prefill", "prefill"] and kinds[-1] == "solo"  # promoted: alone, full depth
    assert max(w.rows for w in eng.windows if w.kind == "solo") == 4  # token + 3 proposals

    b = eng.submit(Request(tuple(b"Second, a newcomer with a longer prompt"), 6))
    mark = len(eng.windows)
    while eng.slots[1] is not None or b.events.empty():
        eng.step()
    during = [w for w in list(eng.windows)[mark:]]
    assert "prefill" in [w.kind for w in during]
    # Demoted while the newcomer is in, once the solo windows already in flight when it arrived (at most
    # run_ahead of them, running ahead) are finished.
    ahead = next(i for i, w in enumerate(during) if w.kind != "solo")
    assert ahead <= eng.run_ahead
    assert "solo" not in [w.kind for w in during[ahead:-1]]
    assert any(w.kind == "batch-mtp" and sorted(w.slots) == [0, 1] and w.rows == 4 for w in during)
    # interleaved: a decode window of slot 0 runs between the newcomer's prefill chunks
    first_pf = next(i for i, w in enumerate(during) if w.kind == "prefill")
    assert during[first_pf + 1].kind != "prefill"

    mark = len(eng.windows)
    for _ in range(eng.run_ahead + 1):
        eng.step()
    after = [w.kind for w in list(eng.windows)[mark:]]
    # Promoted again, once the batch-MTP windows in flight when the newcomer ended are finished.
    assert after[-2:] == ["solo", "solo"] and set(after) <= {"batch-mtp", "solo"}

    a.cancel()
    for _ in range(eng.run_ahead + 1):  # the windows already in flight finish first
        eng.step()
    events = []
    while not a.events.empty():
        events.append(a.events.get())
    assert events[-1].finished == "cancelled"
    assert eng.slots == [None, None]
    assert_keeps_what_it_read(eng, 0, a.request.prompt_ids, [t for ev in events for t in ev.token_ids])

    c = Request(tuple(b"Reusing the freed slot"), 12)
    assert tuple(collect(eng, [(0, c)])[0]) == reference("tiny", c.prompt_ids, 12)


def _austen_batch_mtp_plan(**kw: Any) -> LaunchPlan:
    """Eight batch-MTP slots on two stages of the demo model (``kw``: more `make_plan` keywords)."""
    return make_plan(
        stages=2,
        slots=8,
        batch_mtp=True,
        draft_tokens=2,
        context=128,
        prefill_chunk=32,
        **kw,
        **model_source("austen"),
    )


def test_eight_slots_rotate_through_four_slot_batch_mtp_windows_when_experts_stream() -> None:
    """On the demo model, whose trained drafter makes the proposals hold for a reason; 12 of each stage's
    16 experts in VRAM, so the windows keep rotating with every slot decoding."""
    plan = _austen_batch_mtp_plan(expert_cache=12)
    assert not any(g.all_experts_resident for g in plan.gpus)
    eng = Engine(plan)
    reqs = [(0, Request(tuple(f"She said to her sister {i} that".encode()), 30)) for i in range(8)]
    got = collect(eng, reqs)
    for (_, r), tokens in zip(reqs, got, strict=True):
        assert tuple(tokens) == reference("austen", r.prompt_ids, 30)
    windows = list(eng.windows)
    batch = [w for w in windows if w.kind == "batch-mtp"]
    assert batch and all(w.rows <= 8 and len(w.slots) <= 4 for w in batch)
    assert all(w.rows == 2 * len(w.slots) for w in batch)  # token + proposal per slot
    last_prefill = max(i for i, w in enumerate(windows) if w.kind == "prefill")
    after = [w for w in windows[last_prefill + 1 :] if w.kind == "batch-mtp"]
    for w1, w2 in zip(after[:6:2], after[1:6:2], strict=True):  # all 8 decoding: two windows serve each slot
        assert sorted(w1.slots + w2.slots) == list(range(8))
    assert sum(w.accepted for w in batch) > 0.5 * sum(w.proposals for w in batch)


def test_with_every_expert_resident_more_slots_than_a_batch_mtp_window_take_serial_windows() -> None:
    """Every expert in VRAM: while more slots decode than one batch-MTP window holds (4), the decode windows
    are serial (a row per slot, all slots at once); once few enough are left, batch-MTP windows again.
    The text is each request's alone either way."""
    plan = _austen_batch_mtp_plan(adaptive_depth=False)  # batch MTP by the floor alone, as it counts on
    assert all(g.all_experts_resident for g in plan.gpus)
    eng = Engine(plan)
    # Four requests end early, so the engine goes from eight decoding slots to four.
    reqs = [
        (0, Request(tuple(f"She said to her sister {i} that".encode()), 8 if i % 2 else 30)) for i in range(8)
    ]
    got = collect(eng, reqs)
    for (_, r), tokens in zip(reqs, got, strict=True):
        assert tuple(tokens) == reference("austen", r.prompt_ids, r.max_tokens)
    decode = [w for w in eng.windows if w.kind != "prefill"]
    serial = [w for w in decode if w.kind == "serial"]
    batch = [w for w in decode if w.kind == "batch-mtp"]
    assert serial and all(len(w.slots) > 4 and w.rows == len(w.slots) for w in serial)
    assert batch and all(len(w.slots) <= 4 and w.rows == 2 * len(w.slots) for w in batch)
    last_serial = max(i for i, w in enumerate(decode) if w.kind == "serial")
    assert decode[last_serial + 1].kind == "batch-mtp"  # four left: batch MTP takes over
    assert "more: serial windows (every expert is resident)" in eng.startup[3]


def test_stop_token_and_max_tokens_end_a_request() -> None:
    eng = engine(1, "serial")
    prompt = tuple(b"Stop here")
    ref = reference("tiny", prompt, 8)
    stop = ref[3]
    h = eng.submit(Request(prompt, 8, stop_ids=(stop,)))
    while eng.step():
        pass
    evs = [h.events.get() for _ in range(h.events.qsize())]
    toks = [t for e in evs for t in e.token_ids]
    assert toks == list(ref[: ref.index(stop)]) and evs[-1].finished == "stop"
    h = eng.submit(Request(prompt, 5))
    while eng.step():
        pass
    evs = [h.events.get() for _ in range(h.events.qsize())]
    assert [t for e in evs for t in e.token_ids] == list(ref[:5]) and evs[-1].finished == "length"


@pytest.mark.parametrize(("update", "needle"), [({"remote_opt": True}, "remote expert optimisation")])
def test_plans_needing_unimplemented_features_are_refused_at_start(update, needle) -> None:
    plan = make_plan(stages=2)
    plan = plan.model_copy(update={"experts": plan.experts.model_copy(update=update)})
    with pytest.raises(PlanMismatch, match=needle):
        Engine(plan)


def test_batch_mtp_inside_pipelined_groups_runs_token_and_proposal_rows_per_group() -> None:
    eng = engine(2, "pipelined-mtp")
    reqs = [(i, Request(tuple(f"request {i} in its group".encode()), 20)) for i in range(4)]
    got = collect(eng, reqs)
    for (_, r), tokens in zip(reqs, got, strict=True):
        assert tuple(tokens) == reference("tiny", r.prompt_ids, 20)
    windows = [w for w in eng.windows if w.kind == "pipelined-mtp"]
    assert windows and all(w.rows == 2 * len(w.slots) for w in windows)  # token + proposal per slot
    assert all(len({s % 2 for s in w.slots}) == 1 for w in windows)  # one group's slots per window
    assert {s for w in windows for s in w.slots} == {0, 1, 2, 3}
    assert sum(w.accepted for w in windows) > 0


def _window_kinds_and_rows(eng: Engine, prompts: list[bytes], max_tokens: int) -> list[tuple[str, int]]:
    collect(eng, [(0, Request(tuple(p), max_tokens)) for p in prompts])
    return [(w.kind, w.rows) for w in eng.windows if w.kind != "prefill"]


def test_the_solo_draft_depth_is_the_plans_solo_rows() -> None:
    """The engine drafts what ``windows.solo_rows`` says, not what it would work out from the spec."""
    plan = make_plan(stages=2, draft_tokens=6, context=128, prefill_chunk=16)
    assert plan.windows.solo_rows == 6
    narrower = plan.model_copy(update={"windows": plan.windows.model_copy(update={"solo_rows": 3})})
    for p, rows in ((plan, 6), (narrower, 3)):
        windows = _window_kinds_and_rows(Engine(p), [b"Once upon"], 24)
        assert {k for k, _ in windows} == {"solo"} and max(r for _, r in windows) == rows


def test_the_round_is_chosen_by_the_plans_batch_mode() -> None:
    """Pipelined rounds run when ``batch.mode`` says so, not when ``groups`` alone is above one."""
    plan = make_plan(stages=2, slots=4, groups=2, context=128, prefill_chunk=16)
    assert plan.batch.mode == "pipelined"
    serial = plan.model_copy(update={"batch": plan.batch.model_copy(update={"mode": "serial"})})
    prompts = [b"Once upon", b"Hello there"]
    pipelined_kinds = {k for k, _ in _window_kinds_and_rows(Engine(plan), prompts, 8)}
    serial_kinds = {k for k, _ in _window_kinds_and_rows(Engine(serial), prompts, 8)}
    assert "pipelined" in pipelined_kinds and "serial" not in pipelined_kinds
    assert "serial" in serial_kinds and "pipelined" not in serial_kinds


def test_bad_requests_get_an_error_event_naming_the_field() -> None:
    eng = engine(1, "serial")
    h = eng.submit(Request((), 4))
    assert "prompt_ids" in h.events.get().error
    h = eng.submit(Request((1, 2, 10_000), 4))
    assert "prompt_ids: every id must be in [0, 384)" in h.events.get().error
    h = eng.submit(Request(tuple(range(1, 200)), 4))
    assert "does not fit the context of 128" in h.events.get().error


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (SamplingParams(temperature=1.0, seed=-1), "seed"),
        (SamplingParams(temperature=1.0, top_p=0.0), "top_p"),
        (SamplingParams(temperature=NAN), "temperature"),
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(temperature=1.0, top_k=-3), "top_k"),
        (SamplingParams(temperature=1.0, top_k=True), "top_k"),
        (SamplingParams(presence_penalty=INF), "presence_penalty"),
        (SamplingParams(frequency_penalty=NAN), "frequency_penalty"),
        (SamplingParams(logit_bias=((5, NAN),)), "logit_bias"),
        (SamplingParams(logit_bias=((5, 1e300),), temperature=0.8), "logit_bias"),
        (SamplingParams(frequency_penalty=-1e31), "frequency_penalty"),
        (SamplingParams(presence_penalty=3e38), "presence_penalty"),
        (SamplingParams(logprobs=1000), "logprobs"),
        (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
    ],
)
def test_sampling_no_chooser_can_run_is_an_error_event_and_the_engine_serves_on(sampling, field) -> None:
    """`Engine.submit` from any caller, not only through the server's schema: a negative seed or top-p 0
    failed the engine's step, a NaN temperature or bias chose nonsense. Each is an error event naming the
    field, and the next request decodes as it would have."""
    _refused_then_serves(Request(tuple(b"hello"), 4, sampling), field)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_largest_bias_and_penalty_the_engine_takes_choose_as_they_say_sampled_too(temperature) -> None:
    """A bias of 1e30 forces its token and a frequency penalty of -1e30 repeats the first token, in float32
    arithmetic, greedy or sampled (at 1e300 the sampled distribution was NaN and chose other tokens)."""
    eng = engine(2, "batch-mtp")
    forced = SamplingParams(temperature=temperature, seed=3, logit_bias=((5, 1e30), (6, -1e30)))
    repeats = SamplingParams(temperature=temperature, seed=4, frequency_penalty=-1e30)
    requests = [Request(tuple(b"hello"), 8, forced), Request(tuple(b"world"), 8, repeats)]
    (a, b) = collect(eng, [(0, r) for r in requests])
    assert a == [5] * 8
    assert b == [b[0]] * 8


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"stop_strings": ("",)}, "stop_strings"),
        ({"stop_strings": (5,)}, "stop_strings"),
        ({"stop_ids": ("a",)}, "stop_ids"),
        ({"priority": "x"}, "priority"),
        ({"cache_salt": None}, "cache_salt"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"prompt_ids": (1.5, 2)}, "prompt_ids"),
        ({"sampling": SamplingParams(reasoning=Reasoning(5, 10**6, opened=True, budget=1))}, "reasoning"),
        ({"sampling": SamplingParams(reasoning=Reasoning(-1, 6))}, "reasoning"),
        ({"sampling": SamplingParams(reasoning=Reasoning(5, 6, budget=0))}, "reasoning.budget"),
    ],
)
def test_a_request_field_of_the_wrong_shape_is_an_error_event(fields, field) -> None:
    """A stop string that is not a string, or a think block's closing id past the vocabulary, failed the
    engine's step; a priority that is not a number failed the next submit's ordering; an empty stop string
    stopped nothing."""
    _refused_then_serves(Request(**{"prompt_ids": tuple(b"hello"), "max_tokens": 4, **fields}), field)


@pytest.mark.parametrize(
    "vanishing",
    [SamplingParams(temperature=1.0, top_p=1e-30, seed=7), SamplingParams(temperature=1e-300, seed=7)],
    ids=["top-p", "temperature"],
)
def test_sampled_requests_at_a_vanishing_cut_decode_together_as_greedy_ones(vanishing) -> None:
    """Two sampled requests at top-p 1e-30 or temperature 1e-300 (both within the API's schema) in one window:
    only each row's top token stays, so both give the greedy text. At that top-p their window's draw had
    kept no token, and failed the engine's step."""
    eng = Engine(mode_plan("serial", 1, preset="tiny", context=128, prefill_chunk=16, draft_tokens=3))
    prompt = tuple(b"Once upon")
    got = collect(eng, [(0, Request(prompt, 6, vanishing)), (0, Request(prompt, 6, vanishing))])
    assert [tuple(t) for t in got] == [reference("tiny", prompt, 6)] * 2


def _refused_then_serves(request: Request, field: str) -> None:
    # An engine of its own: a request wrongly let in stays in its queue, and would run in the next test's.
    eng = Engine(mode_plan("serial", 1, preset="tiny", context=128, prefill_chunk=16))
    event = eng.submit(request).events.get_nowait()  # given at once, without a step
    assert event.finished == "error" and event.error.startswith(f"{field}:"), event
    prompt = tuple(b"Once upon")
    assert tuple(collect(eng, [(0, Request(prompt, 5))])[0]) == reference("tiny", prompt, 5)


def test_logits_are_computed_only_for_rows_that_decide_a_token() -> None:
    """A prompt's chunks need no LM head except for the last row of its last chunk; decode rows all do."""
    eng = Engine(make_plan(preset="tiny", stages=2, context=128, prefill_chunk=16, draft_tokens=3))
    rows: list[int] = []
    real = eng.model.logits
    eng.model.logits = lambda normed: rows.append(int(normed.shape[0])) or real(normed)
    g = np.random.default_rng(104)
    prompt = tuple(int(t) for t in g.integers(1, 250, 40))  # chunks of 16, 16 and 8 rows
    tokens = collect(eng, [(0, Request(prompt, 5))])[0]
    assert rows[0] == 1  # the first LM-head call: the last prompt row only (none for the chunks before)
    assert 1 < len(rows) <= 5 and all(r <= 4 for r in rows[1:])  # solo windows: a token + up to 3 drafts
    assert tuple(tokens) == reference("tiny", prompt, 5)


def test_a_lone_prompt_reads_in_its_longer_chunks_and_gives_the_same_text() -> None:
    """``memory.prefill_chunk_alone``: a prompt that is the engine's only work reads in chunks of that
    length; beside a decoding stream it keeps ``prefill_chunk``, so the stream is never stalled longer."""
    prompt = tuple((b"It is a truth universally acknowledged, that a single man " * 2)[:100])
    texts, chunks = [], []
    for alone in (None, 64):
        eng = Engine(make_plan(slots=2, context=256, prefill_chunk=16, prefill_chunk_alone=alone))
        texts.append(collect(eng, [(0, Request(prompt, 8))])[0])
        chunks.append([w.rows for w in eng.window_stats.recent if w.kind == "prefill"])
    assert chunks == [[16] * 6 + [4], [64, 36]]
    assert texts[0] == texts[1]
    eng.window_stats.recent.clear()
    eng.forget_prefixes()  # the next prompts begin as the last one did: they would reuse its KV
    other = tuple(reversed(prompt[:10]))  # begins otherwise: the prompt copies no prefix of it
    collect(eng, [(0, Request(other, 40)), (2, Request(prompt, 4))])
    beside = [w.rows for w in eng.window_stats.recent if w.kind == "prefill"]
    assert beside == [10] + [16] * 6 + [4]  # the first request decodes until after the prompt is read


@pytest.mark.parametrize("stages", [1, 2])
def test_a_burst_of_short_prompts_is_read_in_one_window_with_each_text_its_own(stages) -> None:
    """Serial windows read the whole rest of other waiting prompts in the rows a prefill chunk leaves
    (oldest first, only prompts that fit whole): four requests arriving together get their first tokens
    from two windows, not four, and each text is the request's text alone."""
    prompts = [
        tuple(b"one"),
        tuple(b"a second prompt"),
        tuple(b"It is a truth universally acknowledged"),
        tuple(b"four"),
    ]
    plan = make_plan(stages=stages, slots=4, groups=1, context=128, prefill_chunk=32)
    assert plan.batch.mode == "serial"
    eng = Engine(plan)
    got = collect(eng, [(0, Request(p, 6)) for p in prompts])
    assert got == [list(reference("tiny", p, 6)) for p in prompts]
    reads = [(w.rows, w.slots) for w in eng.window_stats.recent if w.kind == "prefill"]
    # 3 + 15 rows, the 38-row prompt does not fit the 14 left but the 4-row one does; then the long one.
    assert reads == [(3 + 15 + 4, (0, 1, 3)), (32, (2,)), (6, (2,))]


def test_pipelined_groups_stream_a_lone_prompt_in_the_ordinary_chunks() -> None:
    """Pipelined groups stream a lone prompt's chunks through their stages instead: the longer chunk is for
    serial windows only."""
    prompt = tuple((b"It is a truth universally acknowledged, that a single man " * 2)[:100])
    plan = make_plan(stages=2, slots=2, groups=2, context=256, prefill_chunk=16, prefill_chunk_alone=64)
    assert plan.batch.mode == "pipelined"
    eng = Engine(plan)
    collect(eng, [(0, Request(prompt, 4))])
    assert [w.rows for w in eng.window_stats.recent if w.kind == "prefill"] == [16] * 6 + [4]


@pytest.mark.parametrize("mode", ["serial", "batch-mtp"])
def test_a_seeded_request_on_an_idle_engine_does_not_depend_on_the_requests_before_it(mode) -> None:
    """Whatever ran before, once its requests are done the engine is idle (the windows queued past their
    ends were finished with them), and a seeded pair of requests gets the text it gets on a fresh engine."""
    sampled = [
        (
            0,
            Request(
                tuple(b"Sampled text"), 16, SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=5)
            ),
        ),
        (2, Request(tuple(b"Another one"), 10, SamplingParams(temperature=1.0, seed=7))),
    ]
    fresh = collect(Engine(mode_plan(mode, 2, preset="tiny", context=128, prefill_chunk=16)), sampled)
    eng = Engine(mode_plan(mode, 2, preset="tiny", context=128, prefill_chunk=16))
    g = np.random.default_rng(41)
    for _ in range(8):
        history = [
            (
                int(g.integers(0, 12)),
                Request(tuple(int(t) for t in g.integers(32, 127, g.integers(1, 24))), 9),
            )
            for _ in range(int(g.integers(1, 5)))
        ]
        collect(eng, history)
        assert not eng._chain and not eng._flights
        assert collect(eng, sampled) == fresh


def test_waiting_requests_get_the_free_slot_in_order_of_priority_then_of_arrival() -> None:
    """One slot, held by a request; four wait, of priorities 1, 0, 1 and -1: the slot goes to them as it
    frees in the order -1, 0, then the two of priority 1 as they came, and each gets the text it gets
    alone."""
    plan = make_plan(stages=1, slots=1, context=128, prefill_chunk=16)
    eng = Engine(plan)
    first = eng.submit(Request(tuple(b"Holding the slot"), 6))
    eng.step()
    assert first.slot == 0
    waiting = {
        name: eng.submit(Request(tuple(f"Request {name}".encode()), 4, priority=priority))
        for name, priority in (("a", 1), ("b", 0), ("c", 1), ("d", -1))
    }
    order: list[str] = []
    for _ in range(400):
        eng.step()
        order += [n for n, h in waiting.items() if h.slot is not None and n not in order]
        if len(order) == 4 and eng.slots == [None]:
            break
    assert order == ["d", "b", "a", "c"]
    for handle in waiting.values():
        tokens = [t for ev in _drained(handle) for t in ev.token_ids]
        assert tuple(tokens) == reference("tiny", handle.request.prompt_ids, 4)


def _drained(handle: Any) -> list[Any]:
    out = []
    while not handle.events.empty():
        out.append(handle.events.get())
    return out
