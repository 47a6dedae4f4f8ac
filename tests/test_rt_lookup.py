"""N-gram lookup drafting (``spec.method = "ngram"``): what a lookup proposes, that verifying its proposals
keeps greedy text and the target's sampled distribution, and when the engine drafts by it."""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rt_engine_helpers import chi_square_p, collect, generate, launches, two_sample_p
from rt_plans import make_plan

from strata_cfg.plan.from_profile import resolve_path
from strata_cfg.schema.packaged import packaged_dir
from strata_cfg.schema.plan import LaunchPlan
from strata_runtime.api import Request, RequestHandle, SamplingParams, TokenEvent
from strata_runtime.engine import Engine
from strata_runtime.engine.job import Job
from strata_runtime.engine.lookup import TextLookup
from strata_runtime.engine.sampling import Sampler
from strata_runtime.engine.slot import Slot
from strata_runtime.engine.speculative import DRAFT_WARMUP, Proposals, verify
from strata_runtime.engine.warm import warm_requests
from strata_runtime.models.ops.lookup import lookup_propose

# ---- what a lookup proposes ----------------------------------------------------------------------------


def reference_proposal(text: list[int], most: int, shortest: int, longest: int) -> list[int]:
    """The lookup's rule, written the slow way: for n from ``longest`` down to ``shortest``, the latest
    earlier occurrence of the last n tokens (ending before the last token); the tokens after it, read on
    through the proposals themselves where they run into the end."""
    size = len(text)
    for n in range(min(longest, size - 1), shortest - 1, -1):
        tail = text[size - n :]
        for end in range(size - 2, n - 2, -1):
            if text[end - n + 1 : end + 1] == tail:
                seq = list(text)
                at = end + 1
                while len(seq) < size + most:
                    seq.append(seq[at])
                    at += 1
                return seq[size:]
    return []


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    most=st.integers(0, 7),
    shortest=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_a_lookup_proposes_what_the_slow_rule_proposes(text, most, shortest, extra) -> None:
    """Over a small alphabet, so that runs repeat often: the vectorised search, the latest-first choice and
    the read-through of short loops agree with the rule written as loops."""
    longest = shortest + extra
    lookup = TextLookup(text, shortest, longest)
    assert lookup.propose(most) == reference_proposal(text, most, shortest, longest)


def histories(texts: list[list[int]], width: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Texts as a device lookup reads them: [S, width] with random tokens past each text (positions a
    window wrote and did not keep), and their lengths."""
    history = rng.integers(0, 4, (len(texts), width)).astype(np.int64)
    for i, text in enumerate(texts):
        history[i, : len(text)] = text
    return history, np.array([len(t) for t in texts], np.int64)


@settings(max_examples=200, deadline=None)
@given(
    texts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=3),
    most=st.integers(1, 7),
    shortest=st.integers(1, 3),
    extra=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_a_lookup_on_the_device_proposes_what_the_host_lookup_proposes(
    texts, most, shortest, extra, seed
) -> None:
    """The lookup of windows decided on the device (its NumPy path), over several slots' histories with
    junk past their texts: where the host's lookup proposes, the same tokens, marked found; where it
    proposes nothing, the last token repeated, marked not found."""
    longest = shortest + extra
    history, lengths = histories(texts, 48, np.random.default_rng(seed))
    proposals, found = lookup_propose(history, lengths, shortest, longest, most)
    for i, text in enumerate(texts):
        want = TextLookup(text, shortest, longest).propose(most)
        assert bool(found[i]) == bool(want)
        assert proposals[i].tolist() == (want or [text[-1]] * most)


def test_the_longest_run_that_matches_wins_over_a_later_shorter_one() -> None:
    # "7 8 9" last occurred at the start (followed by 1 2); "8 9" alone later (followed by 5).
    text = [7, 8, 9, 1, 2, 3, 8, 9, 5, 6, 7, 8, 9]
    assert TextLookup(text, 2, 3).propose(2) == [1, 2]
    assert TextLookup(text, 2, 2).propose(2) == [5, 6]  # only two tokens matched: the latest "8 9"


def test_no_run_long_enough_proposes_nothing() -> None:
    text = [1, 2, 3, 9, 4, 5, 6, 9]  # "9" recurs, but no two-token run does
    assert TextLookup(text, 2, 4).propose(3) == []
    assert TextLookup(text, 1, 4).propose(3) == [4, 5, 6]


def test_a_short_loop_is_proposed_as_far_as_asked() -> None:
    text = [5, 1, 2, 3, 1, 2, 3, 1, 2]
    assert TextLookup(text, 2, 4).propose(7) == [3, 1, 2, 3, 1, 2, 3]


def test_following_a_reply_equals_looking_up_the_whole_text() -> None:
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(1, 6, 30)]
    reply = [int(t) for t in rng.integers(1, 6, 200)]
    lookup = TextLookup(prompt, 2, 4)
    for k in range(1, len(reply) + 1, 7):  # the reply grows as windows finish
        lookup.follow(reply[:k])
        whole = TextLookup(prompt + reply[:k], 2, 4)
        assert len(lookup) == len(prompt) + k
        assert lookup.propose(5) == whole.propose(5)
        assert lookup.propose(1, len(lookup) - 1) == whole.propose(1, len(whole) - 1)


def test_lengths_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError, match="shortest <= longest"):
        TextLookup([1, 2, 3], 3, 2)


# ---- verifying looked-up proposals ---------------------------------------------------------------------

V = 5
TRIALS = 20_000
P_THRESHOLD = 1e-3


def test_sampled_verification_of_looked_up_proposals_keeps_the_target_distribution() -> None:
    """Two looked-up proposals (fixed tokens, not draws), verified against p as proposals from a q certain
    of them: the first two emitted tokens follow the target's joint distribution exactly (chi-square)."""
    pytest.importorskip("torch")
    rng = np.random.default_rng(17)
    p0 = rng.dirichlet(np.full(V, 0.7))
    p1 = rng.dirichlet(np.full(V, 0.7), size=V)  # the target after each first token
    p2 = rng.dirichlet(np.full(V, 0.7), size=(V, V))
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0), seed=23)
    d1, d2 = int(np.argmax(p0)), 3  # a likely first proposal, and a fixed second one
    counts = np.zeros((V, V))
    accepted = 0
    for _ in range(TRIALS):
        target = np.log(np.stack([p0, p1[d1], p2[d1, d2]]))
        verdict = verify(target, Proposals([d1, d2], [], looked_up=True), sampler)
        accepted += verdict.accepted
        t1 = verdict.tokens[0]
        t2 = verdict.tokens[1] if len(verdict.tokens) >= 2 else sampler.draw(p1[t1])
        counts[t1, t2] += 1
    expected = TRIALS * p0[:, None] * p1
    p_value = chi_square_p(counts, expected)
    assert p_value > P_THRESHOLD, f"p = {p_value:.2e}"
    assert accepted > TRIALS // 10  # proposals held often enough to be tested


# ---- the engine drafting by lookup ---------------------------------------------------------------------


def lookup_plan(draft_tokens: int, **kw: object) -> LaunchPlan:
    """The plan of `make_plan` with the solo path drafting by n-gram lookup instead of the MTP head (windows
    of ``draft_tokens`` rows; no MTP head loaded)."""
    plan = make_plan(draft_tokens=draft_tokens, **kw)
    spec = plan.spec.model_copy(update={"mtp": False, "ngram": True, "ngram_min": 2, "ngram_max": 4})
    return plan.model_copy(update={"spec": spec})


@functools.cache
def engine(draft_tokens: int, stages: int, lookup: bool) -> Engine:
    kw = {"stages": stages, "context": 192, "prefill_chunk": 16}
    return Engine(lookup_plan(draft_tokens, **kw) if lookup else make_plan(draft_tokens=0, **kw))


LOOP = (40, 41, 42, 43, 44, 45)


@pytest.mark.parametrize("stages", [1, 2])
@settings(max_examples=8, deadline=None)
@given(head=st.lists(st.integers(1, 383), min_size=0, max_size=20), repeats=st.integers(0, 4))
def test_greedy_text_drafted_by_lookup_is_the_text_without_drafting(stages, head, repeats) -> None:
    prompt = (*head, *LOOP * repeats, *head[:3]) or (7,)
    drafting, plain = engine(5, stages, True), engine(0, stages, False)
    assert generate(drafting, prompt, 48) == generate(plain, prompt, 48)


def test_a_repeating_text_is_drafted_and_its_proposals_hold() -> None:
    """The tiny model's greedy text comes back to earlier stretches; there its lookups propose them, and
    the proposals hold: fewer windows than tokens. (At a fixed depth: the adaptive one reads measured
    window times, which a loaded machine makes noisy.)"""
    eng = Engine(lookup_plan(5, stages=1, context=192, prefill_chunk=16, adaptive_depth=False))
    tokens = generate(eng, (*LOOP * 4, 40), 120)
    made, held, windows = eng.totals["proposals"], eng.totals["accepted"], eng.totals["windows"]
    assert len(tokens) == 120
    assert made > 0 and held >= 10, f"{held}/{made} looked-up proposals held"
    assert windows <= len(tokens) - held + 1, f"{windows} windows for {len(tokens)} tokens"


def test_the_trained_demo_drafts_by_lookup_where_it_repeats_its_prompt() -> None:
    """The packaged demo model on a prompt that lists the same phrase: looked-up proposals hold, and the
    text is the text without drafting."""
    plan = {"model_dir": packaged_dir("austen"), "stages": 1, "context": 320, "prefill_chunk": 64}
    drafting, plain = Engine(lookup_plan(5, **plan)), Engine(make_plan(draft_tokens=0, **plan))
    prompt = tuple(b"my dear sister, my dear sister, my dear sister, my dear")
    text = generate(drafting, prompt, 96)
    assert text == generate(plain, prompt, 96)
    assert drafting.totals["accepted"] > 0


def test_sampled_seeded_text_drafted_by_lookup_repeats_with_its_seed() -> None:
    eng = engine(5, 1, True)
    s = SamplingParams(temperature=0.8, seed=5)
    prompt = (*LOOP * 3, 40)
    a = generate(eng, prompt, 40, s)
    assert a == generate(eng, prompt, 40, s)
    assert a != generate(eng, prompt, 40, SamplingParams(temperature=0.8, seed=6))


def test_new_text_pauses_drafting_and_a_probe_that_holds_brings_it_back() -> None:
    """A slot whose lookups find nothing counts each as a first proposal that failed: after the warm-up its
    gauge pauses drafting (so its windows chain again); a silent probe whose lookup would have proposed the
    token that came raises the estimate again, and one that would not lowers it."""
    eng = engine(5, 1, True)
    sampler = Sampler(SamplingParams(), 0)
    prompt = tuple(range(100, 140))
    slot = Slot(0, RequestHandle(Request(prompt, 50)), sampler, frozenset(), eng.tokenizer, 1)
    slot.gauge, slot.lookup = eng.choice.gauge(sampler), TextLookup(prompt, 2, 4)
    slot.generated = [139]
    for _ in range(DRAFT_WARMUP + 4):
        assert eng._looked_up(slot, 3) is None  # "138 139" did not occur before
    assert slot.gauge.silent and not slot.gauge.drafts, slot.gauge.rate
    rate = slot.gauge.rate
    eng._lookup_probes(
        Job("solo", []), [(slot, _event(slot, 7))]
    )  # a lookup before 7 proposed nothing: a failed probe
    assert slot.gauge.rate < rate
    slot.lookup, slot.generated = TextLookup((5, 6, 7, 5, 6), 2, 4), []
    rate = slot.gauge.rate
    eng._lookup_probes(Job("solo", []), [(slot, _event(slot, 7))])  # "5 6" was followed by 7, and 7 came
    assert slot.gauge.rate > rate
    assert eng._looked_up(slot, 3) is not None  # "6 7" occurred: the lookup proposes again


def test_one_lucky_probe_does_not_bring_lookup_drafting_back_and_a_run_of_them_does() -> None:
    """Probed after every paused window, a lookup guesses right now and then on any text (a sampled reply
    repeats short runs by chance): one probe that holds must not bring drafting back, a few in a row must."""
    eng = engine(5, 1, True)
    sampler = Sampler(SamplingParams(), 0)
    slot = Slot(0, RequestHandle(Request((1,), 50)), sampler, frozenset(), eng.tokenizer, 1)
    slot.gauge = eng.choice.gauge(sampler)
    slot.lookup, slot.generated = TextLookup((3, 4, 5, 3, 4), 2, 4), []
    for _ in range(DRAFT_WARMUP + 8):
        eng._lookup_probes(
            Job("solo", []), [(slot, _event(slot, 9))]
        )  # a lookup would have proposed 5, and 9 came
        slot.lookup, slot.generated = TextLookup((3, 4, 5, 3, 4), 2, 4), []
    assert not slot.gauge.drafts
    resumed = []
    for _ in range(4):
        eng._lookup_probes(Job("solo", []), [(slot, _event(slot, 5))])  # it would have held
        slot.lookup, slot.generated = TextLookup((3, 4, 5, 3, 4), 2, 4), []
        resumed.append(slot.gauge.drafts)
    assert resumed[0] is False and resumed[-1] is True, resumed


def _event(slot: Slot, token: int) -> TokenEvent:
    """A window's event that emitted ``token`` for ``slot`` (its reply grows by it, as `Slot.emit` does)."""
    slot.generated.append(token)
    return TokenEvent((token,), "", None, 0)


def test_the_engine_says_it_drafts_by_lookup() -> None:
    eng = engine(5, 1, True)
    lines = "\n".join(eng.startup)
    assert 'looked up in its own text (4 down to 2 tokens matched, spec.method = "ngram")' in lines
    assert "silent probe every window" in lines and "decided on cpu:0, running ahead of the host" in lines
    assert eng.stats()["plan"]["draft_method"] == "ngram"
    assert engine(0, 1, False).stats()["plan"]["draft_method"] is None


def test_a_profile_asking_for_lookup_gives_an_engine_that_drafts_by_it() -> None:
    """The demo profile with ``spec.method = "ngram"``, resolved as `strata serve` resolves it: the engine
    loads no MTP head, looks its proposals up, and keeps the greedy text of the profile without drafting."""
    demo = str(Path(__file__).resolve().parent.parent / "profiles" / "demo.toml")
    plan = resolve_path(demo, ('spec.method="ngram"', "batch.slots=1")).plan
    plain = resolve_path(demo, ("spec.draft_tokens=0", "batch.slots=1")).plan
    eng = Engine(plan)
    assert eng.lookup and eng.model.mtp is None and plan.windows.solo_rows == 4
    prompt = tuple(b"of the subject of the subject of the")
    assert generate(eng, prompt, 64) == generate(Engine(plain), prompt, 64)
    assert eng.totals["accepted"] > 0


@pytest.mark.parametrize("stages", [1, 2])
def test_slots_decoding_together_draft_by_lookup_in_the_rows_their_window_spares(stages) -> None:
    """Two requests at once, on one stage (serial windows) and on two (pipelined groups of one slot each):
    each looks its proposals up in the rows its window has to spare; the text of each is the text of the
    same requests without drafting, and the windows that carried several slots' rows carried proposals
    that held."""
    kw = {"stages": stages, "slots": 2, "context": 192, "prefill_chunk": 16}
    if stages == 2:
        kw["groups"] = 2
    drafting, plain = Engine(lookup_plan(5, **kw)), Engine(make_plan(draft_tokens=0, **kw))
    prompts = [(*LOOP * 4, 40), (9, *LOOP[::-1] * 4, 45)]

    def both(eng: Engine) -> list[list[int]]:
        handles = [eng.submit(Request(p, 96)) for p in prompts]
        while eng.step():
            pass
        return [[t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in handles]

    assert both(drafting) == both(plain)
    kind = "serial" if stages == 1 else "pipelined"
    shared = [w for w in drafting.windows if w.kind == kind and w.proposals]
    assert shared and sum(w.accepted for w in shared) > 0, drafting.totals
    assert all(w.rows <= 8 for w in drafting.windows if w.kind != "prefill")


@pytest.mark.parametrize(("eight_rows_ms", "depth"), [(10.0, 0), (2.0, 3)])
def test_a_serial_window_takes_the_lookup_depth_its_measured_times_pay_for(eight_rows_ms, depth) -> None:
    """Two slots whose lookups hold: their serial window takes three proposals each where an 8-row window
    costs twice a 2-row one (8 tokens for 2 ms beat 2 for 1), and none where it costs ten times as much
    (every row count between is costed from those two, as the engine costs one it has not measured)."""
    eng = Engine(lookup_plan(4, slots=2, context=192, prefill_chunk=16))
    sampler = Sampler(SamplingParams(), 0)
    slots = []
    for i in range(2):
        slot = Slot(i, RequestHandle(Request((1,), 50)), sampler, frozenset(), eng.tokenizer, 1)
        slot.gauge, slot.lookup = eng.choice.gauge(sampler), TextLookup((3, 4, 5, 3, 4), 2, 4)
        slots.append(slot)
    costs = eng.choice.lookup_costs(slots)
    assert costs is not None
    for _ in range(3):
        eng.choice.observe_lookup("serial", slots, 2, 1.0)
        eng.choice.observe_lookup("serial", slots, 8, eight_rows_ms)
    assert eng._spare_depth("serial", slots, slots, 2) == depth


def test_lookup_drafted_replies_keep_their_log_probabilities_and_stop_strings() -> None:
    """A greedy request that asks for log-probabilities and stops at a string, drafted by lookup on the
    demo: its tokens, text, finish and log-probabilities are those without drafting (each token's figure is
    its row's, proposal or not), and the reply ends where the stop string completes."""
    plan = {"model_dir": packaged_dir("austen"), "stages": 1, "context": 320, "prefill_chunk": 64}
    prompt = tuple(b"my dear sister, my dear sister, my dear sister, my dear")
    sampling = SamplingParams(logprobs=2)

    def reply(eng: Engine) -> tuple[list[int], str, str | None, list[float]]:
        h = eng.submit(Request(prompt, 120, sampling, stop_strings=("subject of the s",)))
        while eng.step():
            pass
        events = [h.events.get() for _ in range(h.events.qsize())]
        tokens = [t for e in events for t in e.token_ids]
        figures = [lp.logprob for e in events for lp in e.logprobs]
        return tokens, "".join(e.text for e in events), events[-1].finished, figures

    drafting = Engine(lookup_plan(5, **plan))
    tokens, text, finished, figures = reply(drafting)
    plain = reply(Engine(make_plan(draft_tokens=0, **plan)))
    assert (tokens, text, finished) == plain[:3] and finished == "stop"
    assert "subject of the s" not in text and len(figures) == len(tokens)
    np.testing.assert_allclose(figures, plain[3], rtol=1e-4, atol=1e-5)
    assert drafting.totals["accepted"] > 0


SAMPLED_PROMPT = (*LOOP * 4, 40, 114, 41, 48, 126, 43, 42, 309, 367, 82, 59, 48)
"""Where the tiny model's own greedy text comes back to an earlier stretch ("48 126 43 42"): sampled cold
with top-k 3, it often follows it, so looked-up proposals hold about a quarter of the time."""


def test_sampled_lookup_windows_are_drawn_on_the_device_with_the_distribution_of_no_drafting() -> None:
    """A sampled request's looked-up proposals are verified by the device's draws (`Entry.compared`): no
    window with proposals reads logits back, and over 1,000 seeds each the first four tokens come out with
    the same distribution as without drafting (a two-sample chi-square test over the runs of four tokens)."""
    pytest.importorskip("torch")
    kw = {"stages": 1, "context": 192, "prefill_chunk": 16}
    drafting, plain = Engine(lookup_plan(4, **kw)), Engine(make_plan(draft_tokens=0, **kw))
    read_logits = []
    launch = drafting.executor.launch

    def recording(job, after=None):  # type: ignore[no-untyped-def]
        flight = launch(job, after)
        if any(e.proposals.tokens for e in job.entries):
            read_logits.append(flight.sampled)
        return flight

    drafting.executor.launch = recording  # type: ignore[method-assign]

    def runs(eng: Engine) -> Counter[tuple[int, ...]]:
        return Counter(
            tuple(generate(eng, SAMPLED_PROMPT, 4, SamplingParams(temperature=0.5, top_k=3, seed=s)))
            for s in range(1000)
        )

    looked, without = runs(drafting), runs(plain)
    assert drafting.totals["accepted"] > 200, drafting.totals
    assert read_logits and not any(read_logits)
    p_value, dof = two_sample_p(looked, without)
    assert dof >= 10 and p_value > 1e-3, f"{dof} degrees of freedom, p = {p_value:.2e}"


@pytest.mark.parametrize("stages", [1, 2])
def test_requests_arriving_and_leaving_under_lookup_keep_their_text_and_a_consistent_kv(stages) -> None:
    """Six requests over four slots, arriving at different steps, some repeating their prompts, greedy and
    penalised (a presence penalty, verified on the host) and seeded sampled ones among them: after every
    step each stage's KV holds exactly what its slot committed, and each greedy reply (penalised or not) is
    the reply without drafting."""
    kw = {"stages": stages, "slots": 4, "context": 192, "prefill_chunk": 16}
    penalised = SamplingParams(presence_penalty=0.5)
    sampled = SamplingParams(temperature=0.7, top_k=5, seed=9)
    kinds = [SamplingParams(), penalised, SamplingParams(), sampled, SamplingParams(), penalised]
    prompts = [(*LOOP * 3, 40), SAMPLED_PROMPT, (7, 8, 9), (*LOOP[::-1] * 3,), SAMPLED_PROMPT[:20], (5,) * 12]

    def schedule() -> list[tuple[int, Request]]:
        return [
            (3 * i, Request(p, 40 + 4 * i, k)) for i, (p, k) in enumerate(zip(prompts, kinds, strict=True))
        ]

    drafting = Engine(lookup_plan(4, **kw))
    looked = collect(drafting, schedule())
    plain = collect(Engine(make_plan(draft_tokens=0, **kw)), schedule(), check_kv=False)
    greedy = [i for i, k in enumerate(kinds) if k.temperature == 0]
    assert [looked[i] for i in greedy] == [plain[i] for i in greedy]
    assert [len(t) for t in looked] == [40 + 4 * i for i in range(6)]
    assert drafting.totals["accepted"] > 0
    assert max(w.rows for w in drafting.windows if w.kind != "prefill") <= 8  # proposals only in spare rows


def test_a_reply_held_to_a_grammar_does_not_look_up() -> None:
    """Under a grammar the tokens it forces are the proposals: a looked-up token it does not allow would
    only fail, so such a request gets no lookup; one without a grammar does."""
    eng = engine(5, 1, True)
    free = eng._text_lookup((1, 2, 3), Sampler(SamplingParams(), 0))
    held = eng._text_lookup((1, 2, 3), Sampler(SamplingParams(), 0, grammar=object()))
    assert isinstance(free, TextLookup) and held is None


def test_the_warm_up_runs_a_request_whose_lookups_propose() -> None:
    """With lookup drafting, the warm-up's requests include one whose prompt repeats, so that solo windows
    with looked-up proposals run (and are timed) before the first real request; without it, none repeats."""
    plan = lookup_plan(5, stages=1, context=192, prefill_chunk=16)
    proposing = [
        r for r in warm_requests(plan, 384, cached=False) if TextLookup(r.prompt_ids, 2, 4).propose(3)
    ]
    assert proposing and all(r.max_tokens > 1 for r in proposing)
    plain = make_plan(draft_tokens=0, stages=1, context=192, prefill_chunk=16)
    assert not [
        r for r in warm_requests(plain, 384, cached=False) if TextLookup(r.prompt_ids, 2, 4).propose(3)
    ]


# ---- looked-up windows decided on the device -----------------------------------------------------------


def _runs_ahead(
    eng: Engine, prompt: tuple[int, ...], n: int, sampling: SamplingParams | None = None
) -> tuple[list[int], list[tuple[Job, bool, Any]]]:
    """A request run to its end, with every window it launched: (tokens, [(job, chained?, flight)])."""
    seen = launches(eng)
    tokens = generate(eng, prompt, n, sampling)
    del eng.executor.launch
    return tokens, [(job, after is not None, flight) for job, after, flight in seen]


@pytest.mark.parametrize("stages", [1, 2])
def test_looked_up_windows_of_a_request_alone_are_decided_on_the_device_and_run_ahead(stages) -> None:
    """A request alone whose text repeats: its looked-up windows are decided on the device, windows are
    chained behind them with proposals the device looked up, and its greedy text is the text without
    drafting; with the device's decisions off, no window is."""
    kw = {"stages": stages, "context": 192, "prefill_chunk": 16}
    prompt = (*LOOP * 4, 40)
    eng = Engine(lookup_plan(5, **kw))
    tokens, seen = _runs_ahead(eng, prompt, 120)
    assert tokens == generate(Engine(make_plan(draft_tokens=0, **kw)), prompt, 120)
    decided = [(job, chained) for job, chained, _ in seen if job.spec_on_device]
    assert all(job.kind == "solo" and all(e.proposals.looked_up for e in job.entries) for job, _ in decided)
    assert sum(1 for _, chained in decided if chained) >= 5, f"{len(decided)} decided on the device"
    text = [*prompt, *tokens]
    for _, chained, flight in seen:  # what the device looked up is what the host's lookup gives there
        if chained and flight.spec is not None:
            at, window = int(flight.spec.host["positions"][0]), flight.spec.host["tokens"].tolist()
            want = TextLookup(text[: at + 1], 2, 4).propose(len(window) - 1) or [text[at]] * (len(window) - 1)
            assert window == [text[at], *want], f"the window at position {at}"
    eng.lookup_on_device = False
    again, seen = _runs_ahead(eng, prompt, 120)
    assert again == tokens and not any(job.spec_on_device for job, _, _ in seen)


def test_a_lookup_on_the_device_that_finds_nothing_ends_its_chain() -> None:
    """Where the device's lookup for the next window finds no run, that window only repeats the last token;
    the host reads it and chains nothing more, so at most the windows already in flight (one, at two in
    flight) carry such proposals after each miss. A window the device decided reports whether its lookup
    found a run, and a window without one follows only such a report."""
    eng = Engine(lookup_plan(5, stages=1, context=256, prefill_chunk=16))
    rng = np.random.default_rng(11)
    prompt = (*LOOP * 3, *(int(t) for t in rng.integers(1, 383, 12)), *LOOP * 2, 40)
    _, seen = _runs_ahead(eng, prompt, 200)
    decided = [(chained, flight.spec) for _, chained, flight in seen if flight.spec is not None]
    missed = [not bool(spec.host["found"][0]) for _, spec in decided]
    assert any(missed), "the test's text makes a lookup on the device miss"
    after_miss = sum(1 for k in range(1, len(decided)) if decided[k][0] and missed[k - 1])
    assert after_miss <= sum(missed), f"{after_miss} windows chained after {sum(missed)} misses"
    for k in range(2, len(decided)):  # no chain goes on two windows past a miss
        assert not (decided[k][0] and decided[k - 1][0] and missed[k - 2]), f"window {k} chained past a miss"


def test_a_plain_chain_goes_on_while_the_text_read_so_far_gives_no_lookup() -> None:
    """A request alone whose lookups pay, between stretches its text repeats: its chain of plain windows
    ends only where a lookup in the text the host has read finds a run (else the host's next window would
    find none either, and run without proposals and unchained). Ending it wherever lookups pay, as before,
    launches more plain windows from the host, for the same text."""

    def host_plain(always_ends: bool) -> tuple[list[int], int]:
        eng = Engine(lookup_plan(5, stages=1, context=256, prefill_chunk=16))
        if always_ends:
            eng._lookup_finds = lambda slot: True  # type: ignore[method-assign]
        rng = np.random.default_rng(11)
        prompt = (*LOOP * 3, *(int(t) for t in rng.integers(1, 383, 12)), *LOOP * 2, 40)
        tokens, seen = _runs_ahead(eng, prompt, 200)
        plain = [job for job, chained, _ in seen if job.kind == "solo" and not chained]
        return tokens, sum(1 for job in plain if not any(e.proposals.tokens for e in job.entries))

    (text, launched), (before, launched_before) = host_plain(False), host_plain(True)
    assert text == before
    assert launched < launched_before, f"{launched} plain windows from the host, {launched_before} before"


def test_serial_windows_of_looked_up_proposals_are_decided_on_the_device_and_run_ahead() -> None:
    """Two requests at once in serial windows, each text repeating, every spare row taken (no measured
    times): windows whose slots all carry as many looked-up proposals are decided on the device, windows
    are chained behind them with the proposals the host's lookup gives each slot at its position, and each
    text is its text without drafting."""
    kw = {"stages": 1, "slots": 2, "context": 192, "prefill_chunk": 16}
    eng, plain = Engine(lookup_plan(5, **kw)), Engine(make_plan(draft_tokens=0, **kw))
    eng.choice.adaptive = False
    prompts = [(1, 2, 3) * 3 + (1,), (5, 6) * 8]

    def both(e: Engine) -> list[list[int]]:
        handles = [e.submit(Request(p, 96)) for p in prompts]
        while e.step():
            pass
        return [[t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in handles]

    seen = launches(eng)
    texts = both(eng)
    assert texts == both(plain)
    chained = [f for job, after, f in seen if job.kind == "serial" and after and f.spec is not None]
    assert len(chained) >= 8, f"{len(chained)} serial windows chained behind one decided on the device"
    text = dict(enumerate(list(p) + t for p, t in zip(prompts, texts, strict=True)))  # slot i: request i
    for flight in chained:
        spec = flight.spec
        for i, sid in enumerate(spec.slots):
            rows = spec.host["tokens"][i * spec.n : (i + 1) * spec.n].tolist()
            at = int(spec.host["positions"][i * spec.n])
            want = TextLookup(text[sid][: at + 1], 2, 4).propose(spec.n - 1) or [text[sid][at]] * (spec.n - 1)
            assert rows == [text[sid][at], *want], f"slot {sid}'s rows at position {at}"


@pytest.mark.parametrize("lookup_first", [True, False])
def test_arms_drafting_by_lookup_and_by_the_mtp_head_share_one_copy_of_the_weights(lookup_first) -> None:
    """Bench arms of one profile that differ in how they draft (``--vary spec.method=mtp,ngram``) hold the
    main weights once: the arm with the MTP head adds the head's tensors to the shared ones, whichever arm
    is built first, and the device's cap grows by their size. Each arm's greedy text is its own engine's
    alone (and the text without drafting)."""
    from strata_runtime.model.placed import WeightStore

    kw = {"stages": 2, "context": 192, "prefill_chunk": 16}
    plans = [lookup_plan(5, **kw), make_plan(draft_tokens=5, **kw)]
    if not lookup_first:
        plans.reverse()
    store = WeightStore()
    engines = [Engine(plan, weights=store) for plan in plans]
    assert len(store.stages) == 2  # one entry a stage, not one a stage and arm
    lookup, mtp = engines if lookup_first else engines[::-1]
    for a, b in zip(lookup.model.stages, mtp.model.stages, strict=True):
        assert a.shared is b.shared
    assert mtp.model.mtp is not None and lookup.model.mtp is None
    tensors = mtp.model.stages[-1].shared.tensors
    head = sum(int(t.nbytes) for name, t in tensors.items() if name.startswith("mtp."))
    assert head > 0
    budgets = [plan.gpus[-1].budget for plan in plans]
    adds = budgets[1].kv + budgets[1].drafters + budgets[1].workspace
    first = budgets[0].total - budgets[0].reserve
    assert store.limits["cpu:1"] == first + adds + (head if lookup_first else 0)
    prompt = (*LOOP * 3, 40, 114, 41)
    plain = generate(engine(0, 2, False), prompt, 40)
    assert generate(lookup, prompt, 40) == plain and generate(mtp, prompt, 40) == plain
