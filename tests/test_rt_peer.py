"""The transformers peer arm of `strata bench` runs on the runtime's own tensors and agrees with it."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from rt_plans import make_plan  # noqa: E402

from strata_runtime.bench.harness import InProcessDriver, run_bench, summarise  # noqa: E402
from strata_runtime.bench.peer import make_peer  # noqa: E402
from strata_runtime.engine import Engine  # noqa: E402
from strata_runtime.model.placed import WeightStore  # noqa: E402


def test_transformers_peer_generates_the_runtimes_greedy_text_on_shared_weights():
    plan = make_plan(preset="tiny", slots=2, draft_tokens=0, context=256)
    weights = WeightStore()
    engine = Engine(plan, weights=weights)
    peer = make_peer("transformers", plan, engine.tokenizer, weights)
    # The peer's parameters are the runtime's arrays, not copies.
    embed = peer.model.model.embed_tokens.weight
    (shared,) = weights.stages.values()
    tensors = shared.tensors
    assert embed.data_ptr() == tensors["model.embed_tokens.weight"].__array_interface__["data"][0]
    runs = run_bench(
        {"serial": engine, "transformers": peer},
        "two-decodes",
        tokens=12,
        repeats=1,
        context=256,
        driver=lambda e: e.driver() if hasattr(e, "driver") else InProcessDriver(e),
    )
    summary = summarise(runs)
    assert runs["transformers"].tokens["two-decodes"][0]
    assert summary["transformers"]["two-decodes"]["text_equal_to_serial"] is True
    assert summary["transformers"]["two-decodes"]["median"]["tok_s"] > 0


def test_unknown_peer_is_refused():
    plan = make_plan(preset="tiny", slots=1)
    with pytest.raises(ValueError, match="unknown peer 'vllm'"):
        make_peer("vllm", plan, None, {})
