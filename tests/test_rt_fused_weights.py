"""Fusing q/k/v and gate/up for the CUDA path holds every weight once, for every model built on the
tensors (benchmark arms share them): the loaded tensors are fused in place, and fusing them again is free."""

from __future__ import annotations

import numpy as np

from strata_runtime.models.qwen3_moe import fuse_rows, fuse_tensors


def _tensors(g: np.random.Generator) -> dict[str, np.ndarray]:
    t = {}
    for i in range(2):
        p = f"model.layers.{i}."
        for name, rows in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4), ("o_proj", 6)):
            t[f"{p}self_attn.{name}.weight"] = g.standard_normal((rows, 6)).astype(np.float32) + 1
        for name, rows in (("gate_proj", 5), ("up_proj", 5), ("down_proj", 6)):
            t[f"{p}mlp.shared_expert.{name}.weight"] = g.standard_normal((rows, 6)).astype(np.float32) - 1
    return t


def test_loaded_tensors_are_fused_in_place_and_fusing_them_again_copies_nothing():
    g = np.random.default_rng(4)
    t = _tensors(g)
    original = {k: v.copy() for k, v in t.items()}
    fuse_tensors(np, t)
    for i in range(2):
        p = f"model.layers.{i}."
        q, k, v = (t[f"{p}self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj"))
        assert q.base is k.base is v.base is not None  # one matrix
        gate, up = t[f"{p}mlp.shared_expert.gate_proj.weight"], t[f"{p}mlp.shared_expert.up_proj.weight"]
        assert gate.base is up.base is not None
        assert t[f"{p}self_attn.o_proj.weight"].base is None  # not a fused weight
        fused, views = fuse_rows(np, (q, k, v))  # what the CUDA path does per model
        assert np.shares_memory(fused, q) and all(a is b for a, b in zip(views, (q, k, v), strict=True))
        np.testing.assert_array_equal(
            fused,
            np.concatenate([original[f"{p}self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")]),
        )
    for name, value in original.items():  # every weight keeps its values
        np.testing.assert_array_equal(t[name], value)


def test_parts_that_are_not_adjacent_slices_are_copied_into_one_matrix():
    g = np.random.default_rng(5)
    a, b = g.standard_normal((3, 4)), g.standard_normal((2, 4))
    fused, (va, vb) = fuse_rows(np, (a, b))
    assert not np.shares_memory(fused, a)
    np.testing.assert_array_equal(va, a)
    np.testing.assert_array_equal(vb, b)
    swapped, _ = fuse_rows(np, (vb, va))  # slices of one matrix, but not in order: a copy
    assert not np.shares_memory(swapped, fused)
