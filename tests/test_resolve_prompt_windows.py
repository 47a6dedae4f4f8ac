"""The estimate behind ``memory.prompt_graph_rows = "auto"``: 8-row graph windows against the prefill path.

The rule's profile and its note are pinned in test_resolve_rules.py; here, the costs it compares.
"""

from __future__ import annotations

import numpy as np
import pytest
from cfg_fixtures import preset_facts as _facts

from strata_cfg.resolve.prompt_windows import (
    GRAPH_WINDOW_EFFICIENCY,
    PREFILL_GRAPH_EFFICIENCY,
    PREFILL_GRAPH_MS_PER_LAYER,
    PREFILL_LAUNCH_MS_PER_LAYER,
    PromptCosts,
    prompt_costs,
)
from strata_cfg.resolve.sizes import StageShape
from strata_cfg.schema.facts import ModelFacts, expected_distinct_experts


def _one_gpu(f: ModelFacts, gbs: float) -> list[tuple[StageShape, float]]:
    return [(StageShape(0, f.num_hidden_layers, True, True), gbs)]


@pytest.mark.parametrize(("n_experts", "top_k", "rows"), [(128, 8, 8), (128, 8, 2), (16, 4, 8), (64, 6, 5)])
def test_expected_distinct_experts_is_what_random_routing_draws(n_experts, top_k, rows):
    g = np.random.default_rng(n_experts + top_k + rows)
    draws = [
        len({int(e) for _ in range(rows) for e in g.choice(n_experts, top_k, replace=False)})
        for _ in range(4000)
    ]
    assert abs(np.mean(draws) - expected_distinct_experts(n_experts, top_k, rows)) < 0.01 * n_experts
    assert expected_distinct_experts(n_experts, top_k, 1) == top_k


def test_the_30b_preset_on_an_h200_reads_two_windows_before_the_prefill_path_pays():
    f = _facts("qwen3-30b-a3b")
    costs = prompt_costs(f, _one_gpu(f, 4800), drafting=True)
    assert costs.layers == f.num_hidden_layers + f.mtp_layers == 49
    assert costs.prefill_ms == pytest.approx(49 * PREFILL_LAUNCH_MS_PER_LAYER)
    # The window's bytes: every layer's weights and its 8 rows' distinct experts, plus the MTP head's.
    distinct = expected_distinct_experts(f.num_experts, f.num_experts_per_tok, 8)
    layer = f.layer_bytes(0)[0] + distinct * f.expert_bytes()
    head = f.mtp_bytes()[0] + distinct * f.expert_bytes()
    want = (48 * layer + head) / (4800e9 * GRAPH_WINDOW_EFFICIENCY) * 1e3
    assert costs.window_ms == pytest.approx(want)
    assert costs.graph_rows() == 16
    assert prompt_costs(f, _one_gpu(f, 4800), drafting=False).layers == 48


def test_a_replayed_prefill_graph_costs_its_16_rows_bytes_and_takes_prompts_past_one_window():
    f = _facts("qwen3-30b-a3b")
    launched = prompt_costs(f, _one_gpu(f, 4800), drafting=True)
    graphed = prompt_costs(f, _one_gpu(f, 4800), drafting=True, graphs=True)
    assert graphed.graphs and not launched.graphs and graphed.window_ms == launched.window_ms
    distinct = expected_distinct_experts(f.num_experts, f.num_experts_per_tok, 16)
    layer = f.layer_bytes(0)[0] + distinct * f.expert_bytes()
    head = f.mtp_bytes()[0] + distinct * f.expert_bytes()
    want = (48 * layer + head) / (4800e9 * PREFILL_GRAPH_EFFICIENCY) * 1e3 + 49 * PREFILL_GRAPH_MS_PER_LAYER
    assert graphed.prefill_ms == pytest.approx(want)
    assert graphed.prefill_ms < launched.prefill_ms  # the bytes of 16 rows, not Python's launches
    assert (graphed.graph_rows(), launched.graph_rows()) == (8, 16)
    # A small model's graph is its kernels' latency, which windows beat up to the cap.
    tiny = _facts("tiny")
    assert prompt_costs(tiny, _one_gpu(tiny, 4800), drafting=True, graphs=True).graph_rows() == 64
    # Graph costs follow the bandwidth as windows do: a slower GPU keeps the same cut-off.
    slow = prompt_costs(f, _one_gpu(f, 1000), drafting=True, graphs=True)
    assert slow.prefill_ms > graphed.prefill_ms and slow.graph_rows() == 8


def test_slower_gpus_and_bigger_experts_send_prompts_to_the_prefill_path_sooner():
    f = _facts("qwen3-30b-a3b")
    rows = [prompt_costs(f, _one_gpu(f, gbs), drafting=True).graph_rows() for gbs in (600, 1800, 4800, 20000)]
    assert rows == sorted(rows) and rows[0] == 8 and rows[-1] == 64
    fast, slow = (prompt_costs(f, _one_gpu(f, gbs), drafting=True).window_ms for gbs in (4800, 2400))
    assert slow == pytest.approx(2 * fast)
    big = _facts("qwen3-235b-a22b")
    assert prompt_costs(big, _one_gpu(big, 4800), drafting=True).graph_rows() == 8
    tiny = _facts("tiny")
    assert prompt_costs(tiny, _one_gpu(tiny, 4800), drafting=True).graph_rows() == 64


def test_a_split_adds_each_stages_layers_at_its_own_gpus_bandwidth():
    f = _facts("qwen3-30b-a3b")
    half = f.num_hidden_layers // 2
    even = [(StageShape(0, half, True, False), 4800.0), (StageShape(half, 48, False, True), 4800.0)]
    assert prompt_costs(f, even, drafting=False).window_ms == pytest.approx(
        prompt_costs(f, _one_gpu(f, 4800), drafting=False).window_ms
    )
    slow_first = [(even[0][0], 2400.0), even[1]]
    one, both = (
        prompt_costs(f, _one_gpu(f, 4800), drafting=False),
        prompt_costs(f, slow_first, drafting=False),
    )
    assert both.window_ms == pytest.approx(1.5 * one.window_ms)  # half the layers at half the rate
    assert both.prefill_ms == one.prefill_ms


@pytest.mark.parametrize(
    ("window_ms", "prefill_ms", "rows"), [(7.7, 24.5, 24), (30.0, 24.5, 8), (1.0, 24.5, 64), (0.0, 1.0, 64)]
)
def test_graph_rows_are_whole_windows_from_8_to_64(window_ms, prefill_ms, rows):
    assert PromptCosts(window_ms, prefill_ms, 49, 52.0).graph_rows() == rows


def test_warm_prompt_lengths_capture_every_graph_size_and_a_few_dozen_rows_where_no_graph_has_them():
    from strata_cfg.schema.windows import warm_prompt_lengths

    every = [512, 448, 384, 320, 256, 192, 128, 64, 32, 16]
    assert warm_prompt_lengths(512, 8, 8192) == every  # largest first
    assert warm_prompt_lengths(512, 8, 256) == [64, 32, 16]  # up to a quarter of the context
    assert warm_prompt_lengths(128, 24, 8192) == [128, 64, 32]  # chunks of 24 rows or fewer take windows
    # Without graphs, one prompt of 64 rows where the prefill path reads such chunks; none where it does not.
    assert warm_prompt_lengths(0, 24, 8192) == [64]
    assert warm_prompt_lengths(0, 64, 8192) == []
    assert warm_prompt_lengths(0, 24, 100) == [25]
