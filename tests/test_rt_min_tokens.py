"""``min_tokens`` (vLLM's): no stop token is chosen, and no stop string ends the reply, before the reply has
that many tokens. Those tokens are chosen with the stop tokens masked (`Sampler.holding_stops`), on the
device as any biased request's are, with windows running ahead up to the ``min_tokens``-th token and not past
it; in every window mode the text is the text of windows one at a time, and from there on the request runs as
any other."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from rt_engine_helpers import MODES, collect, mode_plan

from strata_runtime.api import Request, SamplingParams, request_problem
from strata_runtime.engine import Engine
from strata_runtime.engine.sampling import Sampler
from strata_runtime.engine.stops import StopText

A = 65
"""Token `A` of the demo models' byte-level vocabulary: not an end-of-text token."""


@functools.cache
def engine(mode: str, stages: int) -> Engine:
    return Engine(mode_plan(mode, stages, context=160, prefill_chunk=16))


def run(eng: Engine, request: Request) -> tuple[list[int], str | None, str | int | None, str]:
    """One request to its end: its tokens, how it finished, what stopped it and its text."""
    h = eng.submit(request)
    while eng.step():
        pass
    tokens: list[int] = []
    finished = stop = None
    text = ""
    while not h.events.empty():
        ev = h.events.get()
        assert ev.error is None, ev.error
        tokens += ev.token_ids
        text += ev.text
        finished, stop = ev.finished or finished, ev.stop if ev.finished else stop
    return tokens, finished, stop, text


def test_rows_short_of_min_tokens_lose_the_stop_tokens_on_the_host_and_the_device() -> None:
    """Row j of a window follows the proposals before it: it is the reply's token ``generated + j``, and
    only rows short of ``min_tokens`` are masked. The device adds minus infinity to the stop tokens through
    the request's bias until the reply reaches ``min_tokens``, where windows wait for the host (`hold_at`)
    and the bias starts afresh without the ban; a request with no stop token to hold off (``ignore_eos``, no
    stop ids) is not held."""
    sampler = Sampler(SamplingParams(min_tokens=3, logit_bias=((5, 2.5), (6, -1.0))), seed=0, stops=[2, 5])
    assert not sampler.host_only and sampler.adjusts and sampler.needs_logits and sampler.hold_at == 3
    ids, values = sampler.device_bias()
    assert dict(zip(ids.tolist(), values.tolist(), strict=True)) == {6: -1.0, 2: -np.inf, 5: -np.inf}
    logits = np.arange(24, dtype=np.float32).reshape(3, 8)
    out = sampler.adjusted(logits, [1, 4])
    assert np.isneginf(out[:, [2, 5]]).all() and np.array_equal(out[:, 6], logits[:, 6] - 1.0)
    assert np.array_equal(out[:, [0, 1, 3, 4, 7]], logits[:, [0, 1, 3, 4, 7]])
    assert sampler.device_update()[0]  # the device's first window: its bias (with the ban) is sent
    sampler.record([7])
    out = sampler.adjusted(logits, [1, 4])  # rows are the reply's tokens 1, 2 and 3
    assert np.isneginf(out[:2, [2, 5]]).all()
    assert out[2, 2] == logits[2, 2] and out[2, 5] == logits[2, 5] + 2.5
    assert sampler.on_device and sampler.hold_at == 3
    sampler.record([7, 7])
    assert not sampler.holding_stops and sampler.hold_at is None and not sampler.on_device
    ids, values = sampler.device_bias()  # the request's own bias again, sent afresh with the counts
    assert dict(zip(ids.tolist(), values.tolist(), strict=True)) == {5: 2.5, 6: -1.0}
    assert sampler.device_update() == (True, {7: 3})
    plain = Sampler(SamplingParams(min_tokens=2), seed=0, stops=[2])
    assert plain.adjusts and plain.hold_at == 2
    plain.record([7, 7])
    assert not plain.adjusts and not plain.needs_logits and plain.hold_at is None
    assert np.array_equal(plain.adjusted(logits, [1, 4]), logits)
    assert not Sampler(SamplingParams(min_tokens=3), seed=0).adjusts  # nothing to hold off


def test_a_stop_string_counts_only_where_it_ends_past_the_held_text() -> None:
    """Held, no stop string ends the reply and text that may begin one is still held back; armed at a
    character count, a stop string counts only where it ends past it, even in text that arrived before."""
    stops = StopText(("ab",), held=True)
    assert stops.feed("xxab") == "xxab" and not stops.stopped  # (a complete one is no beginning)
    assert stops.feed("a") == "" and stops.pending == "a"  # may begin "ab": held back
    stops.arm(5)
    assert stops.feed("bab") == "" and stops.hit == "ab" and stops.end == 6  # begun in the held text
    early = StopText(("ab",), held=True)
    assert early.feed("xa") == "x"
    early.arm(2)
    assert early.feed("b") == "" and early.end == 3  # ends past 2 characters: it counts
    late = StopText(("ab",), held=True)
    late.feed("xab")
    late.arm(3)
    assert late.feed("yy") == "yy" and not late.stopped  # ends at 3, within: it does not


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize(("mode", "stages"), [("solo", 1), ("serial", 2), ("batch-mtp", 1), ("pipelined", 2)])
def test_min_tokens_holds_off_an_end_of_text_the_model_is_pushed_to(mode, stages, temperature) -> None:
    """A logit bias of 100 makes end-of-text (or a request's stop token) the first choice: with
    ``min_tokens`` the reply has exactly that many tokens, the ones it has with the stop banned, then stops
    at it; without, it is empty. In every window mode, greedy and sampled, next to a plain request."""
    eng = engine(mode, stages)
    eos = min(eng.tokenizer.eos_ids)
    seeded = {"temperature": temperature, "seed": 9}
    pushed = SamplingParams(logit_bias=((eos, 100.0),), min_tokens=6, **seeded)
    banned = SamplingParams(logit_bias=((eos, -1e30),), **seeded)
    prompt = tuple(b"Once upon a time")
    tokens, finished, stop, _ = run(eng, Request(prompt, 30, pushed))
    assert len(tokens) == 6 and eos not in tokens and (finished, stop) == ("stop", eos)
    free, *_ = run(eng, Request(prompt, 6, banned))
    if not temperature or mode not in ("solo", "batch-mtp"):
        # Held on the device as a ban by a bias is, with the same draws; a sampled request that drafts draws
        # by its windows' shapes, which the hold shortens near min_tokens.
        assert tokens == free
    assert run(eng, Request(prompt, 30, SamplingParams(logit_bias=((eos, 100.0),), **seeded)))[:2] == (
        [],
        "stop",
    )
    own = SamplingParams(logit_bias=((A, 100.0),), min_tokens=4, **seeded)
    at_own, finished, stop, _ = run(eng, Request(prompt, 30, own, stop_ids=(A,), ignore_eos=True))
    assert len(at_own) == 4 and A not in at_own and (finished, stop) == ("stop", A)
    side = collect(
        eng, [(0, Request(prompt, 12, pushed)), (0, Request(tuple(b"Another"), 12, ignore_eos=True))]
    )
    assert len(side[0]) == 6 and eos not in side[0] and len(side[1]) == 12
    if not temperature or mode not in ("solo", "batch-mtp"):
        assert side[0] == tokens


@pytest.mark.parametrize("mode", sorted(set(MODES) - {"pipelined-mtp"}))
def test_min_tokens_holds_off_a_stop_string_within_its_tokens_text(mode) -> None:
    """A stop string that occurs in the text of the first ``min_tokens`` tokens does not end the reply; its
    first occurrence ending past that text does, cut where it begins."""
    eng = engine(mode, 1)
    prompt = tuple(b"The quick brown fox")
    plain, _, _, text = run(eng, Request(prompt, 40, ignore_eos=True))
    least = 3
    held = len(eng.tokenizer.decode(plain[:least]))
    stop = text[held - 1]  # the held text's last character, which occurs again later
    later = text.find(stop, held)
    assert later >= held, "the plain reply repeats its character"
    request = Request(prompt, 40, SamplingParams(min_tokens=least), stop_strings=(stop,), ignore_eos=True)
    tokens, finished, got_stop, got = run(eng, request)
    assert (got, finished, got_stop) == (text[:later], "stop", stop)
    unheld = run(eng, Request(prompt, 40, stop_strings=(stop,), ignore_eos=True))[3]
    assert unheld == text[: text.find(stop)] and len(unheld) < held


def test_min_tokens_past_max_tokens_is_refused_by_name() -> None:
    problem = request_problem(Request((1, 2), 5, SamplingParams(min_tokens=6)))
    assert problem is not None and problem.startswith("min_tokens:")
    assert request_problem(Request((1, 2), 5, SamplingParams(min_tokens=5))) is None
    for bad, field in (
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(min_p=-0.1), "min_p"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(repetition_penalty=float("nan")), "repetition_penalty"),
        (SamplingParams(min_tokens=-1), "min_tokens"),
    ):
        problem = request_problem(Request((1, 2), 5, bad))
        assert problem is not None and problem.startswith(field + ":"), (bad, problem)


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("draft_tokens", [0, 4])
def test_held_tokens_are_chosen_on_the_device_running_ahead_up_to_min_tokens(stages, draft_tokens) -> None:
    """End-of-text pushed by a bias of 100, with ``min_tokens`` of 3, 7 and 11: windows (serial, or solo
    windows drafting and decided on the device) run ahead with the stop token banned on the device, up to
    the reply's ``min_tokens``-th token and never past it, where the host lets it back. Each reply has
    exactly ``min_tokens`` tokens, then stops; the text is the text of windows one at a time."""
    from test_rt_run_ahead import PROMPTS, Spy
    from test_rt_run_ahead import engine as run_ahead_engine

    least = [3, 7, 11]

    def ahead_engine(stages: int, slots: int, run_ahead: int, draft_tokens: int) -> Engine:
        # Drafting windows carry all their proposals (the adaptive depth follows measured times).
        return run_ahead_engine(
            stages, slots, run_ahead, draft_tokens, adaptive_depth=False if draft_tokens else None
        )

    def requests(eng: Engine) -> list[tuple[int, Request]]:
        eos = min(eng.tokenizer.eos_ids)
        return [
            (at, Request(tuple(PROMPTS[i]), 24, SamplingParams(logit_bias=((eos, 100.0),), min_tokens=n)))
            for i, (at, n) in enumerate(zip([0, 0, 2], least, strict=True))
        ]

    slots = 1 if draft_tokens else 3
    one_at_a_time = ahead_engine(stages, slots, 1, draft_tokens)
    base = collect(one_at_a_time, requests(one_at_a_time))
    eng = ahead_engine(stages, slots, 3, draft_tokens)
    eos = min(eng.tokenizer.eos_ids)
    spy = Spy(eng)
    got = collect(eng, requests(eng))
    assert got == base
    assert [len(tokens) for tokens in got] == least and all(eos not in tokens for tokens in got)
    assert spy.chained  # windows ran ahead while the stop token was held off
    if draft_tokens:
        assert any(e.proposals.tokens for job in spy.chained for e in job.entries if job.spec_on_device)


def test_under_a_grammar_the_stop_tokens_are_held_off_by_its_masks_which_give_way_to_an_end() -> None:
    """A grammar's rows short of ``min_tokens`` lose the stop tokens in their masks (`HoldStops`), counted
    as the place moves; where the grammar allows nothing but an end, its mask stands, and the reply ends
    there complete rather than with nothing to choose."""
    from strata_runtime.engine.sampling import HoldStops
    from strata_runtime.masks import Place, mask_width

    vocab = 40

    class Two(Place):
        """Allows {1, 2} for its first two tokens, then only the end (2)."""

        holds_think = True
        finished = False
        width = mask_width(vocab)

        def __init__(self, count: int = 0) -> None:
            self.count = count

        def _packed(self) -> np.ndarray:
            bits = np.zeros(mask_width(vocab), np.uint32)
            for t in (1, 2) if self.count < 2 else (2,):
                bits[0] |= np.uint32(1 << t)
            return bits

        def _move(self, token):
            self.count += 1

        def copy(self):
            return Two(self.count)

        def forced(self, most):
            return [1, 2][:most]

        def ends_within(self, tokens):
            return None

        def accept(self, tokens):
            self.count += len(list(tokens))

    held = HoldStops(Two(), np.array([2, 7]), least=3)

    def allows(bits: np.ndarray) -> set[int]:
        return {t for t in range(vocab) if bits[t // 32] >> np.uint32(t % 32) & np.uint32(1)}

    assert [allows(r) for r in held.bitmasks_after([1, 1])] == [{1}, {1}, {2}]  # the third: the end alone
    assert held.forced(2) == [1]  # the end the grammar forces second is held off
    ahead = held.copy()
    ahead.bitmask_after(1)
    assert allows(ahead.bitmask_after(1)) == {2} and held.count == 0
    held.accept([1, 1, 2])
    assert allows(held.bitmask_last([])[0]) == {2} and held.count == 3
    sampler = Sampler(SamplingParams(min_tokens=3), seed=0, grammar=Two(), stops=[2])
    assert isinstance(sampler.grammar, HoldStops) and not sampler.holding_stops and not sampler.adjusts
    eng = engine("serial", 1)
    for n in (2, 6):  # the grammar's text is whole after 2 tokens: min_tokens past it gives way
        sampling = SamplingParams(grammar="start: /ab/", min_tokens=n)
        tokens, finished, _, text = run(eng, Request(tuple(b"Say ab:"), 20, sampling))
        assert (text, finished) == ("ab", "stop")
    eos = min(eng.tokenizer.eos_ids)
    for mode, stages in (("serial", 1), ("solo", 1), ("batch-mtp", 1)):  # an end pushed to the top: held
        pushed = SamplingParams(grammar="start: /[ab]+/", logit_bias=((eos, 100.0),), min_tokens=5)
        tokens, finished, stop, text = run(engine(mode, stages), Request(tuple(b"Say ab:"), 20, pushed))
        assert len(tokens) == 5 and set(text) <= {"a", "b"} and (finished, stop) == ("stop", eos)


def test_requests_that_would_leave_nothing_to_choose_are_refused_by_name() -> None:
    eng = engine("serial", 1)
    eos = min(eng.tokenizer.eos_ids)
    held = Request(tuple(b"x"), 8, SamplingParams(min_tokens=2, allowed_token_ids=(eos, A)), stop_ids=(A,))
    banned = Request(tuple(b"x"), 8, SamplingParams(allowed_token_ids=(A, A + 1), bad_words=("A", "B")))
    for request, text in (
        (held, "min_tokens: every token allowed_token_ids allows ends the reply"),
        (banned, "bad_words: they ban every token allowed_token_ids allows"),
    ):
        ev = eng.submit(request).events.get()
        assert ev.finished == "error" and ev.error is not None and ev.error.startswith(text), ev.error
