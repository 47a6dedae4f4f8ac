"""Any prompt length, any temperature, any window mode: every request gets a reply and the engine stays up.

A prompt longer than one prefill chunk is read in several chunks; only the last decides a token. With a
sampled request in the window, the chunks before the last have no logits at all, which once crashed the
engine. These tests read prompts of one to several chunks, greedy and sampled, in every window mode on one to
three virtual CPU stages, with other requests decoding beside them.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rt_engine_helpers import MODES, mode_plan

from strata_runtime.api import Request, SamplingParams
from strata_runtime.engine import Engine

CHUNK = 8


@functools.cache
def engine(stages: int, mode: str) -> Engine:
    return Engine(mode_plan(mode, stages, preset="tiny", context=96, prefill_chunk=CHUNK))


def run(eng: Engine, requests: list[Request]) -> list[tuple[list[int], str | None, str | None]]:
    """Submit every request at once and step until all finish: (tokens, finish reason, error) for each."""
    handles = [eng.submit(r) for r in requests]
    out: list[tuple[list[int], str | None, str | None]] = [([], None, None) for _ in requests]
    for _ in range(5_000):
        if all(o[1] is not None for o in out):
            break
        eng.step()
        for i, h in enumerate(handles):
            while not h.events.empty():
                ev = h.events.get()
                tokens, _, _ = out[i]
                out[i] = (tokens + list(ev.token_ids), ev.finished, ev.error)
    assert all(o[1] is not None for o in out), "every request finished"
    assert all(s is None for s in eng.slots), "every slot is released"
    return out


def prompt(length: int, salt: int = 0) -> tuple[int, ...]:
    return tuple(32 + (7 * i + 13 * salt) % 90 for i in range(length))


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_sampled_prompt_of_several_chunks_gets_a_reply_in_every_mode(stages, mode) -> None:
    eng = engine(stages, mode)
    sampled = SamplingParams(temperature=1.0, seed=5)
    requests = [
        Request(prompt(5 * CHUNK + 3), 4, sampled, request_id="long-sampled"),  # six chunks, last partial
        Request(prompt(2 * CHUNK, 1), 3, SamplingParams(temperature=0.7, seed=9), request_id="exact"),
        Request(prompt(3, 2), 5, request_id="short-greedy"),  # decodes beside the long prompts
    ]
    for tokens, reason, error in run(eng, requests):
        assert error is None, error
        assert reason == "length"
        assert tokens
    # The engine is still up: a later request in the same engine is served as well.
    [(tokens, reason, error)] = run(eng, [Request(prompt(CHUNK + 1, 3), 2, sampled)])
    assert error is None and reason == "length" and len(tokens) == 2


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stages=st.integers(1, 3),
    mode=st.sampled_from(list(MODES)),
    lengths=st.lists(st.integers(1, 5 * CHUNK + 1), min_size=1, max_size=4),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    max_tokens=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
@example(stages=2, mode="pipelined", lengths=[CHUNK + 1], temperature=1.0, max_tokens=4, seed=1)
@example(stages=1, mode="batch-mtp", lengths=[3 * CHUNK, 1], temperature=0.3, max_tokens=2, seed=2)
@example(stages=2, mode="pipelined-mtp", lengths=[2 * CHUNK + 1, 3], temperature=0.3, max_tokens=5, seed=3)
def test_any_prompt_length_temperature_and_mode_gets_a_reply(
    stages, mode, lengths, temperature, max_tokens, seed
) -> None:
    eng = engine(stages, mode)
    requests = [
        Request(prompt(n, i), max_tokens, SamplingParams(temperature=temperature, seed=seed + i))
        for i, n in enumerate(lengths)
    ]
    for tokens, reason, error in run(eng, requests):
        assert error is None, error
        assert reason in ("length", "stop")
        assert 1 <= len(tokens) <= max_tokens or reason == "stop"


@pytest.mark.parametrize("mode", list(MODES))
def test_a_top_k_past_the_vocabulary_cuts_nothing_and_fits_the_devices_arrays(mode) -> None:
    """A top-k larger than any 64-bit integer (the schema takes any whole number) is a cut that keeps every
    token: the replies are those of no cut, seeded, in every mode, and the engine's step does not fail on
    it (its device arrays once overflowed)."""
    eng = engine(2, mode)
    cuts = [SamplingParams(temperature=1.0, top_k=k, seed=7) for k in (2**70, 0, 384)]
    replies = [run(eng, [Request(prompt(11, 4), 6, s, request_id=f"k{i}")]) for i, s in enumerate(cuts)]
    assert replies[0] == replies[1] == replies[2]
    assert replies[0][0][2] is None and len(replies[0][0][0]) >= 1
