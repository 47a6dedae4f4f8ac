"""The step workload's kernel sequence, run on the kernels' NumPy references with the shapes of tiny, small.

The step workload times the CUDA kernels on a GPU through the decode path's own `LayerStack` and
`LAYER_STEPS`; here that very sequence (embedding, every layer with its dense MLP, shared expert or routed
experts, final norm, LM head, argmax) runs on the references, which have the launchers' names and
signatures, so a shape or argument that does not fit the model fails on the CPU too, and the window's
logits are checked against an independent float64 forward pass.
"""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from script_loader import load_script

from strata_cfg.schema.facts import ModelFacts
from strata_cfg.schema.presets import preset_config
from strata_runtime.bench.step import KernelModel, step_memory_bytes
from strata_runtime.cuda.layers import step_applies
from strata_runtime.models.ops.distribution import log_min_p
from strata_runtime.reference import kernels as reference


def _numpy_as_cupy(seed: int) -> SimpleNamespace:
    """What the step workload asks of CuPy, from NumPy, with seeded random weights."""
    rng = np.random.default_rng(seed)
    return SimpleNamespace(
        float16=np.float16,
        float32=np.float32,
        int32=np.int32,
        zeros=np.zeros,
        empty=np.empty,
        arange=np.arange,
        asarray=np.asarray,
        random=SimpleNamespace(standard_normal=lambda shape, dtype: rng.standard_normal(shape, dtype=dtype)),
        cuda=SimpleNamespace(Device=lambda *a: SimpleNamespace(synchronize=lambda: None)),
    )


def _rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _expected_logits(model: KernelModel, ids: np.ndarray, position: int) -> tuple[np.ndarray, float]:
    """The step's logits by plain float64 NumPy: a forward pass of one token per row at ``position``, every
    earlier key zero (the KV the step starts from), each row in its own slot (r).

    Keys and values are read back from the fp16 cache the step wrote, as the kernels read them: computed
    here in float64 and there in fp32, an element next to a rounding boundary of fp16 may round to the other
    neighbour, which would move the logits by ~1e-4. So the cache is checked on its own (the second value:
    the largest difference from this pass's keys and values over the bound rounding allows), and the
    attention here uses what it holds."""
    f64 = np.float64
    a = model.stack.args
    nq, nkv, d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    x = model.emb[ids].astype(f64)  # [R, H]
    inv = a.rope_theta ** (-2.0 * np.arange(d // 2) / d)  # [D/2]
    cos, sin = np.cos(position * inv), np.sin(position * inv)

    def rope(v: np.ndarray) -> np.ndarray:
        lo, hi = v[..., : d // 2], v[..., d // 2 :]
        return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)

    worst = 0.0
    rows = np.arange(len(ids))
    for j, lay in enumerate(model.stack.layers):
        w = {
            f.name: None if getattr(lay, f.name) is None else getattr(lay, f.name).astype(f64)
            for f in fields(lay)
            # the routed experts' address tables (gate_up and down are the weights), and the kernels' choices
            if f.name not in ("experts", "attention_tc", "warm")
        }
        qkv = _rms(x, w["ln1"]) @ w["qkv"].T  # [R, (NQ + 2 NKV) D]
        q = rope(_rms(qkv[:, : nq * d].reshape(-1, nq, d), w["q_norm"]))  # [R, NQ, D]
        k = rope(_rms(qkv[:, nq * d : (nq + nkv) * d].reshape(-1, nkv, d), w["k_norm"]))  # [R, NKV, D]
        v = qkv[:, (nq + nkv) * d :].reshape(-1, nkv, d)  # [R, NKV, D]
        for mine, cache in ((k, model.stack.k_cache), (v, model.stack.v_cache)):
            held = cache[j, rows, :, position].astype(f64)  # [R, NKV, D] what the step wrote
            # Rounding to fp16 moves an element by at most half its spacing; computing it in fp32 rather
            # than float64 adds ~1e-7 of the terms that make it, bounded here by 1e-5 of the largest element.
            bound = 0.5 * np.spacing(np.abs(mine).astype(np.float16)).astype(f64) + 1e-5 * np.abs(mine).max()
            worst = max(worst, float((np.abs(held - mine) / bound).max()))
        k = model.stack.k_cache[j, rows, :, position].astype(f64)
        v = model.stack.v_cache[j, rows, :, position].astype(f64)
        # Keys 0..position-1 are zero: their scores are 0, their values 0.
        attn = np.empty((len(ids), nq, d))
        for head in range(nq):
            kv = head // (nq // nkv)
            s = (q[:, head] * k[:, kv]).sum(-1) / np.sqrt(d)  # [R] the row's own key
            own = np.exp(s) / (np.exp(s) + position)  # softmax over the row's key and `position` zero scores
            attn[:, head] = own[:, None] * v[:, kv]
        x = x + attn.reshape(len(ids), nq * d) @ w["o"].T
        xn = _rms(x, w["ln2"])
        y = np.zeros_like(x)
        if w["mlp_gate_up"] is not None:
            width = w["mlp_down"].shape[1]
            gu = xn @ w["mlp_gate_up"].T
            dense = (gu[:, :width] / (1 + np.exp(-gu[:, :width])) * gu[:, width:]) @ w["mlp_down"].T
            gate = 1 / (1 + np.exp(-(xn @ w["shared_gate"].T))) if w["shared_gate"] is not None else 1.0
            y += gate * dense
        if w["gate_up"] is not None:
            logits = xn @ w["router"].T  # [R, E]
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            top = np.argsort(-logits, axis=-1, kind="stable")[:, : a.num_experts_per_tok]
            wts = np.take_along_axis(p, top, -1)
            wts /= wts.sum(-1, keepdims=True)  # norm_topk_prob
            inter = w["down"].shape[2]
            for r in range(len(ids)):
                for j, e in enumerate(top[r]):
                    gu = w["gate_up"][e] @ xn[r]
                    y[r] += wts[r, j] * (w["down"][e] @ (gu[:inter] / (1 + np.exp(-gu[:inter])) * gu[inter:]))
        x = x + y
    return _rms(x, model.final_norm.astype(f64)) @ model.head.astype(f64).T, worst  # [R, V]


def _step_result(**tables: object) -> dict[str, object]:
    """A step workload's result with a small model's summary and no measured rows, for `render_step`,
    with ``tables`` (its per-row-count tables) added."""
    model = {"source": "synthetic:x", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16}
    model |= {"experts": 8, "top_k": 2, "expert_width": 32, "vocab": 100}
    base = {"model": model, "device": "cuda:0", "gpu": "GPU", "position": 7, "context": 64}
    return (
        base | {"routing": "uniform", "copy_gbs": 4000.0, "rows": [], "per_kernel_us_per_layer": {}} | tables
    )


@pytest.mark.parametrize("preset", ["tiny", "small", "small-wide"])
def test_the_step_runs_every_layer_of_the_model_on_the_references(preset: str) -> None:
    """``small-wide``: small with experts 256 wide, which take the wide expert kernels: the rows routed
    first (``route_topk``), then the experts in order of expert."""
    config = preset_config(preset.removesuffix("-wide"))
    if preset.endswith("-wide"):
        config = config | {"moe_intermediate_size": 256}
    facts = ModelFacts.from_config(config, source=f"synthetic:{preset}", dtype="float16")
    model = KernelModel(_numpy_as_cupy(seed=5), facts, 64, reference)
    layers = model.stack.layers
    assert len(layers) == facts.num_hidden_layers
    sparse = [step_applies("moe", lay) for lay in layers]
    assert sparse == [facts.is_sparse(j) for j in range(facts.num_hidden_layers)]
    with_mlp = [step_applies("mlp", lay) for lay in layers]
    assert with_mlp == [not s or facts.shared_expert_intermediate_size > 0 for s in sparse]

    w = model.window(3, position=7, seed=11)  # three rows in slots 0-2, each at position 7

    # The window computes the model: its logits match an independent float64 forward pass. Both read the
    # same fp16 weights and the same fp16 keys and values, which are within one fp16 rounding (half a unit
    # in the last place, plus fp32 error) of this pass's; the references compute in fp32, so the logits differ
    # by fp32 rounding over a few layers (measured 1e-7 to 1e-6 over 40 draws of the ids for tiny and small).
    # A wrong step (a missing add, a swapped weight, a wrong position) moves them by O(1).
    expected, kv_error = _expected_logits(model, w.ids, position=7)
    assert kv_error <= 1.0, kv_error
    err = np.linalg.norm(w.logits - expected) / np.linalg.norm(expected)
    assert err < 1e-5, err
    assert w.out.tolist() == expected.argmax(-1).tolist()
    k_cache = model.stack.k_cache  # [L, S, NKV, T, D]: every layer wrote K at position 7 of slots 0-2 only
    assert np.abs(k_cache[:, :3, :, 7]).min() > 0
    assert not k_cache[:, :3, :, 8:].any() and not k_cache[:, 3:].any() and not k_cache[:, :, :, :7].any()


def test_the_step_times_each_way_of_choosing_tokens_on_its_own_logits() -> None:
    """`time_choices` runs the greedy argmax and each draw of `CHOICES` on a step's logits: each case must
    pass its own temperature, top-k and top-p (a token outside the cuts, or a greedy token that is not the
    argmax, fails); each draw's whole distribution is timed too and is the one its token was drawn from (a
    draw from it at the row's uniform gives the token); each draw and distribution is timed by one block per
    row as well; and the step table lists the µs of each, the one-block µs in brackets."""
    from strata_runtime.bench.step import CHOICE_TIMES, CHOICES, _per_rows
    from strata_runtime.bench.step_table import render_step

    facts = ModelFacts.from_config(preset_config("tiny"), source="synthetic:tiny", dtype="float16")
    model = KernelModel(_numpy_as_cupy(seed=7), facts, 64, reference)
    logits = model.window(4, position=7, seed=3).logits.astype(np.float64).copy()
    calls: list[int] = []

    def once(cp: object, body, repeats: int) -> float:
        calls.append(repeats)
        body()
        return 1e-6 * len(calls)

    res = model.time_choices(4, 7, 5, timer=once, seed=3)
    draws = [name for name, (inv_temp, *_) in CHOICES.items() if inv_temp > 0]
    assert list(res) == list(CHOICES) and calls == [5] * (len(CHOICES) + 3 * len(draws))
    # each draw: the one-block choice, the split one, the one-block distribution, the split one
    assert [c["us"] for c in res.values()] == pytest.approx([1.0, *(3.0 + 4 * i for i in range(len(draws)))])
    assert [res[name]["one_block_us"] for name in draws] == pytest.approx(
        [2.0 + 4 * i for i in range(len(draws))]
    )
    assert [res[name]["one_block_distribution_us"] for name in draws] == pytest.approx(
        [4.0 + 4 * i for i in range(len(draws))]
    )
    assert [res[name]["distribution_us"] for name in draws] == pytest.approx(
        [5.0 + 4 * i for i in range(len(draws))]
    )
    u = np.linspace(0.1, 0.9, 4, dtype=np.float32)
    for name in draws:
        dist = res[name]["distribution"]
        np.testing.assert_allclose(dist.sum(axis=1), 1.0)
        drawn = [int(np.searchsorted(np.cumsum(d), x, side="right")) for d, x in zip(dist, u, strict=True)]
        assert drawn == res[name]["tokens"], name
    assert res["argmax"]["tokens"] == logits.argmax(-1).tolist()
    for name, (inv_temp, top_k, top_p, min_p) in CHOICES.items():
        if inv_temp == 0:
            continue
        for row, token in zip(logits, res[name]["tokens"], strict=True):
            t = float(np.float32(inv_temp))
            w = reference.staying_weights(row.astype(np.float32), t, top_k, top_p, log_min_p(min_p))
            assert w[token] > 0, (name, token)
            if min_p:  # (the tiny model's flat rows keep every token)
                assert w[token] >= min_p * w.max() * (1 - 1e-6), name
            if top_k:
                assert row[token] >= np.sort(row)[-top_k], name
    assert len(set(res["temperature 0.7"]["tokens"])) > 1  # the rows draw at different uniforms

    text = render_step(_step_result(**{key: _per_rows({"4": res}, key) for key in CHOICE_TIMES}))
    assert "  4 rows: argmax 1.0, temperature 0.7 3.0 (2.0), top-k 20 7.0 (6.0)" in text
    assert (
        "the whole distribution each draw takes" in text
        and "  4 rows: temperature 0.7 5.0 (4.0), top-k 20 9.0 (8.0)" in text
    )


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_the_step_times_what_each_group_costs_inside_it(preset: str, monkeypatch) -> None:
    """`time_in_step` times the whole step against the same step with one group of `LAYER_STEPS` left out
    of every layer: with a timer that charges each group's launches a cost of its own, what it reports for a
    group is that group's cost per layer that runs it, for every group some layer runs and no other; and the
    step table lists the figures."""
    from strata_runtime.bench.step_table import render_step
    from strata_runtime.cuda.layers import LAYER_STEPS

    facts = ModelFacts.from_config(preset_config(preset), source=f"synthetic:{preset}", dtype="float16")
    model = KernelModel(_numpy_as_cupy(seed=9), facts, 64, reference)
    ran: list[str] = []
    for name, step in list(LAYER_STEPS.items()):

        def counted(k, a, lay, b, kc, vc, name=name, step=step) -> None:
            if step_applies(name, lay):
                ran.append(name)
            step(k, a, lay, b, kc, vc)

        monkeypatch.setitem(LAYER_STEPS, name, counted)
    cost = {name: 1.5 * (i + 1) for i, name in enumerate(LAYER_STEPS)}  # µs a launch
    timed: list[int] = []

    def timer(cp: object, body, repeats: int) -> float:
        timed.append(repeats)
        ran.clear()
        body()
        return sum(cost[name] for name in ran) * 1e-6

    res = model.time_in_step(2, 7, 4, timer=timer, rounds=2)
    layers = model.stack.layers
    runs = [name for name in LAYER_STEPS if any(step_applies(name, lay) for lay in layers)]
    assert {"qkv+rope", "attention", "o_proj"} <= set(runs) and len(runs) < len(LAYER_STEPS)
    assert list(res) == runs
    assert res == pytest.approx({name: cost[name] for name in runs})
    assert timed == [4] * (2 * 2 * len(runs))  # each round: the whole step and the step without, per group

    text = render_step(_step_result(in_step_us_per_layer={"2": res}))
    assert "costs inside the whole step" in text
    assert "  2 rows: " + ", ".join(f"{name} {cost[name]:.1f}" for name in runs) in text
    # with each group's bytes (as `time_kernels` gives them), the share of the copy rate (4,000 GB/s here)
    # at which those bytes move inside the step: 6 MB in 1.5 µs is 4,000 GB/s, 100%
    nbytes = {"2": {"qkv+rope": 6e6, "attention": 1.2e6}}
    text = render_step(_step_result(in_step_us_per_layer={"2": res}, per_kernel_bytes_per_layer=nbytes))
    assert "  2 rows: qkv+rope 1.5 (100%), attention 3.0 (10%), o_proj 4.5, " in text


def test_step_memory_counts_every_weight_and_the_kv_of_eight_slots() -> None:
    facts = ModelFacts.from_config(preset_config("tiny"), source="synthetic:tiny", dtype="float16")
    model = KernelModel(_numpy_as_cupy(seed=6), facts, 64, reference)
    held = sum(
        getattr(lay, f.name).nbytes
        for lay in model.stack.layers
        for f in fields(lay)
        if getattr(lay, f.name) is not None and f.name not in ("experts", "attention_tc", "warm")
    )
    held += model.stack.k_cache.nbytes + model.stack.v_cache.nbytes
    held += model.emb.nbytes + model.head.nbytes + model.final_norm.nbytes
    assert step_memory_bytes(facts, 64) == held


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_the_step_routes_each_layer_by_its_model_layer_under_calibrated_routing(preset: str) -> None:
    """With calibrated routing the step's layer sequence biases each MoE layer's router before the top-k, by
    that layer's index in the model: after each sparse layer, every row chose its slot's intended experts
    at that layer and position (and without the bias, the same check fails)."""
    from strata_runtime.backend import Device
    from strata_runtime.bench.step import SLOTS, facts_args
    from strata_runtime.cuda.layers import LAYER_STEPS
    from strata_runtime.cuda.routing import DeviceRouting
    from strata_runtime.experts.routing import RoutingModel, RoutingTables

    facts = ModelFacts.from_config(preset_config(preset), source=f"synthetic:{preset}", dtype="float16")
    args = facts_args(facts)
    tables = RoutingTables(
        RoutingModel(args.num_hidden_layers, args.num_experts, args.num_experts_per_tok, 0), SLOTS
    )
    g = np.random.default_rng(13)
    for slot in range(SLOTS):
        tables.admit(slot, g.integers(1, facts.vocab_size, 9).tolist())
    routed = KernelModel(
        _numpy_as_cupy(seed=7), facts, 64, reference, routing=DeviceRouting(tables, Device.parse("cpu:0"))
    )
    plain = KernelModel(_numpy_as_cupy(seed=7), facts, 64, reference)
    position = 5
    matched = {}
    for name, model in (("calibrated", routed), ("uniform", plain)):
        s = model.stack
        b = model.window(3, position=position, seed=11).buffers  # rows in slots 0-2
        b.resid[...] = model.emb[np.array([3, 4, 5])]
        rows = checked = 0
        for j, lay in enumerate(s.layers):
            for step in LAYER_STEPS.values():
                step(s.kern, s.args, lay, b, s.k_cache[j], s.v_cache[j])
            if not facts.is_sparse(j):
                continue
            assert step_applies("route_bias", lay) == (name == "calibrated")
            for r, slot in enumerate(b.slot.tolist()):
                want = tables.model.intended(
                    int(tables.seeds[slot]), tables.cdf[slot], j, np.array([position])
                )
                rows += set(b.idx[r].tolist()) == set(want[0].tolist())
                checked += 1
        matched[name] = (rows, checked)
    rows, checked = matched["calibrated"]
    assert checked >= 3 and rows == checked, matched
    rows, checked = matched["uniform"]
    assert rows < checked / 2, matched


@pytest.mark.parametrize("preset", ["tiny", "small", "qwen3-30b-a3b"])
@pytest.mark.parametrize(("rows", "distinct"), [(1, None), (8, 5)])
def test_the_kernel_groups_bytes_add_up_to_the_steps(preset: str, rows: int, distinct: int | None) -> None:
    """Each kernel group's bytes (what `strata bench --workload step` divides by its time), summed over
    the groups every layer runs (as the model's own layers say which) and the layers, with the LM head, are
    the step's bytes the roofline counts: no weight is left out or counted twice."""
    from strata_runtime.bench.ceilings import decode_step_bytes
    from strata_runtime.bench.step import kernel_bytes
    from strata_runtime.cuda.layers import LAYER_STEPS

    facts = ModelFacts.from_config(preset_config(preset), source=f"synthetic:{preset}", dtype="float16")
    picked = distinct if distinct is not None else facts.num_experts_per_tok
    layers = (
        KernelModel(_numpy_as_cupy(seed=8), facts, 64, reference).stack.layers
        if preset != "qwen3-30b-a3b"
        else None
    )
    total = 0
    for j in range(facts.num_hidden_layers):
        for name in LAYER_STEPS:
            if layers is not None:
                runs = step_applies(name, layers[j])
            else:  # the preset's every layer is sparse, without a shared expert or router bias
                runs = name not in ("mlp", "mlp_add", "route_bias")
            if runs:
                total += kernel_bytes(facts, name, rows, 301, picked, facts.is_sparse(j))
    want = decode_step_bytes(facts, rows=rows, positions=301, distinct_experts=picked)
    assert total + want.head == want.total
    assert kernel_bytes(facts, "attention", rows, 301, picked) == rows * 301 * facts.kv_bytes_per_token(
        "float16"
    )


def test_the_step_table_gives_each_kernel_groups_share_of_the_copy_rate() -> None:
    from strata_runtime.bench.step_table import render_step

    res = _step_result(
        per_kernel_us_per_layer={"1": {"qkv+rope": 10.0, "route_bias": 1.0}},
        per_kernel_gbs={"1": {"qkv+rope": 2000.0, "route_bias": 0.0}},
    )
    text = render_step(res)
    assert "1 row: qkv+rope 10.0 (50%), route_bias 1.0" in text
    assert "decode attention" not in text  # a result written before the step named its attention kernel
    res["attention"] = "CUDA cores (attn_split)"  # `model.decode_attention = "cuda_cores"`
    assert "uniform routing, decode attention on CUDA cores (attn_split)\n" in render_step(res)
    del res["per_kernel_gbs"]  # a result written before the rates were measured
    assert "1 row: qkv+rope 10.0, route_bias 1.0" in render_step(res)


def test_the_step_times_each_plans_kernels_in_turn_on_one_model(monkeypatch) -> None:
    """`time_kernel_arms` times the whole step once per arm in each round, in turn, with every layer's
    attention launched on that arm's kernel, and leaves the layers' own choice as it was; `kernel_arms` takes
    plans that differ only in ``model.decode_attention``, and the step table gives each arm's time and its
    change from the first."""
    from rt_plans import float16_profile_text

    from strata_cfg.plan.from_profile import resolve_text
    from strata_runtime.bench.step import KernelArm, kernel_arms
    from strata_runtime.bench.step_table import render_step
    from strata_runtime.cuda.choices import AttentionSplit

    facts = ModelFacts.from_config(preset_config("tiny"), source="synthetic:tiny", dtype="float16")
    model = KernelModel(_numpy_as_cupy(seed=4), facts, 64, reference, attention_tc=False)
    launched: list[bool] = []
    real = reference.attention
    monkeypatch.setattr(
        reference, "attention", lambda *a, tensor_cores=True: launched.append(tensor_cores) or real(*a)
    )
    cost = {True: 2.0e-3, False: 3.0e-3}
    order: list[set[bool]] = []

    def timer(cp: object, body, repeats: int) -> float:
        launched.clear()
        body()
        order.append(set(launched))
        return cost[True in launched]

    arms = {"a@tc": KernelArm(True), "a@cuda": KernelArm(False)}
    res = model.time_kernel_arms(2, 7, 5, arms, timer=timer, rounds=3)
    assert order == [{True}, {False}] * 3
    assert res["ms"] == pytest.approx({"a@tc": 2.0, "a@cuda": 3.0}) and res["rows"] == 2
    assert res["tokens"]["a@tc"] == res["tokens"]["a@cuda"] and len(res["tokens"]["a@tc"]) == 2
    assert not model.stack.attention_tc  # the model's own, restored

    text = float16_profile_text(backend="cuda", preset="tiny", slots=2, context=256)

    def plan(line: str, name: str = "a.toml"):
        return resolve_text(text.replace("[model]", f"[model]\n{line}"), name).plan

    plans = {
        "p@auto": plan('decode_attention = "auto"'),
        "p@cuda_cores": plan('decode_attention = "cuda_cores"'),
    }
    assert kernel_arms(plans) == {"p@auto": KernelArm(True), "p@cuda_cores": KernelArm(False)}
    other = resolve_text(text.replace("context = 256", "context = 512"), "b.toml").plan
    with pytest.raises(ValueError, match="p@auto and q differ in their memory.context"):
        kernel_arms({"p@auto": plans["p@auto"], "q": other})
    split = AttentionSplit(128, 1)
    assert (
        KernelArm(False).label() == "CUDA cores" and KernelArm(True, split).label() == f"tensor cores {split}"
    )

    rows = [
        {"rows": r, "ms": {"a@tc": 2.0 * r, "a@cuda": 2.5 * r}, "tokens": {"a@tc": [r], "a@cuda": [r]}}
        for r in (1, 8)
    ]
    rows[1]["tokens"]["a@cuda"] = [0]
    kernels = {"a@tc": "tensor cores", "a@cuda": "CUDA cores"}
    out = render_step(_step_result(kernel_arms={"kernels": kernels, "rounds": 3, "rows": rows}))
    assert out.split("\n\n")[-1].splitlines()[1:] == [
        "rows              a@tc            a@cuda",
        "          tensor cores        CUDA cores",
        "   1             2.000    2.500 (+25.0%)",
        "   8            16.000   20.000 (+25.0%)",
        "argmax tokens: a row's differs between arms at 8 rows (random weights: near ties may differ)",
    ]
    assert "each plan's kernels, ms (graph; the median of 3 interleaved rounds" in out


def test_step_arms_times_each_arm_with_its_own_kernels(monkeypatch) -> None:
    """`scripts/step_arms.py`: every timing of an arm launches attention on that arm's kernel with that
    arm's split of a row, and the engine's choices hold again after; arms are parsed with clear errors, and
    the table gives each arm's change from the first."""
    from strata_runtime.cuda import choices

    script = load_script("step_arms")
    arms = [
        script.Arm.parse("a=tc:0"),
        script.Arm.parse("b=tc"),
        script.Arm.parse("c=tc:128/1"),
        script.Arm.parse("d=cuda_cores"),
    ]
    assert arms[0].split == choices.AttentionSplit(
        0, choices.ATTN_SHORT_SPLITS, choices.ATTN_SHORT_CHUNKS, choices.ATTN_SPLITS
    )
    assert (
        arms[2].split == choices.AttentionSplit(128, 1) and arms[1].split is None and not arms[3].tensor_cores
    )
    assert (
        arms[2].describe() == f"tensor cores, split 128/1/{choices.ATTN_SHORT_CHUNKS}/{choices.ATTN_SPLITS}"
    )
    assert arms[3].describe() == "CUDA cores"
    for bad, why in [
        ("tc", "expected NAME=SPEC"),
        ("x=", "expected NAME=SPEC"),
        ("x=gpu", "SPEC is cuda_cores, tc or tc:ONE_RUN_CHUNKS"),
        ("x=tc:1/2/3/4/5", "up to four integers"),
        ("x=tc:3/65", "short_splits <= splits <= 64"),
        ("x=tc:-1", "cannot be negative"),
        ("x=tc:3,cuda_cores", "after the comma, expected warm:ROWS"),
        ("x=gpu,warm:2", "SPEC is cuda_cores, tc or tc:"),
        ("x=tc,warm:0", "expected off, ROWS or ROWS/early"),
    ]:
        with pytest.raises(ValueError, match=why):
            script.Arm.parse(bad)

    facts = ModelFacts.from_config(preset_config("tiny"), source="synthetic:tiny", dtype="float16")
    model = KernelModel(_numpy_as_cupy(seed=6), facts, 64, reference, attention_tc=False)
    launched: list[tuple[object, ...]] = []
    real = reference.attention
    monkeypatch.setattr(
        reference,
        "attention",
        lambda *a, tensor_cores=True: (
            launched.append((tensor_cores, choices.attention_split_in_force())) or real(*a)
        ),
    )
    seen: list[set[tuple[object, ...]]] = []

    def timer(cp: object, body, repeats: int) -> float:
        launched.clear()
        body()
        seen.append(set(launched))
        return 1e-3 * (len(seen) % 4 + 1)

    results = script.sweep(model, arms, [5, 9], [1, 2], repeats=3, rounds=2, timer=timer)
    want = [{(a.tensor_cores, a.split or choices.ATTN_SPLIT)} for a in arms]
    assert seen == want * 2 * 4  # 2 rounds at each of 2 positions x 2 row counts
    assert [(r["position"], r["rows"]) for r in results] == [(5, 1), (5, 2), (9, 1), (9, 2)]
    assert choices.attention_split_in_force() is choices.ATTN_SPLIT and not model.stack.attention_tc
    assert results[0]["ms"] == pytest.approx({"a": 2.0, "b": 3.0, "c": 4.0, "d": 1.0})
    table = script.render(arms, results).splitlines()
    assert table[0].startswith("arms: a = tensor cores, split 0/16/128/64; b = tensor cores, split 3/16/")
    assert table[3].split() == [
        "5",
        "1",
        "2.000",
        "ms",
        "3.000",
        "(+50.0%)",
        "4.000",
        "(+100.0%)",
        "1.000",
        "(-50.0%)",
        "yes",
    ]
    with pytest.raises(ValueError, match="arm names repeat"):
        script.sweep(model, arms[:2] * 2, [5], [1], repeats=1, rounds=1, timer=timer)


def test_step_arms_in_step_times_every_group_in_each_arms_own_kernels() -> None:
    """`scripts/step_arms.py --in-step`: after each arm's whole-step timings, what each kernel group costs
    inside the step, timed with that arm's kernel in force (a timing under another arm's kernel fails), and
    listed under the table arm by arm."""
    from strata_runtime.cuda.layers import LAYER_STEPS

    script = load_script("step_arms")
    arms = [script.Arm.parse("a=tc"), script.Arm.parse("b=cuda_cores")]
    facts = ModelFacts.from_config(preset_config("tiny"), source="synthetic:tiny", dtype="float16")
    model = KernelModel(_numpy_as_cupy(seed=6), facts, 64, reference)
    kernels: list[bool] = []

    def timer(cp: object, body, repeats: int) -> float:
        kernels.append(model.stack.attention_tc)
        body()
        return 1e-3 * len(kernels)

    results = script.sweep(model, arms, [5], [1], repeats=2, rounds=1, timer=timer, in_step=True)
    groups = [n for n in LAYER_STEPS if any(step_applies(n, lay) for lay in model.stack.layers)]
    in_step = results[0]["in_step"]
    assert list(in_step) == ["a", "b"] and all(list(g) == groups for g in in_step.values())
    whole, per_arm = 2, 2 * len(groups)  # the whole step per arm; then each group: the step and without
    assert len(kernels) == whole + 2 * per_arm
    assert set(kernels[whole : whole + per_arm]) == {True} and set(kernels[whole + per_arm :]) == {False}
    table = script.render(arms, results).splitlines()
    at = table.index("µs a layer inside the step, KV at 5, 1 row(s):")
    assert table[at + 1].startswith("  a: qkv+rope ") and table[at + 2].startswith("  b: qkv+rope ")


def test_step_arms_refuses_bad_input_before_it_needs_a_gpu(monkeypatch, capsys) -> None:
    """`scripts/step_arms.py` names a bad arm, a bad profile key and a position past the context before it
    looks for CuPy, and says in one line that it needs CuPy
    and a GPU where there is none."""
    script = load_script("step_arms")
    profiles = Path(__file__).resolve().parent.parent / "profiles"
    h200, demo = str(profiles / "h200.toml"), str(profiles / "demo.toml")
    monkeypatch.setitem(sys.modules, "cupy", None)  # no CuPy, whatever this machine has
    for argv, why in [
        ([h200, "a=tc:x"], "attention split 'x': expected up to four integers"),
        ([h200, "--set", "memory.contxt=9", "a=tc"], "memory.contxt"),
        ([h200, "--positions", "64,9000", "a=tc"], "a position of 9000 does not fit"),
        ([demo, "--positions", "64,2000", "a=tc"], "a position of 2000 does not fit"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            script.main(argv)
        assert exit_info.value.code == 2 and why in capsys.readouterr().err
    assert script.main([h200, "--positions", "64", "a=tc"]) == 2
    assert capsys.readouterr().err == "step_arms: needs CuPy and a GPU\n"


def test_step_arms_warm_l2_as_each_arm_says_with_the_next_layers_weights(monkeypatch) -> None:
    """`scripts/step_arms.py`: an arm's ``,warm:`` part is the L2 warming in force at every expert launch of
    its timings, each layer's expert kernels are handed the next layer's q/k/v weights (the last layer's
    none), and the engine's policy holds again after."""
    from strata_runtime.cuda import choices

    script = load_script("step_arms")
    arms = [
        script.Arm.parse("a=tc"),
        script.Arm.parse("b=tc,warm:2/early"),
        script.Arm.parse("c=tc:0,warm:off"),
    ]
    assert (
        arms[0].warm is None and arms[1].warm == choices.L2Warm(2, True) and arms[2].warm == choices.L2Warm()
    )
    assert arms[1].describe().endswith(", L2 warming 2/early") and arms[1].split is None
    facts = ModelFacts.from_config(preset_config("tiny"), source="synthetic:tiny", dtype="float16")
    model = KernelModel(_numpy_as_cupy(seed=6), facts, 64, reference)
    layers = model.stack.layers
    assert [lay.warm for lay in layers[:-1]] == [lay.qkv for lay in layers[1:]] and layers[-1].warm is None
    launched: list[tuple[object, object]] = []
    real = reference.moe
    monkeypatch.setattr(
        reference,
        "moe",
        lambda *a, warm=None: launched.append((warm, choices.l2_warm_in_force())) or real(*a, warm=warm),
    )
    seen: list[list[tuple[object, object]]] = []

    def timer(cp: object, body, repeats: int) -> float:
        launched.clear()
        body()
        seen.append(list(launched))
        return 1e-3

    script.sweep(model, arms, [5], [1], repeats=1, rounds=1, timer=timer)
    sparse = [lay for lay in layers if lay.router is not None]
    for arm, got in zip(arms, seen, strict=True):
        assert [w for w, _ in got] == [lay.warm for lay in sparse]
        assert {policy for _, policy in got} == {arm.warm or choices.L2_WARM}
    assert choices.l2_warm_in_force() is choices.L2_WARM
