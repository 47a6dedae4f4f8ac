"""Generated tokens' log-probabilities (`SamplingParams.logprobs`): the model's own, before any adjustment, in
every window mode.

A token's log-probability is checked against the prefill path's on the same text: a fresh request whose
prompt is the text up to that token, forced to that token by a logit bias of +100, must report the same
figure, since the bias is not part of the raw logits the figure comes from. That holds for greedy and sampled
requests, in drafted windows (where a kept token may be a proposal or the token after them) and in windows
decided on the device.
"""

from __future__ import annotations

import numpy as np
import pytest
from rt_engine_helpers import MODES, mode_plan

from strata_runtime.api import Request, SamplingParams, TokenEvent
from strata_runtime.engine import Engine

PROMPT = (72, 101, 108, 108, 111, 44, 32)


def run(eng: Engine, request: Request) -> list[TokenEvent]:
    handle = eng.submit(request)
    events: list[TokenEvent] = []
    while not events or events[-1].finished is None:
        eng.step()
        while not handle.events.empty():
            events.append(handle.events.get())
    assert events[-1].error is None, events[-1].error
    return events


def tokens_and_logprobs(events: list[TokenEvent], asked: bool = True) -> tuple[list[int], list]:
    for ev in events:
        if not asked:
            assert ev.logprobs == ()
            continue
        assert len(ev.logprobs) == len(ev.token_ids), "one figure per emitted token, in every event"
        assert [lp.token for lp in ev.logprobs] == list(ev.token_ids)
    return [t for ev in events for t in ev.token_ids], [lp for ev in events for lp in ev.logprobs]


def prefill_logprob(eng: Engine, text: list[int], token: int, top: int) -> tuple[float, tuple]:
    """``token``'s log-probability after ``text``, read by a one-token request forced to it by a bias."""
    params = SamplingParams(logit_bias=((token, 100.0),), logprobs=top)
    events = run(eng, Request(prompt_ids=tuple(text), max_tokens=1, sampling=params, ignore_eos=True))
    got, lps = tokens_and_logprobs(events)
    assert got == [token]
    return lps[0].logprob, lps[0].top


ADJUSTED = {"presence_penalty": 1.0, "frequency_penalty": 0.5, "logit_bias": ((101, 4.0),)}
"""A penalty and a bias, which the device applies in place to the rows of windows it decides."""


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("adjusted", [False, True], ids=["plain", "penalised"])
def test_each_tokens_logprob_is_the_prefill_paths_for_the_same_text(mode, stages, temperature, adjusted):
    eng = Engine(mode_plan(mode, stages))
    params = SamplingParams(temperature=temperature, seed=7, logprobs=3, **(ADJUSTED if adjusted else {}))
    events = run(eng, Request(prompt_ids=PROMPT, max_tokens=10, sampling=params, ignore_eos=True))
    tokens, lps = tokens_and_logprobs(events)
    assert len(tokens) == 10
    for j, (token, lp) in enumerate(zip(tokens, lps, strict=True)):
        expected, top = prefill_logprob(eng, [*PROMPT, *tokens[:j]], token, 3)
        assert lp.logprob == pytest.approx(expected, abs=1e-5), f"token {j}"
        assert [t for t, _ in lp.top] == [t for t, _ in top]
        np.testing.assert_allclose([v for _, v in lp.top], [v for _, v in top], atol=1e-5)
        assert lp.logprob <= 0.0
        assert len(lp.top) == 3
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert sum(np.exp(values)) <= 1.0 + 1e-9
        if temperature == 0.0 and not adjusted:  # greedy: the token is the most likely one
            assert lp.top[0] == (token, lp.logprob)
        else:
            assert lp.logprob <= lp.top[0][1]


def test_logprobs_do_not_change_the_tokens_and_are_the_same_in_every_mode():
    reference = None
    for mode in MODES:
        for ask in (None, 2):
            eng = Engine(mode_plan(mode, 2))
            params = SamplingParams(temperature=0.0, logprobs=ask)
            events = run(eng, Request(prompt_ids=PROMPT, max_tokens=12, sampling=params))
            tokens, lps = tokens_and_logprobs(events, asked=ask is not None)
            if ask is None:
                plain = tokens
                continue
            assert tokens == plain, f"{mode}: asking for logprobs changed the reply"
            figures = [(lp.token, lp.logprob, lp.top) for lp in lps]
            if reference is None:
                reference = figures
                continue
            assert [f[0] for f in figures] == [f[0] for f in reference], mode
            np.testing.assert_allclose([f[1] for f in figures], [f[1] for f in reference], atol=1e-5)


def test_a_stop_token_and_max_tokens_drop_their_logprobs_with_the_tokens():
    eng = Engine(mode_plan("batch-mtp", 1))
    greedy = SamplingParams(logprobs=0)
    tokens, _ = tokens_and_logprobs(run(eng, Request(prompt_ids=PROMPT, max_tokens=8, sampling=greedy)))
    stop = tokens[3]
    cut = tokens.index(stop)
    events = run(eng, Request(prompt_ids=PROMPT, max_tokens=8, sampling=greedy, stop_ids=(stop,)))
    got, lps = tokens_and_logprobs(events)
    assert got == tokens[:cut] and len(lps) == cut
    assert events[-1].finished == "stop"
    got, lps = tokens_and_logprobs(run(eng, Request(prompt_ids=PROMPT, max_tokens=2, sampling=greedy)))
    assert len(got) == len(lps) == 2
    assert all(lp.top == () for lp in lps)  # 0 alternatives asked


def test_penalties_and_bias_leave_the_logprobs_raw():
    eng = Engine(mode_plan("solo", 1))
    raw = SamplingParams(logprobs=1)
    tokens, lps = tokens_and_logprobs(run(eng, Request(prompt_ids=PROMPT, max_tokens=6, sampling=raw)))
    banned = tokens[0]
    adjusted = SamplingParams(logprobs=1, logit_bias=((banned, -100.0),), presence_penalty=1.5)
    events = run(eng, Request(prompt_ids=PROMPT, max_tokens=6, sampling=adjusted))
    got, adj = tokens_and_logprobs(events)
    assert got[0] != banned
    # The most likely token at the first place is still the banned one: the figures are the model's own.
    assert adj[0].top[0] == lps[0].top[0]


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("chunk", [8, 64])
def test_each_prompt_tokens_logprob_is_that_of_the_prompt_cut_before_it(stages, chunk):
    """Prompt log-probabilities come with the first token, one per prompt token after the first, each what a
    request whose prompt ends just before that token reports for it; across prefill chunks too."""
    eng = Engine(mode_plan("batch-mtp", stages, prefill_chunk=chunk))
    prompt = (*PROMPT, 87, 111, 114, 108, 100, 32, 111, 102, 32, 116, 101, 120, 116)  # 20: three chunks of 8
    params = SamplingParams(prompt_logprobs=2)
    events = run(eng, Request(prompt_ids=prompt, max_tokens=3, sampling=params))
    first = [ev for ev in events if ev.token_ids][0]
    assert all(ev.prompt_logprobs == () for ev in events if ev is not first)
    got = first.prompt_logprobs
    assert [lp.token for lp in got] == list(prompt[1:])
    for j, lp in enumerate(got, start=1):
        expected, top = prefill_logprob(eng, list(prompt[:j]), prompt[j], 2)
        assert lp.logprob == pytest.approx(expected, abs=1e-5), f"prompt token {j}"
        assert [t for t, _ in lp.top] == [t for t, _ in top]
    assert tokens_and_logprobs(events, asked=False)[1] == []  # generated tokens' figures not asked


@pytest.mark.parametrize("mode", ["serial", "batch-mtp", "pipelined-mtp"])
def test_requests_sharing_windows_each_get_their_own_rows_figures(mode):
    """Three greedy requests at once, two asking (different prompts, one penalised), share windows: each one's
    figures are what it gets alone, and the one that did not ask gets none."""
    asks = [
        Request(prompt_ids=PROMPT, max_tokens=9, sampling=SamplingParams(logprobs=2), ignore_eos=True),
        Request(prompt_ids=(80, 114, 105, 100, 101), max_tokens=9, ignore_eos=True),
        Request(
            prompt_ids=(83, 101, 110, 115, 101),
            max_tokens=9,
            sampling=SamplingParams(presence_penalty=1.0, logprobs=1),
            ignore_eos=True,
        ),
    ]
    alone = [
        tokens_and_logprobs(run(Engine(mode_plan(mode, 2)), r), r.sampling.logprobs is not None) for r in asks
    ]
    eng = Engine(mode_plan(mode, 2))
    handles = [eng.submit(r) for r in asks]
    events: list[list[TokenEvent]] = [[] for _ in asks]
    while eng.step():
        for h, evs in zip(handles, events, strict=True):
            while not h.events.empty():
                evs.append(h.events.get())
    for h, evs in zip(handles, events, strict=True):
        while not h.events.empty():
            evs.append(h.events.get())
    assert eng.totals["windows"] < sum(len(t) for t, _ in alone), "the requests shared windows"
    for r, evs, (tokens, lps) in zip(asks, events, alone, strict=True):
        got, got_lps = tokens_and_logprobs(evs, r.sampling.logprobs is not None)
        assert got == tokens
        assert [(lp.token, [t for t, _ in lp.top]) for lp in got_lps] == [
            (lp.token, [t for t, _ in lp.top]) for lp in lps
        ]
        np.testing.assert_allclose([lp.logprob for lp in got_lps], [lp.logprob for lp in lps], atol=1e-5)
