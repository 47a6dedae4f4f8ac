"""The step workload's kernel sequence, run on the kernels' NumPy twins with the shapes of tiny and small.

The step workload times the CUDA kernels on a GPU; here the same sequence (embedding, every layer with its
dense MLP, shared expert or routed experts, final norm, LM head, argmax) runs on the twins, which have the
launchers' signatures, so a shape or argument that does not fit the model fails on the CPU too.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from strata_cfg.schema.facts import ModelFacts
from strata_cfg.schema.presets import preset_config
from strata_runtime.bench.step import KernelModel, op_applies, step_memory_bytes
from strata_runtime.reference import kernels as twins


def _numpy_as_cupy() -> SimpleNamespace:
    """What the step workload asks of CuPy, from NumPy."""
    rng = np.random.default_rng()
    return SimpleNamespace(
        float16=np.float16,
        float32=np.float32,
        int32=np.int32,
        zeros=np.zeros,
        arange=np.arange,
        asarray=np.asarray,
        random=SimpleNamespace(standard_normal=lambda shape, dtype: rng.standard_normal(shape, dtype=dtype)),
        cuda=SimpleNamespace(Device=lambda *a: SimpleNamespace(synchronize=lambda: None)),
    )


class _TwinKernels:
    """The twins under the launchers' names; attention's twin needs no scratch, and the shared expert's gate
    arrives as [R, 1] as the decode path holds it."""

    def __getattr__(self, name: str):
        return getattr(twins, name)

    def attention(self, q, k_cache, v_cache, pos, slot, out, scratch):
        twins.attention(q, k_cache, v_cache, pos, slot, out)

    def add_scaled(self, resid, y, gate=None):
        twins.add_scaled(resid, y, None if gate is None else gate[:, 0])


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_the_step_runs_every_layer_of_the_model_on_the_twins(preset: str) -> None:
    facts = ModelFacts.from_config(preset_config(preset), source=f"synthetic:{preset}", dtype="float16")
    model = KernelModel(_numpy_as_cupy(), facts, 64, _TwinKernels(), lambda *a: 1)
    assert len(model.layers) == facts.num_hidden_layers
    sparse = [op_applies("moe", ly) for ly in model.layers]
    assert sparse == [facts.is_sparse(j) for j in range(facts.num_hidden_layers)]
    with_mlp = [op_applies("mlp", ly) for ly in model.layers]
    assert with_mlp == [not s or facts.shared_expert_intermediate_size > 0 for s in sparse]

    b = model.window(3, position=7)  # three rows in slots 0-2, each at position 7

    assert b["logits"].shape == (3, facts.vocab_size) and np.isfinite(b["logits"]).all()
    assert np.array_equal(b["out"], np.argmax(b["logits"], axis=-1))
    for ly in model.layers:  # every layer wrote its K at position 7 of slots 0-2, and nothing else
        assert np.abs(ly["kc"][:3, :, 7]).min() > 0
        assert not ly["kc"][:3, :, 8:].any() and not ly["kc"][3:].any()
    if any(sparse):
        assert b["idx"].min() >= 0 and b["idx"].max() < facts.num_experts


def test_step_memory_counts_every_weight_and_the_kv_of_eight_slots() -> None:
    facts = ModelFacts.from_config(preset_config("tiny"), source="synthetic:tiny", dtype="float16")
    model = KernelModel(_numpy_as_cupy(), facts, 64, _TwinKernels(), lambda *a: 1)
    held = sum(a.nbytes for ly in model.layers for a in ly.values())
    held += model.emb.nbytes + model.head.nbytes + model.final_norm.nbytes
    assert step_memory_bytes(facts, 64) == held
