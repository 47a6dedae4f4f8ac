"""A prompt's first token is the device's choice, for sampled and penalised requests as for greedy ones.

The last row of a prompt decides the reply's first token. The device chooses it as it chooses a decode row's
(`Entry.on_device`): after the request's logit bias and penalties (counted there from then on), at a uniform
the host drew at launch, so the host reads one token instead of a row of logits and computes nothing. Under a
grammar the row is masked to the tokens it allows (`Entry.masked`), penalised or not. These tests hold that
no prompt's last row is read as logits by the host, and that every reply is the one the host's own choice of
that token gives: the same seeded text, token for token, in every window mode on one and two stages.
"""

from __future__ import annotations

import functools

import pytest
from rt_engine_helpers import MODES, collect, collect_launched, mode_plan, run_script

from strata_runtime.api import Request, SamplingParams
from strata_runtime.engine import Engine

KINDS: dict[str, SamplingParams] = {
    "sampled": SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=11),
    "greedy, penalised": SamplingParams(
        repetition_penalty=1.4, presence_penalty=0.7, logit_bias=((40, 3.0),)
    ),
    "sampled, penalised, min_tokens": SamplingParams(
        temperature=0.8, frequency_penalty=1.5, repetition_penalty=1.2, min_tokens=6, seed=3
    ),
    "sampled, min-p": SamplingParams(temperature=1.2, min_p=0.05, seed=8),
    "grammar, penalised": SamplingParams(
        grammar="start: /[ab]+c/", frequency_penalty=0.9, presence_penalty=0.4
    ),
    "grammar, sampled": SamplingParams(grammar="start: /[ab]+c/", temperature=0.7, seed=4),
}


@functools.cache
def engine(mode: str, stages: int, on_device: bool) -> Engine:
    eng = Engine(mode_plan(mode, stages, preset="tiny", context=128, prefill_chunk=16))
    eng.first_tokens_on_device = on_device  # off: the host chooses them, from their rows' logits
    return eng


def requests(salt: int) -> list[tuple[int, Request]]:
    """One request of each kind, at staggered steps, with prompts of one and of several chunks."""
    out = []
    for i, (name, sampling) in enumerate(KINDS.items()):
        prompt = tuple(32 + (11 * j + 7 * i + salt) % 90 for j in range(5 + 9 * i))
        out.append((i % 3, Request(prompt, 12, sampling, request_id=f"{name} {salt}")))
    return out


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_first_token_is_chosen_on_the_device_as_the_host_would_choose_it(mode, stages):
    schedule = requests(salt=stages)
    replies, seen = collect_launched(engine(mode, stages, on_device=True), schedule)
    prompt_ends = [(job, flight) for job, _, flight in seen if any(e.ends_prompt for e in job.entries)]
    assert len(prompt_ends) >= 1
    ends = [e for job, _ in prompt_ends for e in job.entries if e.ends_prompt]
    assert len(ends) == len(schedule), "each prompt ends once"
    assert all(e.chosen_on_device for e in ends), "every first token is the device's choice"
    assert all(flight.logits is None for _, flight in prompt_ends), "no prompt's logits reach the host"
    grammar = [e for e in ends if e.slot.sampler.grammar is not None]
    assert grammar and all(e.masked for e in grammar), "under a grammar, penalised or not, the row is masked"

    reference, seen = collect_launched(engine(mode, stages, on_device=False), schedule)
    read = [flight for job, _, flight in seen if any(e.ends_prompt for e in job.entries)]
    assert all(flight.logits is not None for flight in read), "the host chose from the logits"
    assert replies == reference
    assert all(len(r) >= 6 for r in replies[2:3]), "min_tokens holds from the first token on"


@pytest.mark.parametrize("mode", ["solo", "serial"])
def test_the_first_token_counts_once_for_the_penalties(mode) -> None:
    """A bias of 100 on one token against a frequency penalty of 60: it comes while counted once at most, so
    exactly twice in a row from the first token on. Counted twice for the first token (by the device and
    again by the host) it would come once; not counted there, three times."""
    sampling = SamplingParams(logit_bias=((40, 100.0),), frequency_penalty=60.0)
    schedule = [(0, Request(tuple(range(50, 70)), 8, sampling))]
    (reply,) = collect(engine(mode, 1, on_device=True), schedule)
    assert reply[:3].count(40) == 2 and reply[:2] == [40, 40], reply
    assert [reply] == collect(engine(mode, 1, on_device=False), schedule)


def test_the_first_token_bench_times_both_choices_of_every_request_on_the_demo_profile() -> None:
    """`scripts/bench_first_token.py`: every request's first token chosen on the device and by the host, the
    same token in each pair (the script exits non-zero otherwise), with a time for each."""
    import json

    result = json.loads(
        run_script("bench_first_token.py", "--prompt-tokens", "20", "--repeats", "1", "--json")
    )
    assert result["prompt_tokens"] == 20
    names = [r["request"] for r in result["rows"]]
    assert names[0] == "greedy" and len(names) == 4 and any("top-p" in n for n in names)
    assert all(r["device_ms"] > 0 and r["host_ms"] > 0 for r in result["rows"])
