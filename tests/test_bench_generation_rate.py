"""The bench's generation rate: tokens after each stream's first, per second from the first token on, the
figure llama.cpp's batched benchmark reports for decoding (S_TG), computed the same in process and over
HTTP."""

from __future__ import annotations

import pytest
from rt_engine_helpers import mode_plan

from strata_cfg.schema.workloads import GENERATING, delivery_gaps, gap_figures_ms, generation_rate
from strata_runtime.api import Request
from strata_runtime.bench.harness import Arrival, InProcessDriver, Result, measure
from strata_runtime.engine import Engine

STATS = {"ms_per_window": 1.0, "rows_per_window": 1.0, "accepted": 0, "proposals": 0}


def test_it_counts_every_token_but_each_streams_first_from_the_earliest_first_token() -> None:
    # 4 + 2 tokens after the first ones, between 1.0 (the earliest first token) and 3.0 (the last finish);
    # a stream of one token and one that produced nothing add neither tokens nor time.
    streams = [(5, 1.0, 3.0), (3, 1.5, 2.0), (1, 0.5, 4.0), (0, None, 5.0)]
    assert generation_rate(streams) == pytest.approx(6 / 2.0)
    assert generation_rate([(1, 0.2, 0.3)]) == 0.0
    assert generation_rate([]) == 0.0


def test_the_harness_reports_it_for_the_decoding_workloads_only() -> None:
    results = [Result(list(range(9)), 4, 0.0, 0.5, 2.5, 0, 0), Result(list(range(5)), 4, 0.0, 0.5, 1.5, 0, 0)]
    for name in ("clients", "two-decodes"):
        figures = measure(name, results, STATS, wall=2.5)
        assert figures["generation_tok_s"] == pytest.approx((8 + 4) / 2.0)
    assert measure("solo", results[:1], STATS, wall=2.5)["generation_tok_s"] == pytest.approx(8 / 2.0)
    reader = [Result([7], 400, 0.0, 0.8, 0.8, 0, 0)]
    assert "generation_tok_s" not in measure("prompt", reader, STATS, wall=0.8)
    assert set(GENERATING) == {"clients", "two-decodes", "solo"}


def test_a_run_without_first_token_times_has_no_generation_rate() -> None:
    """A peer that hands back whole generations (transformers' generate) times no first token: the table
    shows no rate for it rather than 0."""
    whole = [Result(list(range(9)), 4, 0.0, None, 2.5, 0, 0), Result(list(range(5)), 4, 0.0, None, 2.5, 0, 0)]
    assert "generation_tok_s" not in measure("clients", whole, STATS, wall=2.5)


def test_an_engines_run_has_first_tokens_before_its_finish_and_a_generation_rate() -> None:
    eng = Engine(mode_plan("serial", 2, preset="small", context=96, prefill_chunk=16))
    arrivals = [Arrival(Request(tuple(range(40, 60)), 10)), Arrival(Request(tuple(range(70, 75)), 10))]
    results, stats = InProcessDriver(eng).run(arrivals)
    assert all(r.first_token is not None and r.submitted <= r.first_token <= r.finished for r in results)
    assert measure("clients", results, stats, wall=max(r.finished for r in results))["generation_tok_s"] > 0


def test_the_longest_gap_is_the_longest_wait_between_two_deliveries_of_one_stream(monkeypatch) -> None:
    """A stall of one engine step shows as the stream's longest gap, and the workload reports the longest
    over its streams; the wait for the first token is not a gap."""
    import time

    def longest_gap(slow: int) -> tuple[Result, dict]:
        eng = Engine(mode_plan("serial", 2, preset="small", context=96, prefill_chunk=16))
        step, steps = eng.step, [0]

        def slow_step() -> bool:
            steps[0] += 1
            time.sleep(0.3 if steps[0] == slow else 0.0)
            return step()

        monkeypatch.setattr(eng, "step", slow_step)
        [r], stats = InProcessDriver(eng).run([Arrival(Request(tuple(range(40, 60)), 10))])
        return r, stats

    prompt_stalls, _ = longest_gap(slow=1)  # the prompt's first chunk: before the first token
    assert prompt_stalls.longest_gap is not None and prompt_stalls.longest_gap < 0.3
    decode_stalls, stats = longest_gap(slow=6)
    assert decode_stalls.longest_gap is not None and decode_stalls.longest_gap >= 0.3
    figures = measure("solo", [decode_stalls], stats, wall=decode_stalls.finished)
    assert figures["longest_gap_ms"] == pytest.approx(1000 * decode_stalls.longest_gap)
    two = [Result([1, 2], 4, 0.0, 0.5, 1.0, 0, 0, (0.2,)), Result([1, 2], 4, 0.0, 0.5, 1.0, 0, 0, (0.7,))]
    assert measure("clients", two, STATS, wall=1.0)["longest_gap_ms"] == pytest.approx(700.0)
    untimed = [Result([1], 4, 0.0, 0.5, 0.5, 0, 0)]
    assert not {"longest_gap_ms", "gap_p50_ms", "gap_p99_ms"} & set(
        measure("clients", untimed, STATS, wall=0.5)
    )


def test_the_gap_percentiles_are_over_every_wait_of_every_stream() -> None:
    """The median and the 99th percentile of the waits between deliveries pool every stream's waits (not
    each stream's longest), and leave out the wait for a stream's first delivery."""
    one = delivery_gaps([3.0, 3.1, 3.2, 3.3, 4.3])  # waits 0.1, 0.1, 0.1, 1.0 after the first at 3.0 s
    two = delivery_gaps([0.5, 0.7])  # 0.2
    assert one == pytest.approx((0.1, 0.1, 0.1, 1.0))
    figures = gap_figures_ms([one, two])
    assert figures["longest_gap_ms"] == pytest.approx(1000.0)
    assert figures["gap_p50_ms"] == pytest.approx(100.0)  # 0.1, 0.1, [0.1], 0.2, 1.0
    assert figures["gap_p99_ms"] == pytest.approx(1000 * (0.2 + 0.96 * 0.8))  # 3.96 of the way through
    assert gap_figures_ms([delivery_gaps([1.0]), ()]) == {}
    results = [
        Result([1, 2, 3, 4, 5], 4, 0.0, 3.0, 4.3, 0, 0, one),
        Result([1, 2], 4, 0.0, 0.5, 0.7, 0, 0, two),
    ]
    m = measure("two-decodes", results, STATS, wall=4.3)
    assert {k: m[k] for k in figures} == figures
