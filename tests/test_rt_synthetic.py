"""Synthetic presets: generated stage by stage exactly as whole, with a planted chain that drafts follow."""

from __future__ import annotations

import numpy as np
from rt_plans import make_plan

from strata_runtime.api import Request
from strata_runtime.backend import Device
from strata_runtime.engine import Engine
from strata_runtime.models.qwen3_moe import stage_shapes
from strata_runtime.weights.random import tensor_seed, uniform_
from strata_runtime.weights.synthetic import SyntheticModel, chain_permutation
from strata_runtime.weights.tokenizer import ByteTokenizer

CPU = Device("cpu", 0)


def test_stage_by_stage_generation_equals_whole_model_generation() -> None:
    synth = SyntheticModel("tiny", seed=3, layer_scale=0.05)
    a = synth.args
    whole = synth.load(stage_shapes(a, (0, 4), first=True, last=True, mtp=True), CPU, np.float32)
    second = synth.load(
        stage_shapes(a, (2, 4), first=False, last=True, mtp=True), Device("cpu", 1), np.float32
    )
    assert second and all(np.array_equal(t, whole[name]) for name, t in second.items())
    other_seed = SyntheticModel("tiny", seed=4, layer_scale=0.05).tensor(
        "model.layers.2.self_attn.q_proj.weight", (64, 64), CPU, np.float32
    )
    assert not np.array_equal(other_seed, whole["model.layers.2.self_attn.q_proj.weight"])


def test_counter_random_values_are_uniform_and_depend_on_the_seed() -> None:
    out = uniform_(np.empty(200_003, dtype=np.float32), tensor_seed(1, "w"), 0.5)
    assert out.min() >= -0.5 and out.max() < 0.5
    assert abs(out.mean()) < 0.005 and abs(out.var() - 0.25 / 3) < 0.002
    again = uniform_(np.empty(200_003, dtype=np.float32), tensor_seed(1, "w"), 0.5)
    assert np.array_equal(out, again)
    assert not np.array_equal(out, uniform_(np.empty(200_003, dtype=np.float32), tensor_seed(2, "w"), 0.5))


def test_the_chain_is_a_permutation_keeping_printable_text_printable() -> None:
    chain = chain_permutation(384, seed=0)
    assert sorted(chain) == list(range(384))
    printable = set(range(32, 127))
    assert all(int(chain[t]) in printable for t in printable)
    assert all(int(chain[s]) == s for s in ByteTokenizer.SPECIALS.values())


def _run(layer_scale: float) -> tuple[list[int], float, list[int]]:
    eng = Engine(make_plan(stages=2, draft_tokens=4, context=256, layer_scale=layer_scale))
    prompt = tuple(b"Planted structure")
    h = eng.submit(Request(prompt, 80))
    while eng.step():
        pass
    toks = [t for _ in range(h.events.qsize()) for t in h.events.get().token_ids]
    return toks, eng.acceptance or 0.0, [int(eng.model.stages[0].embed_tokens.shape[0])]


def test_layer_scale_tunes_acceptance_and_the_layers_still_matter() -> None:
    chain = SyntheticModel("tiny", seed=0, layer_scale=0.05).chain
    quiet, quiet_acc, _ = _run(0.0)
    default, default_acc, _ = _run(0.05)
    loud, loud_acc, _ = _run(0.2)
    # With no layer output, the model is the chain itself and every draft holds.
    assert all(int(chain[a]) == b for a, b in zip(quiet, quiet[1:], strict=False)) and quiet_acc == 1.0
    # At the preset's default, drafts are often right but the layers change some next tokens.
    assert 0.4 < default_acc < 0.95
    assert any(int(chain[a]) != b for a, b in zip(default, default[1:], strict=False))
    assert loud_acc < default_acc
