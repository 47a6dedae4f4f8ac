"""Calibrated routing through the real router and the engine, on virtual CPU devices.

With ``model.routing = "calibrated"`` every MoE layer's router must choose exactly the experts the routing
model intends for the request (recomputed here from the prompt alone) at each row's position, in prefill
chunks, decode windows and verify rows alike, on the tiny and small presets over one or two stages; and
greedy text must still be the same in every window mode.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from rt_plans import make_plan

from strata_runtime.api import Request
from strata_runtime.engine import Engine
from strata_runtime.experts.routing import RoutingModel, routing_seed
from strata_runtime.models.qwen3_moe import SparseMoeBlock

MODES = {
    "solo": {"slots": 1, "draft_tokens": 4},
    "serial": {"slots": 3, "groups": 1},
    "pipelined": {"slots": 4, "groups": 2},
    "batch-mtp": {"slots": 3, "groups": 1, "batch_mtp": True, "draft_tokens": 3},
}


def prompts(seed: int, n: int, vocab: int) -> list[tuple[int, ...]]:
    g = np.random.default_rng(seed)
    return [tuple(g.integers(1, vocab, int(g.integers(3, 40))).tolist()) for _ in range(n)]


def run(eng: Engine, schedule: list[tuple[int, tuple[int, ...]]], max_tokens: int) -> list[list[int]]:
    """Submit each prompt at its step; every request's greedy tokens."""
    handles: list[Any] = [None] * len(schedule)
    step = 0
    while step == 0 or eng.step() or any(h is None for h in handles):
        for i, (at, prompt) in enumerate(schedule):
            if handles[i] is None and at <= step:
                handles[i] = eng.submit(Request(prompt, max_tokens))
        step += 1
        assert step < 5000
    out = []
    for h in handles:
        ids: list[int] = []
        while not h.events.empty():
            ev = h.events.get()
            assert ev.error is None, ev.error
            ids += ev.token_ids
        out.append(ids)
    return out


def trace_routes(eng: Engine) -> list[tuple[int, Any, np.ndarray, np.ndarray]]:
    """Record every main-model MoE routing: (model layer, window layout, slot seeds then, chosen [R, k])."""
    log: list[tuple[int, Any, np.ndarray, np.ndarray]] = []
    current: list[Any] = [None]
    for stage in eng.model.stages:

        def forward(
            hidden: Any, layout: Any, positions: Any = None, account: bool = True, real: Any = stage.forward
        ) -> Any:
            # A window chained to one decided on the device carries its positions apart from its layout.
            current[0] = layout if positions is None else layout.placed(np.asarray(positions))
            return real(hidden, layout, positions, account)

        stage.forward = forward  # type: ignore[method-assign]
        for j, layer in enumerate(stage.layers):
            if not isinstance(layer.mlp, SparseMoeBlock):
                continue

            at = stage.layer_range[0] + j

            def route(xp: Any, x: Any, bias: Any = None, real: Any = layer.mlp.route, at: int = at) -> Any:
                idx, w = real(xp, x, bias)
                seeds = eng.model.routing.seeds.copy() if eng.model.routing is not None else np.zeros(0)
                log.append((at, current[0], seeds, np.asarray(idx)))
                return idx, w

            layer.mlp.route = route  # type: ignore[method-assign]
    return log


def matches(log, plan, asked: list[tuple[int, ...]]) -> tuple[int, int]:
    """(rows whose chosen set is the intended one, rows) over the log, the intended sets recomputed from
    each row's prompt (found by its slot's routing seed) with a fresh routing model."""
    a = make_args(plan)
    model = RoutingModel(a["layers"], a["experts"], a["top_k"], plan.model.seed)
    by_seed = {routing_seed(p): model.request(p) for p in asked}
    good = total = 0
    for layer, layout, seeds, chosen in log:
        slots, positions = layout.row_slots(), layout.positions()
        for r, (s, pos) in enumerate(zip(slots, positions, strict=True)):
            seed, cdf = by_seed[int(seeds[s])] if seeds.size else next(iter(by_seed.values()))
            want = model.intended(seed, cdf, layer, np.array([pos]))[0]
            good += set(chosen[r].tolist()) == set(want.tolist())
            total += 1
    return good, total


def make_args(plan) -> dict[str, int]:
    f = plan.model.facts
    return {"layers": f.num_hidden_layers, "experts": f.num_experts, "top_k": f.num_experts_per_tok}


@pytest.mark.parametrize(("preset", "stages"), [("tiny", 1), ("tiny", 2), ("small", 2)])
@pytest.mark.parametrize("mode", ["solo", "batch-mtp"])
def test_the_router_chooses_the_intended_experts_in_every_window(preset, stages, mode):
    plan = make_plan(
        preset=preset, stages=stages, context=128, prefill_chunk=16, routing="calibrated", **MODES[mode]
    )
    eng = Engine(plan)
    log = trace_routes(eng)
    asked = prompts(1, 3, plan.model.facts.vocab_size)
    run(eng, [(0, asked[0]), (2, asked[1]), (5, asked[2])], max_tokens=10)
    good, total = matches(log, plan, asked)
    assert total > 100 and good == total, (good, total)
    kinds = {w.kind for w in eng.windows}
    assert "prefill" in kinds and kinds - {"prefill"}, kinds
    assert any(line.startswith("routing: calibrated") for line in eng.startup)


def test_the_check_fails_when_the_router_is_not_biased():
    # The same requests with uniform routing: the router's own choices are almost never the intended set.
    plan = make_plan(preset="small", stages=1, context=128, prefill_chunk=16, slots=1)
    eng = Engine(plan)
    log = trace_routes(eng)
    asked = prompts(1, 1, plan.model.facts.vocab_size)
    run(eng, [(0, asked[0])], max_tokens=10)
    good, total = matches(log, plan, asked)
    assert total > 50 and good < total / 4, (good, total)


@functools.cache
def reference(preset: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    eng = Engine(make_plan(preset=preset, stages=1, context=128, prefill_chunk=16, routing="calibrated"))
    return tuple(run(eng, [(0, prompt)], max_tokens)[0])


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_text_is_the_same_in_every_mode_with_calibrated_routing(stages, mode):
    kw = dict(MODES[mode])
    if mode == "pipelined" and stages == 1:
        kw["groups"] = None  # groups need a split
    plan = make_plan(preset="tiny", stages=stages, context=128, prefill_chunk=16, routing="calibrated", **kw)
    asked = prompts(2, 4, plan.model.facts.vocab_size)
    got = run(Engine(plan), [(0, asked[0]), (0, asked[1]), (3, asked[2]), (7, asked[3])], max_tokens=12)
    assert [tuple(t) for t in got] == [reference("tiny", p, 12) for p in asked]
    assert all(len(t) == 12 for t in got)


def test_calibrated_routing_changes_what_the_model_computes():
    # Same weights, same prompt: the hidden states after the MoE layers differ, so the bias reached them.
    a = make_plan(preset="tiny", stages=1, context=64, prefill_chunk=16, routing="calibrated")
    b = make_plan(preset="tiny", stages=1, context=64, prefill_chunk=16)
    assert a.model.routing == "calibrated" and b.model.routing == "uniform"
    from strata_runtime.layout import Layout
    from strata_runtime.model import Model

    prompt = np.array(prompts(3, 1, 384)[0])
    outs = []
    for plan in (a, b):
        m = Model.from_plan(plan)
        m.admit(0, tuple(prompt.tolist()))
        outs.append(m.forward(prompt, Layout.of([(0, len(prompt), 0)])))
    assert not np.allclose(outs[0], outs[1])


def test_benchmark_arms_that_differ_only_in_routing_share_one_copy_of_the_weights():
    from strata_runtime.model import Model
    from strata_runtime.model.placed import WeightStore

    store = WeightStore()
    kw = dict(preset="tiny", stages=2, context=64, prefill_chunk=16)
    uniform = Model.from_plan(make_plan(**kw), weights=store)
    calibrated = Model.from_plan(make_plan(routing="calibrated", **kw), weights=store)
    assert len(store.stages) == 2  # one entry per stage, not per arm
    for a, b in zip(uniform.stages, calibrated.stages, strict=True):
        assert a.layers[0].self_attn.o_proj is b.layers[0].self_attn.o_proj
    assert uniform.routing is None and calibrated.routing is not None
    # A different seed is a different model: it gets weights of its own.
    Model.from_plan(make_plan(seed=1, **kw), weights=store)
    assert len(store.stages) == 4
