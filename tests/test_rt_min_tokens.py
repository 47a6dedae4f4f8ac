"""``min_tokens`` (vLLM's): no stop token is chosen, and no stop string ends the reply, before the reply has
that many tokens. The host chooses those tokens with the stop tokens masked (`Sampler.holding_stops`), in
every window mode; from there on the request runs as any other."""

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


def test_rows_short_of_min_tokens_lose_the_stop_tokens_and_the_host_chooses_them() -> None:
    """Row j of a window follows the proposals before it: it is the reply's token ``generated + j``, and
    only rows short of ``min_tokens`` are masked. The host chooses until the reply reaches it; a request with
    no stop token to hold off (``ignore_eos``, no stop ids) is not held."""
    sampler = Sampler(SamplingParams(min_tokens=3), seed=0, stops=[2, 5])
    assert sampler.host_only and sampler.needs_logits
    logits = np.arange(24, dtype=np.float32).reshape(3, 8)
    out = sampler.adjusted(logits, [1, 4])
    assert np.isneginf(out[:, [2, 5]]).all() and np.array_equal(
        out[:, [0, 1, 3, 4, 6, 7]], logits[:, [0, 1, 3, 4, 6, 7]]
    )
    sampler.record([7])
    out = sampler.adjusted(logits, [1, 4])  # rows are the reply's tokens 1, 2 and 3
    assert np.isneginf(out[:2, [2, 5]]).all() and np.array_equal(out[2], logits[2])
    sampler.record([7, 7])
    assert not sampler.holding_stops and not sampler.host_only and not sampler.needs_logits
    assert np.array_equal(sampler.adjusted(logits, [1, 4]), logits)
    assert not Sampler(SamplingParams(min_tokens=3), seed=0).host_only  # nothing to hold off


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
    if not temperature:  # (a sampled request draws its numbers in another order when the host chooses)
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
    if not temperature:
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
